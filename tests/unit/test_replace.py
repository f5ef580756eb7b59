"""Replacing a saved state where ``renameat2(RENAME_EXCHANGE)`` is unavailable.

Checkpoints often live on shared filesystems: NFS answers the exchange with
EINVAL, and a libc older than glibc 2.28 has no ``renameat2`` at all. The
fallback renames the previous save aside, the new one into place, and removes
the previous one; a crash between the renames leaves the previous save where a
load finds it.
"""

import ctypes
import errno
import json
import logging
import os

import pytest
import torch

from miles_plugins.optimizers.checkpoint.manifest import MANIFEST_NAME
from miles_plugins.optimizers.homes import dir_replace
from tests.helpers import (
    SAVE_AT,
    STEPS,
    finish_and_save_again,
    listing,
    partial_dirs,
    resume,
    save_run,
    start,
    state_of,
    train,
)
from tests.unit.reference import assert_same_training, reference_run


@pytest.fixture
def no_exchange(monkeypatch, request):
    """renameat2 refused with EINVAL (NFS), or missing from libc (old glibc)."""
    if request.param == "EINVAL":

        def refuse(*args):
            ctypes.set_errno(errno.EINVAL)
            return -1

        monkeypatch.setattr(dir_replace, "_renameat2", lambda: refuse)
    else:

        class OldLibc:
            def __init__(self, *args, **kwargs):
                pass  # a libc without the symbol: attribute lookups fail

        dir_replace._renameat2.cache_clear()
        monkeypatch.setattr(dir_replace.ctypes, "CDLL", OldLibc)
        assert dir_replace._renameat2() is None
    yield request.param
    monkeypatch.undo()
    dir_replace._renameat2.cache_clear()  # forget the missing symbol: the next test finds the real one


@pytest.mark.fault
@pytest.mark.parametrize("no_exchange", ["EINVAL", "no renameat2 symbol"], indirect=True)
def test_a_save_replaces_the_previous_one_without_the_exchange(tmp_path, caplog, no_exchange, fault_report):
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = save_run(tmp_path, ckpt)
    train(model, optimizer, scheduler, range(SAVE_AT, STEPS))
    with caplog.at_level(logging.INFO, logger="miles_plugins.optimizers.homes.dir_replace"):
        streamed.save_to(str(ckpt))
    torch.save({"model": model.state_dict(), "scheduler": scheduler.state_dict()}, ckpt / "rest.pt")
    assert "replacing saved state with a rename pair" in caplog.text
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"], "no previous or partial copy may be left"
    assert json.loads((ckpt / "rank0" / MANIFEST_NAME).read_text())["steps_taken"] == STEPS
    # The replaced save loads and holds the uninterrupted run's state.
    streamed.close()
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt)
    assert streamed.load_from(str(ckpt)) and streamed.store.steps_taken == STEPS
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()
    fault_report(
        f"checkpoint replace without RENAME_EXCHANGE ({no_exchange})",
        "falls back to a rename pair; the new save is complete, nothing left beside it",
        "replaced; loads byte-identical to the uninterrupted run",
        "none",
    )


@pytest.mark.fault
def test_a_crash_between_the_fallback_renames_resumes_from_the_previous_save(tmp_path, caplog, fault_report):
    child = start("tests.unit.crash_child", "--work", str(tmp_path), "--kill-in", "replace")
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 9, stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    left = listing(ckpt)
    # The lock file stays too (a dead holder's flock is gone with it): the next save takes it.
    assert left == [".rank0.partial-*", ".rank0.partial.lock", ".rank0.previous", "rest.pt"], left
    with caplog.at_level(logging.WARNING):
        model, optimizer, scheduler, streamed = resume(tmp_path, ckpt)
        assert streamed.load_from(str(ckpt))
    assert "loading the previous save" in caplog.text
    finish_and_save_again(ckpt, model, optimizer, scheduler, streamed)
    fault_report(
        "crash between the fallback's renames (no RENAME_EXCHANGE)",
        "the load finds the previous save; the next save cleans up",
        f"left {', '.join(left)}; loaded the step-{SAVE_AT} save from .rank0.previous, finished byte-identical; "
        "the next save left only rank0",
        "the save in progress (its caller never saw it return)",
    )


def test_a_backup_left_beside_a_complete_save_is_removed_by_the_next_save(tmp_path):
    """A fallback replace cut off after its second rename leaves the new save in
    place and the previous one beside it: loads read the new one, and the next
    save (with or without the exchange) removes the leftover."""
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = save_run(tmp_path, ckpt)
    (ckpt / ".rank0.previous").mkdir()
    (ckpt / ".rank0.previous" / "manifest.json").write_text("{}")
    assert streamed.load_from(str(ckpt)) and streamed.store.steps_taken == SAVE_AT
    streamed.save_to(str(ckpt))
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"]
    streamed.close()


def _fail_parent_fsync(monkeypatch, parent, nth: int, error: BaseException) -> list[str]:
    """Make the ``nth`` fsync of ``parent``'s entries raise ``error`` (EIO from the drive,
    an interrupt); returns the log of fsynced directories."""
    real, seen = dir_replace.fsync_dir, []

    def fsync_dir(path):
        seen.append(path)
        if path == str(parent) and seen.count(path) == nth:
            raise error
        return real(path)

    monkeypatch.setattr(dir_replace, "fsync_dir", fsync_dir)
    return seen


@pytest.mark.fault
@pytest.mark.parametrize(
    "how, nth",
    [("exchange", 1), ("fallback", 2)],
    ids=["after-the-exchange", "after-the-fallback-s-second-rename"],
)
def test_a_save_whose_new_entry_cannot_be_made_durable_puts_the_previous_one_back(
    tmp_path, monkeypatch, how, nth, fault_report
):
    """The parent's fsync fails (EIO) once the new save has taken the previous one's
    place: the save raises, and the previous one is back in place, byte for byte (it
    used to raise with the new save in place and the previous one deleted)."""
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = save_run(tmp_path, ckpt)
    before = {p.name: p.read_bytes() for p in (ckpt / "rank0").iterdir()}
    train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + 2))
    if how == "fallback":
        monkeypatch.setattr(dir_replace, "_renameat2", lambda: None)
    eio = dir_replace.StreamIOError(f"cannot make {ckpt} durable (fsync): Input/output error", str(ckpt), 0, errno.EIO)
    _fail_parent_fsync(monkeypatch, ckpt, nth, eio)
    with pytest.raises(dir_replace.StreamIOError, match="the previous directory is back in place") as raised:
        streamed.save_to(str(ckpt))
    monkeypatch.undo()
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"], "the failed save's directory is removed"
    assert {p.name: p.read_bytes() for p in (ckpt / "rank0").iterdir()} == before
    streamed.close()
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt)
    assert streamed.load_from(str(ckpt))
    finish_and_save_again(ckpt, model, optimizer, scheduler, streamed)
    fault_report(
        f"EIO fsyncing the checkpoint's entries once the new save is in place ({how})",
        "the save raises and the previous save is put back",
        f"raised {str(raised.value).split(': ', 1)[-1][:60]}...; the step-{SAVE_AT} save byte for byte, resumed "
        "byte-identical",
        "the save in progress (reported as failed)",
    )


def test_where_the_previous_save_cannot_be_put_back_the_new_one_stays_and_the_save_returns(
    tmp_path, monkeypatch, caplog
):
    """EIO fsyncing the exchange, and the swap back refused too: the new save is in
    place, complete, so the save is done (a warning says its entry may not be durable)."""
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = save_run(tmp_path, ckpt)
    train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + 1))
    eio = dir_replace.StreamIOError(f"cannot make {ckpt} durable (fsync): Input/output error", str(ckpt), 0, errno.EIO)
    _fail_parent_fsync(monkeypatch, ckpt, 1, eio)

    def refuse(a, b):
        raise OSError(errno.EROFS, "Read-only file system", b)

    monkeypatch.setattr(dir_replace, "_exchange_back", refuse)
    with caplog.at_level(logging.WARNING, logger="miles_plugins.optimizers.homes.dir_replace"):
        streamed.save_to(str(ckpt))
    assert "putting the previous directory back failed too" in caplog.text
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"]
    assert json.loads((ckpt / "rank0" / MANIFEST_NAME).read_text())["steps_taken"] == SAVE_AT + 1
    streamed.close()


@pytest.mark.fault
def test_an_interrupt_right_after_the_exchange_keeps_the_complete_new_save(tmp_path, monkeypatch, fault_report):
    """Ctrl-C between the exchange and its fsync: the new save is in place, complete, and
    the cleanup leaves what the exchange put at the partial name (the previous save)
    alone instead of taking it for the failed save's files; the next save clears it."""
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = save_run(tmp_path, ckpt)
    train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + 1))
    _fail_parent_fsync(monkeypatch, ckpt, 1, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        streamed.save_to(str(ckpt))
    monkeypatch.undo()
    left = listing(ckpt)
    assert left == [".rank0.partial-*", "rank0", "rest.pt"], left
    (partial,) = partial_dirs(ckpt)
    assert json.loads((partial / MANIFEST_NAME).read_text())["steps_taken"] == SAVE_AT
    streamed.close()
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt)
    assert streamed.load_from(str(ckpt)) and streamed.store.steps_taken == SAVE_AT + 1
    streamed.save_to(str(ckpt))
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"]
    streamed.close()
    fault_report(
        "interrupt between the checkpoint exchange and its fsync",
        "the new save is complete in place; the previous one is not taken for the failed save's files",
        f"left {', '.join(left)}; loaded the step-{SAVE_AT + 1} save; the next save cleared the rest",
        "none",
    )
