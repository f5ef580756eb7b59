"""`make demo`'s program: its JSON report and its refusals.

A few tests run the command (``python -m miles_plugins.demo``): its exit status and
streams through the interpreter, its log lines, a run in a mount namespace of its own;
the others call its ``main`` in this process (``run_main``), read the same way.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO, run_main


def _demo_command(*args):
    """``python -m miles_plugins.demo args...`` in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "miles_plugins.demo", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        cwd=REPO,
    )


def _demo(*args):
    return run_main("miles_plugins.demo", *args)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """The command, four steps with the defaults, into an existing --dir: (result, --dir)."""
    directory = tmp_path_factory.mktemp("demo")
    return _demo_command("--steps", "4", "--dir", str(directory)), directory


def test_demo_reports_bit_identity_and_a_bounded_residency(four_steps):
    result, directory = four_steps
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["steps"] == 4
    assert report["bit_identical"] is True
    assert report["moment_dtype"] == "fp32"
    assert report["state_bytes_total"] >= 8 * report["bucket_bytes_max"]
    assert 0 < report["accounted_max_state_bytes"] <= report["buckets_in_flight"] * report["bucket_bytes_max"]
    assert (
        report["measured_step_peak_bytes"] is None
        or report["measured_step_peak_bytes"] <= report["step_device_bytes_bound"]
    )
    # Step 1 reads mains only (4 B/elem); later steps read mains and both moments.
    elements = report["state_bytes_total"] // 12
    assert report["bytes_read"] == 4 * elements + 3 * 12 * elements
    assert report["bytes_written"] == 4 * 12 * elements
    assert os.listdir(directory) == [], "the demo must remove its scratch directory"


def test_demo_places_buckets_in_all_three_homes_by_its_budgets(tmp_path):
    result = _demo("--steps", "3", "--gpu-budget", "200K", "--host-budget", "1M", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bit_identical"] is True
    placement = report["placement"]
    assert sorted(placement) == ["disk", "gpu", "host"] and min(placement.values()) >= 1, placement
    assert sum(placement.values()) == report["buckets"]


def test_demo_takes_auto_budgets(tmp_path):
    result = _demo("--steps", "3", "--gpu-budget", "auto", "--host-budget", "auto", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bit_identical"] is True and "up to auto on the cpu and auto in host memory" in result.stdout
    # The CPU has no allocator statistics: nothing stays in the device home.
    assert report["placement"]["gpu"] == 0 and sum(report["placement"].values()) == report["buckets"]


def test_demo_refuses_a_budget_that_is_not_a_size(tmp_path):
    result = _demo("--host-budget", "2 gigs", "--dir", str(tmp_path))
    assert result.returncode == 2
    assert "argument --host-budget: '2 gigs' is not a size" in result.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("moment_dtype", ["bf16", "8bit"])
def test_demo_with_compact_moments_is_not_bit_identical_but_succeeds(tmp_path, moment_dtype):
    result = _demo("--steps", "3", "--moment-dtype", moment_dtype, "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["moment_dtype"] == moment_dtype and report["bit_identical"] is False


def test_demo_builds_its_scheduler_after_wrapping(four_steps):
    """torch warns when a scheduler was built before optimizer.step() was replaced;
    the README says to build it after wrapping, and the demo must do as it says."""
    result, _ = four_steps
    assert result.returncode == 0, result.stderr
    assert "has been overridden after learning rate scheduler initialization" not in result.stderr


def test_demo_refuses_cuda_without_cuda_cleanly(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = _demo("--steps", "2", "--device", "cuda", "--dir", str(tmp_path))
    assert result.returncode == 2, "exit 1 means 'not bit-identical'"
    assert "error: --device cuda, but this torch sees no CUDA device" in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_removes_the_directories_it_created(tmp_path):
    result = _demo("--steps", "2", "--dir", str(tmp_path / "made" / "by" / "demo"))
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path) == [], "--dir and the parents the demo created must be gone"


def test_demo_refuses_a_removed_moment_dtype_saying_why(tmp_path):
    result = _demo("--steps", "2", "--moment-dtype", "fp16", "--dir", str(tmp_path))
    assert result.returncode == 2
    assert "'fp16' is no longer offered: unscaled" in result.stderr and "Traceback" not in result.stderr


def test_demo_refuses_a_bad_bucket_cap_cleanly(tmp_path):
    result = _demo("--steps", "2", "--bucket-cap", "0", "--dir", str(tmp_path))
    assert result.returncode == 2
    assert "error: bucket cap must be > 0" in result.stderr
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == []


def test_demo_refuses_a_dir_too_small_for_its_state_before_training(tmp_path):
    """The store's free-space check ran only when the streamed run began, after the
    whole resident run; the demo builds its store first. The --dir is a 1 MiB tmpfs
    (in a private mount namespace), the state needs about 16 MB."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small filesystem")
    small = tmp_path / "small"
    small.mkdir()
    demo = shlex.join([sys.executable, "-m", "miles_plugins.demo", "--steps", "2", "--dir", str(small)])
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(str(small))} && exec {demo}"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        cwd=REPO,
    )
    assert result.returncode == 2 and "not enough free space" in result.stderr, result.stdout + result.stderr
    assert "resident run" not in result.stdout and "Traceback" not in result.stderr


def test_demo_spreads_buckets_over_several_directories_and_removes_what_it_made(tmp_path):
    a, b = tmp_path / "a", tmp_path / "made" / "b"
    result = _demo_command("--steps", "2", "-v", "--dir", f"{a},{b}")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["bit_identical"] is True
    # One scratch directory in each, each holding buckets (the setup line counts them per directory).
    spread = re.search(
        rf"streams through {a}/miles-demo-\S+ \((\d+) buckets\), {b}/miles-demo-\S+ \((\d+) buckets\)", result.stderr
    )
    assert spread and min(int(n) for n in spread.groups()) >= 1, result.stderr
    assert os.listdir(tmp_path) == [], "the directories the demo created must be gone"


@pytest.mark.parametrize(
    "dirs, message",
    [
        ("{t}/a,{t}/a/", "names the same directory twice"),
        ("{t}/a,", "an empty directory name"),
        ("{t}/a,{t}/file", "{t}/file is not a directory"),
        (",".join(f"{{t}}/d{i}" for i in range(40)), "staging budget 128 MiB is too small"),  # a config refusal
    ],
    ids=["twice", "empty-part", "a-file", "more-than-the-staging-funds"],
)
def test_demo_refuses_bad_directory_lists_before_creating_anything(tmp_path, dirs, message):
    (tmp_path / "file").write_text("")
    result = _demo("--steps", "2", "--dir", dirs.format(t=tmp_path))
    assert result.returncode == 2 and message.format(t=tmp_path) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == ["file"]


def test_an_interrupt_while_the_demo_makes_its_directories_leaves_none_behind(tmp_path, monkeypatch):
    """Ctrl-C on a slow mount, between the first directory's scratch and the second's
    (the interrupt is raised by the second one's creation, standing in for the signal)."""
    from miles_plugins import demo
    from miles_plugins.optimizers.homes import placement

    made = []

    def scratch_dir(*args):
        if made:
            raise KeyboardInterrupt
        made.append(real_scratch_dir(*args))
        return made[-1]

    real_scratch_dir = placement.ScratchDir
    monkeypatch.setattr(placement, "ScratchDir", scratch_dir)
    assert demo.main(["--steps", "1", "--dir", f"{tmp_path}/p/a,{tmp_path}/p/b"]) == 130
    assert made and os.listdir(tmp_path) == [], "the scratch and the parents made for it must be gone"
