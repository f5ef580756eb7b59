"""SIGTERM (how schedulers stop jobs) and the purge command for what SIGKILL leaves.

The victims are real training processes (``sigterm_child.py``); nothing is
simulated but the stalled write that holds one of them mid-step.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from miles_plugins.optimizers.checkpoint.manifest import MANIFEST_NAME
from miles_plugins.optimizers.homes import scratch as scratch_module
from miles_plugins.optimizers.homes import scratch_purge
from tests.helpers import REPO, start, wrap

pytestmark = pytest.mark.fault


def _start(work, handler: str) -> subprocess.Popen:
    return start("tests.unit.sigterm_child", "--work", str(work), "--handler", handler)


def _wait_for(child: subprocess.Popen, path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        if child.poll() is not None:
            pytest.fail(f"the child exited ({child.returncode}) early:\n{child.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail(f"the child never wrote {path.name}")
        time.sleep(0.05)


def test_sigterm_mid_step_removes_the_scratch_and_ends_the_process_as_sigterm_does(tmp_path, fault_report):
    child = _start(tmp_path, "none")
    _wait_for(child, tmp_path / "stalled")
    files = len(os.listdir(tmp_path / "scratch" / "rank0"))
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGTERM, stderr[-3000:]
    assert os.listdir(tmp_path / "scratch") == [], "the scratch and its lock file must be gone"
    fault_report(
        "SIGTERM mid-step (no handler of the launcher's)",
        "scratch removed; the process ends as SIGTERM would have ended it",
        f"{files} scratch files removed; exit status {child.returncode} (killed by SIGTERM)",
        "the steps since the last checkpoint (the process was stopped)",
    )


def test_sigterm_chains_to_the_launchers_handler_and_keeps_the_scratch_until_exit(tmp_path, fault_report):
    """Megatron's --exit-signal-handler lets the loop save a checkpoint first: the
    scratch must survive the signal, and go when the process exits."""
    child = _start(tmp_path, "launcher")
    _wait_for(child, tmp_path / "ready")
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 0, stderr[-3000:]
    assert (tmp_path / "handled").read_text().startswith(f"[{int(signal.SIGTERM)}]")
    assert (tmp_path / "ckpt" / "rank0" / MANIFEST_NAME).exists(), "the checkpoint after the signal is complete"
    assert os.listdir(tmp_path / "scratch") == [], "the exit cleanup removed the scratch"
    fault_report(
        "SIGTERM with the launcher's own handler (Megatron --exit-signal-handler)",
        "the launcher's handler runs; the run saves a checkpoint; the scratch goes at exit",
        f"handler called ({(tmp_path / 'handled').read_text()}); checkpoint complete; scratch removed; exit 0",
        "none",
    )


def _purge(*dirs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles_plugins.optimizers.scratch", "purge", *map(str, dirs)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
    )


def _stale_scratch(directory, name: str, files: int = 3) -> None:
    """What a SIGKILLed rank leaves: its directory and its marked, unheld lock file."""
    (directory / name).mkdir(parents=True)
    for i in range(files):
        (directory / name / f"bucket_{i:05d}.slot0.bin").write_bytes(b"x" * 4096)
    (directory / f".{name}.lock").write_bytes(scratch_module.LOCK_MARKER)


def test_purge_removes_stale_scratch_only(tmp_path, fault_report):
    _stale_scratch(tmp_path, "rank0")
    live = wrap(tmp_path, name="rank1")  # a running process's scratch: its lock is held
    (tmp_path / "notes").mkdir()
    (tmp_path / ".notes.lock").write_text("someone else's lock file")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("data")
    os.symlink(victim, tmp_path / "rank9")
    (tmp_path / ".rank9.lock").write_bytes(scratch_module.LOCK_MARKER)
    result = _purge(tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"removed {tmp_path / 'rank0'} (3 files, 0.0 MiB)" in result.stdout
    assert f"skipped {tmp_path / 'rank1'}: in use" in result.stdout
    assert f"skipped {tmp_path / 'rank9'}: not a plain directory" in result.stdout
    assert not (tmp_path / "rank0").exists() and not (tmp_path / ".rank0.lock").exists()
    assert (tmp_path / "rank1").is_dir() and (tmp_path / "notes").is_dir() and (tmp_path / ".notes.lock").exists()
    assert (victim / "precious").read_text() == "data", "a symlink is never followed"
    live.close()
    assert "nothing to purge" in _purge(tmp_path / "victim").stdout
    missing = _purge(tmp_path / "missing")  # an epilog on a node where no rank ran
    assert missing.returncode == 0 and "does not exist" in missing.stdout
    not_a_dir = _purge(tmp_path / "victim" / "precious")
    assert not_a_dir.returncode == 2 and "is not a directory" in not_a_dir.stderr
    fault_report(
        "purge command (job epilog)",
        "removes stale scratch only: not a live one, not a symlink's target, not foreign files",
        result.stdout.strip().replace("\n", "; ").replace(str(tmp_path), "<tmp>"),
        "none",
    )


def test_purge_leaves_another_users_scratch(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to create a directory owned by another user")
    _stale_scratch(tmp_path, "rank0")
    os.chown(tmp_path / ".rank0.lock", 4242, 4242)
    os.chown(tmp_path / "rank0", 4242, 4242)
    result = _purge(tmp_path)
    assert "owned by uid 4242" in result.stdout
    assert (tmp_path / "rank0").is_dir()


def test_purge_leaves_a_scratch_whose_lock_was_replaced_under_it(tmp_path, monkeypatch):
    """The interleaving that let purge delete a live scratch: between purge's open
    of the stale lock file and its flock, that run's owner exits (unlinking the
    file) and the next run of the rank starts with a new lock file. The flock
    then succeeds on a file no longer in place; purge must notice."""
    first = wrap(tmp_path, name="rank0")
    real_flock = scratch_purge.fcntl.flock
    later = {}

    def interleave(fd, operation):
        if not later:
            later["run"] = None
            first.close()  # run 1 exits: its lock file is unlinked, then closed
            later["run"] = wrap(tmp_path, name="rank0")  # run 2 of the same rank
        return real_flock(fd, operation)

    monkeypatch.setattr(scratch_purge.fcntl, "flock", interleave)
    removed, skipped = scratch_purge.purge(str(tmp_path))
    monkeypatch.undo()
    assert removed == [] and any("replaced while purging" in s for s in skipped), skipped
    assert (tmp_path / "rank0").is_dir() and (tmp_path / ".rank0.lock").exists(), "run 2's scratch must survive"
    later["run"].close()


def test_a_forked_child_never_removes_its_parents_scratch(tmp_path):
    """Megatron forks workers (async checkpoint saves): they inherit the scratch
    object, its exit hook and the SIGTERM handler, but not the scratch."""
    import multiprocessing

    streamed = wrap(tmp_path, name="rank0")  # installs the SIGTERM cleanup in this (main) thread
    files = sorted(os.listdir(tmp_path / "rank0"))
    context = multiprocessing.get_context("fork")
    worker = context.Process(target=time.sleep, args=(60,))
    worker.start()
    time.sleep(0.5)
    worker.terminate()  # SIGTERM
    worker.join(30)
    assert worker.exitcode == -signal.SIGTERM
    exiting = context.Process(target=sys.exit, args=(0,))  # a child that exits normally: atexit runs
    exiting.start()
    exiting.join(30)
    assert sorted(os.listdir(tmp_path / "rank0")) == files and (tmp_path / ".rank0.lock").exists()
    streamed.close()
    assert os.listdir(tmp_path) == []


def test_purge_of_an_offload_dir_covers_the_stores_subdirectory(tmp_path):
    """The store lives in <--offload-train-disk-dir>/optimizer_state/: an epilog that
    purges the offload dir it knows reaches it too."""
    _stale_scratch(tmp_path / "optimizer_state", "rank0.opt0")
    result = _purge(tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"removed {tmp_path / 'optimizer_state' / 'rank0.opt0'} (3 files" in result.stdout
    assert not (tmp_path / "optimizer_state" / "rank0.opt0").exists()


def test_purge_takes_a_comma_separated_list_as_offload_train_disk_dir_does(tmp_path):
    """`purge /nvme0/x,/nvme1/x` (the flag's value, pasted) said "does not exist", exit 0."""
    a, b = tmp_path / "nvme0", tmp_path / "nvme1"
    _stale_scratch(a / "optimizer_state", "rank0.opt0")
    _stale_scratch(b / "optimizer_state", "rank0.opt0")
    result = _purge(f"{a},{b}")
    assert result.returncode == 0, result.stderr
    assert os.listdir(a / "optimizer_state") == [] and os.listdir(b / "optimizer_state") == [], result.stdout
    empty_part = _purge(f"{a},")
    assert empty_part.returncode == 2 and "an empty part" in empty_part.stderr


def test_setup_removes_this_ranks_scratch_of_the_layout_before_the_subdirectory(tmp_path, caplog):
    """Earlier versions kept <dir>/rank<k>.opt<i> directly in the offload dir; a killed
    run's leftovers there are this rank's to reclaim (other ranks' are left to them)."""
    from miles_plugins.optimizers.nvme_stream import _purge_previous_layout

    _stale_scratch(tmp_path, "rank0.opt0")
    _stale_scratch(tmp_path, "rank1.opt0")
    with caplog.at_level("WARNING"):
        _purge_previous_layout(str(tmp_path), "rank0")
    assert not (tmp_path / "rank0.opt0").exists() and (tmp_path / "rank1.opt0").is_dir()
    assert any("scratch of an earlier version" in r.getMessage() for r in caplog.records)
    _purge_previous_layout(str(tmp_path / "missing"), "rank0")  # nothing there: nothing to do


def _demo_holding_its_scratch(directory) -> subprocess.Popen:
    """``python -m miles_plugins.demo --dir directory``, once its store's scratch is locked."""
    child = start("miles_plugins.demo", "--steps", "300", "--dir", str(directory))
    deadline = time.monotonic() + 60
    while not list(directory.rglob(".*.lock")):
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            pytest.fail(f"the demo never locked a scratch ({child.wait()}):\n{child.stderr.read()[-3000:]}")
        time.sleep(0.05)
    return child


def test_sigterm_to_the_demo_leaves_nothing_in_its_dir(tmp_path):
    """The store's SIGTERM cleanup removed its scratch, but the demo's own directory
    around it (miles-demo-XXXX/) stayed."""
    child = _demo_holding_its_scratch(tmp_path)
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGTERM, stderr[-3000:]
    assert os.listdir(tmp_path) == []


def test_purge_of_a_demos_dir_removes_what_a_killed_demo_left(tmp_path):
    """After a SIGKILL, `scratch purge DIR` with the demo's --dir finds its scratch (it
    said "nothing to purge" while the state sat one level down)."""
    child = _demo_holding_its_scratch(tmp_path)
    child.kill()
    child.communicate(timeout=60)
    result = _purge(tmp_path)
    assert result.returncode == 0 and "removed" in result.stdout, result.stdout + result.stderr
    assert os.listdir(tmp_path) == []
