"""Scratch and checkpoint directories on a shared machine: private, and never a way out.

Scratch often sits on a shared ``/scratch``. What another user could plant
there (a symlink where this rank's directory, its lock or a checkpoint belongs,
or inside a stale scratch) must be refused or removed, never followed; what
this process writes is readable by its user only.
"""

import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from miles_plugins.optimizers import StreamConfigError, StreamIOError
from tests.helpers import REPO, fresh, train, wrap

pytestmark = pytest.mark.fault


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("data")
    return victim


def test_scratch_and_checkpoints_are_private(tmp_path, fault_report):
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0")
    train(model, optimizer, scheduler, range(2))
    scratch = tmp_path / "scratch" / "rank0"
    streamed.save_to(str(tmp_path / "ckpt" / "iter"))
    saved = tmp_path / "ckpt" / "iter" / "rank0"
    dirs = [scratch, saved, tmp_path / "ckpt" / "iter"]
    files = [p for d in (scratch, saved) for p in d.iterdir()]
    assert all(_mode(d) == 0o700 for d in dirs), {str(d): oct(_mode(d)) for d in dirs}
    assert files and all(_mode(f) == 0o600 for f in files), {f.name: oct(_mode(f)) for f in files}
    streamed.close()
    fault_report(
        "permissions on a shared machine",
        "scratch and checkpoint directories 0700, files 0600",
        f"{len(dirs)} directories 0700, {len(files)} files 0600",
        "none",
    )


def test_the_startup_purge_never_follows_a_symlink(tmp_path, fault_report):
    victim = _victim(tmp_path)
    stale = tmp_path / "state" / "rank0"
    stale.mkdir(parents=True)
    os.symlink(victim, stale / "planted")  # inside a stale scratch of this rank
    streamed = wrap(tmp_path / "state", name="rank0")
    assert not (stale / "planted").exists() and (victim / "precious").read_text() == "data"
    os.symlink(victim, stale / "planted-later")  # inside the live scratch, before exit cleanup
    streamed.close()
    assert not stale.exists() and (victim / "precious").read_text() == "data"
    (tmp_path / "state").mkdir(exist_ok=True)
    os.symlink(victim, tmp_path / "state" / "rank0")  # where the scratch itself belongs
    with pytest.raises(StreamIOError, match="not a plain directory") as info:
        wrap(tmp_path / "state", name="rank0")
    assert (victim / "precious").read_text() == "data"
    fault_report(
        "symlinks planted in or as the scratch directory",
        "the purge and the exit cleanup remove links without following them; a link in the scratch's place is refused",
        f"links removed, target untouched; {info.value}",
        "none",
    )


def test_a_symlinked_lock_file_is_refused(tmp_path, fault_report):
    victim = _victim(tmp_path)
    (tmp_path / "state").mkdir()
    os.symlink(victim / "precious", tmp_path / "state" / ".rank0.lock")
    with pytest.raises(StreamIOError, match="cannot open .*lock: Too many levels of symbolic links") as info:
        wrap(tmp_path / "state", name="rank0")
    assert (victim / "precious").read_text() == "data"
    fault_report("a symlink planted as the lock file", "refused, not followed", str(info.value), "none")


def test_symlinks_where_a_checkpoint_belongs_are_refused(tmp_path, fault_report):
    victim = _victim(tmp_path)
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(victim, ckpt / ".rank0.partial")
    with pytest.raises(StreamIOError, match="not a plain directory") as partial:
        streamed.save_to(str(ckpt))
    os.unlink(ckpt / ".rank0.partial")
    os.symlink(victim, ckpt / "rank0")
    with pytest.raises(StreamIOError, match="not a plain directory") as final:
        streamed.save_to(str(ckpt))
    with pytest.raises(StreamIOError, match="not a plain directory"):
        streamed.load_from(str(ckpt))
    assert sorted(os.listdir(victim)) == ["precious"] and (victim / "precious").read_text() == "data"
    streamed.close()
    fault_report(
        "symlinks planted where a checkpoint's directories belong",
        "save and load refuse; nothing written through the link",
        f"{partial.value}; {final.value}",
        "none",
    )


def test_a_second_process_on_the_same_scratch_is_refused(tmp_path, fault_report):
    """E.g. rank numbering that restarts per cell: two processes both called rank0."""
    holder = textwrap.dedent(f"""
        import sys, torch
        from tests.helpers import wrap
        s = wrap({str(tmp_path)!r}, name="rank0")
        print("ready", flush=True)
        sys.stdin.read()
        s.close()
    """)
    first = subprocess.Popen(
        [sys.executable, "-c", holder],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout.readline().strip() == "ready"
        before = sorted(os.listdir(tmp_path / "rank0"))
        with pytest.raises(StreamConfigError, match="in use by another process") as info:
            wrap(tmp_path, name="rank0")
        assert sorted(os.listdir(tmp_path / "rank0")) == before, "the refused process must not touch the files"
    finally:
        first.communicate("")
    assert first.returncode == 0
    fault_report(
        "two processes on one scratch name",
        "the second is refused by the lock; the first's files untouched",
        str(info.value).replace(str(tmp_path), "<tmp>"),
        "none",
    )


def test_stale_scratch_of_this_rank_only_is_reclaimed(tmp_path, fault_report):
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "bucket_00099.slot0.bin").write_bytes(b"stale")
    (tmp_path / "rank1").mkdir()
    (tmp_path / "rank1" / "keep.bin").write_bytes(b"other rank")
    streamed = wrap(tmp_path, name="rank0", model=torch.nn.Linear(8, 8).to(torch.bfloat16))
    assert not (tmp_path / "rank0" / "bucket_00099.slot0.bin").exists()
    assert (tmp_path / "rank1" / "keep.bin").read_bytes() == b"other rank"
    streamed.close()
    fault_report(
        "stale scratch left by a killed run",
        "reclaimed at startup, this rank's subtree only",
        "rank0's stale files removed, rank1's kept",
        "none",
    )
