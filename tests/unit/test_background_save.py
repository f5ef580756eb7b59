"""Saves that finish in the background while training goes on (``save_to(..., asynchronous=True)``).

The save is judged by what a resume from it does: the independent resident
reference run (``reference.reference_run``) of the whole run, byte for byte.
The checkpoint directory's writes are slowed (the fault harness's ``hang`` on
every write there) so that steps really run while the save is copying.
"""

import json
import os
import signal
import threading
import time

import pytest
import torch

from miles_plugins.optimizers.checkpoint.background import BackgroundSave
from miles_plugins.optimizers.checkpoint.manifest import MANIFEST_NAME
from miles_plugins.optimizers.errors import StreamIOError
from tests.faults import FaultPlan
from tests.helpers import (
    CAP,
    SAVE_AT,
    STEPS,
    all_three_homes,
    finish_and_save_again,
    fresh,
    partial_dirs,
    resume,
    start,
    train,
)

SLOW_WRITE_S = 0.05  # each write into the checkpoint directory: the save spans several steps


def _save_in_background_and_train_on(tmp_path, ckpt, steps_beside: int, **config):
    """Train SAVE_AT steps, start a background save, train ``steps_beside`` more while it
    runs; returns the live objects and the save's handle (ended)."""
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", **config)
    train(model, optimizer, scheduler, range(SAVE_AT))
    ckpt.mkdir()
    torch.save({"model": model.state_dict(), "scheduler": scheduler.state_dict()}, ckpt / "rest.pt")
    with FaultPlan(ckpt, "write", nth=1, fault="hang", times=None, hang_s=SLOW_WRITE_S):
        pending = streamed.save_to(str(ckpt), asynchronous=True)
        assert not pending.done(), "save_to returned after the save, not before"
        train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + steps_beside))
        pending.wait()
    return model, optimizer, scheduler, streamed, pending


@pytest.mark.parametrize(
    "config",
    [
        {"bucket_cap_elements": CAP},
        {"bucket_cap_elements": CAP, "tier": "host"},
        "three homes",
        {"bucket_cap_elements": CAP, "main_storage": "remainder"},
        {"bucket_cap_elements": CAP, "tier": "host", "main_storage": "remainder", "engine": "sync"},
    ],
    ids=["disk", "host", "gpu-host-disk", "disk-remainder", "host-remainder-sync"],
)
def test_a_background_save_holds_the_state_it_was_started_at(tmp_path, config):
    """Three steps run while the save copies; it holds the state at SAVE_AT, and a
    resume from it finishes byte-identical to an uninterrupted run."""
    config = all_three_homes() if config == "three homes" else config
    ckpt = tmp_path / "ckpt"
    *_, streamed, pending = _save_in_background_and_train_on(tmp_path, ckpt, 3, **config)
    assert streamed.store.steps_taken == SAVE_AT + 3
    assert json.loads((ckpt / "rank0" / MANIFEST_NAME).read_text())["steps_taken"] == SAVE_AT
    streamed.close()
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt, **config)
    assert streamed.load_from(str(ckpt))
    finish_and_save_again(ckpt, model, optimizer, scheduler, streamed)


def test_a_step_waits_only_for_the_bytes_it_would_overwrite(tmp_path):
    """On disk a step writes the spare slot: the first step after the save waits for
    nothing, the second (which writes the slot the save reads) for what is not copied
    yet. In host memory, written in place, the first step already waits."""
    ckpt = tmp_path / "ckpt"
    *_, streamed, disk = _save_in_background_and_train_on(tmp_path / "disk", ckpt, 1, bucket_cap_elements=CAP)
    streamed.close()
    assert disk.waited_buckets == 0
    *_, streamed, disk = _save_in_background_and_train_on(
        tmp_path / "disk2", tmp_path / "ckpt2", 2, bucket_cap_elements=CAP
    )
    streamed.close()
    assert disk.waited_buckets > 0
    *_, streamed, host = _save_in_background_and_train_on(
        tmp_path / "host", tmp_path / "ckpt3", 1, bucket_cap_elements=CAP, tier="host"
    )
    streamed.close()
    assert host.waited_buckets > 0


def test_a_background_save_that_fails_leaves_the_previous_one_and_training_goes_on(tmp_path, fault_report):
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", bucket_cap_elements=CAP)
    train(model, optimizer, scheduler, range(SAVE_AT))
    streamed.save_to(str(ckpt))
    torch.save({"model": model.state_dict(), "scheduler": scheduler.state_dict()}, ckpt / "rest.pt")
    before = {p.name: p.read_bytes() for p in (ckpt / "rank0").iterdir()}
    train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + 1))
    with FaultPlan(ckpt, "write", nth=3, fault="eio"):
        pending = streamed.save_to(str(ckpt), asynchronous=True)
        train(model, optimizer, scheduler, range(SAVE_AT + 1, SAVE_AT + 2))
        with pytest.raises(StreamIOError, match="Input/output error") as failed:
            pending.wait()
    assert {p.name: p.read_bytes() for p in (ckpt / "rank0").iterdir()} == before
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"]
    train(model, optimizer, scheduler, range(SAVE_AT + 2, SAVE_AT + 3))  # the store goes on
    streamed.close()
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt, bucket_cap_elements=CAP)
    assert streamed.load_from(str(ckpt))
    finish_and_save_again(ckpt, model, optimizer, scheduler, streamed)
    fault_report(
        "EIO during a background save",
        "the save's wait() raises; the previous checkpoint stays; training is not affected",
        f"{str(failed.value)[:70]}...; previous save byte for byte, resumed byte-identical",
        "the save in progress (reported by its handle)",
    )


def test_a_second_save_and_close_wait_for_the_one_running(tmp_path):
    """Two saves are never in flight at once: the next one (or close) waits for the first."""
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", bucket_cap_elements=CAP)
    train(model, optimizer, scheduler, range(SAVE_AT))
    with FaultPlan(tmp_path / "a", "write", nth=1, fault="hang", times=None, hang_s=SLOW_WRITE_S):
        first = streamed.save_to(str(tmp_path / "a"), asynchronous=True)
        streamed.save_to(str(tmp_path / "b"))
        assert first.done()
    second = streamed.save_to(str(tmp_path / "c"), asynchronous=True)
    streamed.close()
    assert second.done()
    for name in "abc":
        assert json.loads((tmp_path / name / "rank0" / MANIFEST_NAME).read_text())["steps_taken"] == SAVE_AT


@pytest.mark.fault
@pytest.mark.parametrize("nth", [1, 2, 4])
def test_a_process_killed_during_a_background_save_resumes_from_the_previous_one(tmp_path, nth, fault_report):
    """SIGKILL while the background save's ``nth`` write stalls (training went on
    meanwhile): the previous checkpoint is complete and resumes byte-identical; the
    cut-off save is a partial directory no load reads."""
    child = start("tests.unit.crash_child", "--work", str(tmp_path), "--kill-in", "background-save", "--nth", str(nth))
    deadline = time.monotonic() + 60
    while not (tmp_path / "stalled").exists():
        assert child.poll() is None, child.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the child never reached its stalled write"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()
    ckpt = tmp_path / "ckpt"
    assert json.loads((ckpt / "rank0" / MANIFEST_NAME).read_text())["steps_taken"] == SAVE_AT
    assert not any((partial / MANIFEST_NAME).exists() for partial in partial_dirs(ckpt))
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt)
    assert streamed.load_from(str(ckpt))
    finish_and_save_again(ckpt, model, optimizer, scheduler, streamed)
    fault_report(
        f"SIGKILL during a background save (its write {nth})",
        "the previous checkpoint complete and resumed byte-identical; the cut-off save never read",
        f"loaded the step-{SAVE_AT} save; finished byte-identical to an uninterrupted run (STEPS={STEPS})",
        "the steps since the last checkpoint",
    )


def test_an_interrupt_while_waiting_for_a_background_save_keeps_its_guard(tmp_path, monkeypatch):
    """Ctrl-C while a later save waits for the running one: the running one is still
    running and still guarded, so the steps after it cannot overwrite what it has to copy."""
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", bucket_cap_elements=CAP, tier="host")
    train(model, optimizer, scheduler, range(SAVE_AT))
    ckpt.mkdir()
    torch.save({"model": model.state_dict(), "scheduler": scheduler.state_dict()}, ckpt / "rest.pt")
    with FaultPlan(ckpt, "write", nth=1, fault="hang", times=None, hang_s=SLOW_WRITE_S):
        pending = streamed.save_to(str(ckpt), asynchronous=True)
        real_wait = type(pending).wait

        def interrupted(self, timeout_s=None):
            monkeypatch.setattr(type(pending), "wait", real_wait)
            raise KeyboardInterrupt

        monkeypatch.setattr(type(pending), "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            streamed.save_to(str(tmp_path / "other"))
        assert not pending.done()
        train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + 3))  # in place: each waits for its bucket
        pending.wait()
    streamed.close()
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt, bucket_cap_elements=CAP, tier="host")
    assert streamed.load_from(str(ckpt))
    finish_and_save_again(ckpt, model, optimizer, scheduler, streamed)


def test_the_overlap_window_reads_nothing_ahead_while_a_background_save_runs(tmp_path):
    """progress() never waits: with the save's guard in place it lands the deferred
    writes and leaves the reads ahead to the next call after the save."""
    model, optimizer, scheduler, streamed = fresh(
        tmp_path, "rank0", bucket_cap_elements=CAP, tier="host", overlap_bytes=1 << 20
    )
    train(model, optimizer, scheduler, range(3))
    with FaultPlan(tmp_path / "ckpt", "write", nth=1, fault="hang", times=None, hang_s=SLOW_WRITE_S):
        pending = streamed.save_to(str(tmp_path / "ckpt"), asynchronous=True)
        streamed.progress()
        assert not streamed.store._pipeline._prefetched and not pending.done()
        pending.wait()
    streamed.progress()
    assert streamed.store._pipeline._prefetched, "after the save the window reads ahead again"
    streamed.close()


@pytest.mark.parametrize("fails", ["its thread cannot start", "an interrupt before its thread starts"])
def test_a_background_save_that_never_starts_leaves_nothing_behind(tmp_path, monkeypatch, fails):
    """No partial directory, no lock (a later save of the name would be refused), no
    guard left for the steps to wait on."""
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", bucket_cap_elements=CAP)
    train(model, optimizer, scheduler, range(2))

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    def interrupted(*args):
        raise KeyboardInterrupt

    if fails == "its thread cannot start":
        monkeypatch.setattr(threading.Thread, "start", no_thread)
    else:
        monkeypatch.setattr(BackgroundSave, "__init__", interrupted)
    with pytest.raises((RuntimeError, KeyboardInterrupt)):
        streamed.save_to(str(tmp_path / "ckpt"), asynchronous=True)
    monkeypatch.undo()
    assert os.listdir(tmp_path / "ckpt") == [], "no partial directory, no lock file"
    train(model, optimizer, scheduler, range(2, 3))  # no guard was left to wait on
    streamed.save_to(str(tmp_path / "ckpt"), asynchronous=True).wait()
    streamed.close()


def test_an_interrupt_once_the_saves_thread_runs_leaves_it_running_under_its_guard(tmp_path, monkeypatch):
    """Ctrl-C inside the thread's start, after the thread began: the caller sees the
    interrupt, the save goes on, and the steps after it (host home: written in place)
    still wait for the bytes it has to copy, so it holds the state it was taken at."""
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", bucket_cap_elements=CAP, tier="host")
    train(model, optimizer, scheduler, range(SAVE_AT))
    ckpt.mkdir()
    torch.save({"model": model.state_dict(), "scheduler": scheduler.state_dict()}, ckpt / "rest.pt")
    real_start = threading.Thread.start

    def started_then_interrupted(self):
        real_start(self)
        raise KeyboardInterrupt

    with FaultPlan(ckpt, "write", nth=1, fault="hang", times=None, hang_s=0.05):
        monkeypatch.setattr(threading.Thread, "start", started_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            streamed.save_to(str(ckpt), asynchronous=True)
        monkeypatch.undo()
        train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + 3))
        streamed.close()  # waits for the save
    assert json.loads((ckpt / "rank0" / MANIFEST_NAME).read_text())["steps_taken"] == SAVE_AT
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt, bucket_cap_elements=CAP, tier="host")
    assert streamed.load_from(str(ckpt))
    finish_and_save_again(ckpt, model, optimizer, scheduler, streamed)
