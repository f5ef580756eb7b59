"""Saves of one name into one checkpoint directory are exclusive.

A job that did not die (a zombie, a duplicate launch) beside its restart, or two
stores given one name, save into the same place: without a lock the second
saver's start removed the first one's partial directory, the first wrote on
into the second's and published a mix of both (its CRCs fail; the previous
good save was gone). The lock ``.<name>.partial.lock`` is held from the partial
directory's creation to the publish; a second saver is refused in one line
naming the holder, and the previous checkpoint stays as it was. Each saver
writes into a partial directory of its own, so where the filesystem has no
flock two savers still never write into one directory: the last to publish wins,
whole.
"""

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch

from miles_plugins.optimizers.checkpoint import partials, writer
from miles_plugins.optimizers.checkpoint.manifest import MANIFEST_NAME
from miles_plugins.optimizers.errors import StreamIOError
from tests.helpers import SAVE_AT, finish_and_save_again, fresh, partial_dirs, resume, save_run, train

# A second process holding a save's lock, as a running save does, until its stdin closes.
_HOLDER = """
import sys
from miles_plugins.optimizers.homes.locks import lock_writer
fd = lock_writer(sys.argv[1], "a save", "", print)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.fault
def test_a_second_process_saving_the_same_name_is_refused_naming_the_holder(tmp_path, fault_report):
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = save_run(tmp_path, ckpt)
    before = {p.name: p.read_bytes() for p in (ckpt / "rank0").iterdir()}
    train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + 1))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(ckpt / ".rank0.partial.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(StreamIOError) as refused:
            streamed.save_to(str(ckpt))
    finally:
        holder.communicate("", timeout=30)
    message = str(refused.value)
    assert refused.value.errno == errno.EBUSY and "\n" not in message
    assert f"pid {holder.pid} on {socket.gethostname()}" in message, message
    # The holder's lock file is left by its exit (its flock is gone): the refused save left nothing.
    assert sorted(os.listdir(ckpt)) == [".rank0.partial.lock", "rank0", "rest.pt"]
    assert {p.name: p.read_bytes() for p in (ckpt / "rank0").iterdir()} == before
    streamed.save_to(str(ckpt))  # the holder is gone: saves go on
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"]
    assert json.loads((ckpt / "rank0" / MANIFEST_NAME).read_text())["steps_taken"] == SAVE_AT + 1
    streamed.close()
    fault_report(
        "a second process saves the same name into the same checkpoint directory",
        "refused in one line naming the holder; the previous save untouched",
        message.split(" is refused: ", 1)[1][:70] + "...",
        "none",
    )


def _race(tmp_path, monkeypatch) -> dict:
    """Two savers of one name, forced to overlap: A pauses after its first bucket file,
    B saves meanwhile, then A goes on. Returns their errors; asserts the published save
    loads (every CRC holds: one saver's files only) and holds A's state when A saved last."""
    ckpt = tmp_path / "ckpt"
    a = fresh(tmp_path / "a", "rank0", bucket_cap_elements=500)
    b = fresh(tmp_path / "b", "rank0", bucket_cap_elements=500)
    for model, optimizer, scheduler, _ in (a, b):
        train(model, optimizer, scheduler, range(3))
    train(*b[:3], range(3, 4))  # B's state differs from A's
    real_create, paused, go = writer.create_file, threading.Event(), threading.Event()

    def create_file(directory, name):
        if threading.current_thread().name == "A" and name == "bucket_00001.bin":
            paused.set()
            go.wait(30)
        return real_create(directory, name)

    monkeypatch.setattr(writer, "create_file", create_file)
    errors = {}

    def save(who, streamed):
        try:
            streamed.save_to(str(ckpt))
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            errors[who] = exc

    saver_a = threading.Thread(target=save, args=("A", a[3]), name="A")
    saver_a.start()
    assert paused.wait(30)
    save("B", b[3])  # while A writes
    go.set()
    saver_a.join(30)
    monkeypatch.undo()
    expected = {p: (m.clone(), ma.clone(), va.clone()) for p, m, ma, va in a[3].iter_state()}
    b[3].close()
    model, optimizer, scheduler, streamed = fresh(tmp_path / "c", "rank0", bucket_cap_elements=500)
    assert streamed.load_from(str(ckpt))
    loaded = {p: (m, ma, va) for p, m, ma, va in streamed.iter_state()}
    for (param, want), got in zip(expected.items(), loaded.values(), strict=True):
        if param.dtype != torch.float32:  # fp32 params are their own mains: the model's, not saved here
            assert all(torch.equal(x, y) for x, y in zip(want, got, strict=True))
    a[3].close()
    streamed.close()
    assert not partial_dirs(ckpt), "no partial directory left by either saver"
    return errors


def test_two_savers_of_one_name_racing_publish_one_complete_save(tmp_path, monkeypatch):
    """The race the lock closes: B is refused, A publishes a complete save."""
    errors = _race(tmp_path, monkeypatch)
    assert list(errors) == ["B"] and errors["B"].errno == errno.EBUSY, errors


def test_without_flock_two_racing_savers_each_write_their_own_and_the_last_wins(tmp_path, monkeypatch):
    """No lock keeps B out (Lustre noflock, faked): B's start must not remove A's partial
    directory, A must not write into B's; both publish, A last, and A's save is whole."""
    _no_flock_in(monkeypatch, tmp_path / "ckpt")
    assert _race(tmp_path, monkeypatch) == {}


def test_where_the_filesystem_has_no_flock_saves_go_on_unlocked_saying_so(tmp_path, monkeypatch, caplog):
    """Lustre mounted noflock, NFS without a lock manager (faked here: this machine's
    filesystems have flock): the save completes, and says a second saver is not kept out."""
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = save_run(tmp_path, ckpt)
    streamed.close()
    _no_flock_in(monkeypatch, ckpt)
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt)
    assert streamed.load_from(str(ckpt))
    with caplog.at_level("WARNING"):
        streamed.save_to(str(ckpt))
    assert "has no flock (No locks available): a save of the optimizer state rank0" in caplog.text
    monkeypatch.undo()
    finish_and_save_again(ckpt, model, optimizer, scheduler, streamed)


def _no_flock_in(monkeypatch, directory) -> None:
    """flock fails with ENOLCK on the files under ``directory`` (the scratch's keep it)."""
    real_flock = fcntl.flock

    def no_flock(fd, operation):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory)):
            raise OSError(errno.ENOLCK, "No locks available")
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", no_flock)


def test_a_lock_that_cannot_record_its_holder_still_locks_and_is_released(tmp_path, monkeypatch):
    """The holder written into the lock file is for a refused saver's message only: a
    full disk there fails nothing, and the lock is released after the save."""
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = save_run(tmp_path, ckpt)
    real_ftruncate = os.ftruncate

    def full(fd, length):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".partial.lock"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_ftruncate(fd, length)

    monkeypatch.setattr(os, "ftruncate", full)
    train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + 1))
    streamed.save_to(str(ckpt))
    monkeypatch.undo()
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"], "the lock is gone with the save"
    streamed.save_to(str(ckpt))  # and nothing holds it
    streamed.close()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


@pytest.mark.parametrize("flock", [True, False])
def test_the_next_save_removes_what_cut_off_saves_left_and_only_that(tmp_path, monkeypatch, flock):
    """Holding the name's lock, a save removes every partial directory of the name (no
    other saver can be running); without flock, only those of gone processes of this
    host. Other names' partial directories are never touched."""
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = save_run(tmp_path, ckpt)
    host = partials._host()
    left = {
        "dead here": f".rank0.partial-{host}-{_dead_pid()}-0badc0de",
        "live here": f".rank0.partial-{host}-{os.getpid()}-0badc0de",
        "other host": ".rank0.partial-ffffffff-1-0badc0de",
        "earlier version": ".rank0.partial",
        "other name": f".rank01.partial-{host}-{_dead_pid()}-0badc0de",
    }
    for entry in left.values():
        (ckpt / entry).mkdir()
        (ckpt / entry / "bucket_00000.bin").write_bytes(b"cut off")
    if not flock:
        _no_flock_in(monkeypatch, ckpt)
    streamed.save_to(str(ckpt))
    monkeypatch.undo()
    kept = {what for what, entry in left.items() if (ckpt / entry).exists()}
    assert kept == ({"other name"} if flock else {"live here", "other host", "earlier version", "other name"})
    assert json.loads((ckpt / "rank0" / MANIFEST_NAME).read_text())["steps_taken"] == SAVE_AT
    streamed.close()
