"""Processes killed with SIGKILL mid-step and mid-save, and what a restart finds.

The victim is a real training process (``crash_child.py``) that the fault
harness stalls at a known write; this test kills it there, then restarts the
same rank in this process and resumes from the last checkpoint.
"""

import json
import logging
import os
import signal
import time

import pytest

from miles_plugins.optimizers.checkpoint.manifest import MANIFEST_NAME
from tests.helpers import SAVE_AT, finish_and_save_again, partial_dirs, resume, start

pytestmark = pytest.mark.fault


def _kill_when_stalled(work, kill_in: str) -> int:
    child = start("tests.unit.crash_child", "--work", str(work), "--kill-in", kill_in)
    deadline = time.monotonic() + 60
    while not (work / "stalled").exists():
        if child.poll() is not None:
            pytest.fail(f"the child exited ({child.returncode}) before stalling:\n{child.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail("the child never reached its stalled write")
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()
    return child.returncode


@pytest.mark.parametrize("kill_in", ["step", "save"])
def test_a_killed_process_restarts_from_its_last_checkpoint(tmp_path, caplog, fault_report, kill_in):
    ckpt = tmp_path / "ckpt"
    assert _kill_when_stalled(tmp_path, kill_in) == -signal.SIGKILL
    assert (tmp_path / "scratch" / "rank0").is_dir(), "the killed run's scratch is left behind"
    saved = json.loads((ckpt / "rank0" / MANIFEST_NAME).read_text())
    assert saved["steps_taken"] == SAVE_AT, "the complete checkpoint is the one before the kill"
    if kill_in == "save":
        (partial,) = partial_dirs(ckpt)
        assert partial.is_dir() and not (partial / MANIFEST_NAME).exists(), "the save was cut off half way"

    with caplog.at_level(logging.INFO):
        model, optimizer, scheduler, streamed = resume(tmp_path, ckpt)
    assert "purging stale optimizer-state scratch" in caplog.text
    assert streamed.load_from(str(ckpt))
    finish_and_save_again(ckpt, model, optimizer, scheduler, streamed)
    fault_report(
        f"SIGKILL mid-{kill_in}",
        "restart purges the scratch; the cut-off save is never taken for a complete one; the last "
        "checkpoint resumes byte-identical",
        "stale scratch purged at restart; "
        + ("the half-written partial directory ignored, then removed by the next save; " if kill_in == "save" else "")
        + f"loaded the step-{SAVE_AT} checkpoint; finished byte-identical to an uninterrupted run",
        "the steps since the last checkpoint (the killed process's params and grads died with it, as "
        "without streaming)",
    )
