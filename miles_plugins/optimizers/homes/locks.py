"""Lock files: one process at a time for a scratch directory, a save, a reshard.

A lock is an exclusive ``flock`` on a private file beside what it guards, taken
without following symlinks (``fs.open_file``). Its holder unlinks the file
before closing it (:func:`unlock_file`), so a waiting process checks, after
locking, that the file it holds is still the one at the path
(:func:`is_current_file`). :func:`lock_writer` writes the holder into the file
for the refusal a second writer gets. No torch here: the purge command imports it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Callable

from miles_plugins.optimizers.errors import StreamIOError
from miles_plugins.optimizers.homes.fs import open_file

# A lock file's holder unlinks it before closing it: whoever opened it just before
# can then lock a file no longer in place. Checked after every lock; this many tries.
_LOCK_ATTEMPTS = 5

# flock's errors where the filesystem has none (Lustre mounted noflock, NFS without a
# lock manager): a writer's lock is then skipped, with a warning.
NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def lock_file(path: str, wait_s: float) -> int | None:
    """An fd holding an exclusive ``flock`` on the file ``path`` (created if missing),
    trying for up to ``wait_s`` seconds; None while another process holds it. A
    file its holder removed between our open and our lock is not ours: the new one
    is taken instead."""
    for _ in range(_LOCK_ATTEMPTS):
        fd = open_file(path, os.O_RDWR | os.O_CREAT)
        try:
            locked = _flock_within(fd, wait_s)
        except OSError as exc:  # a filesystem without flock (ENOLCK, EOPNOTSUPP: Lustre noflock, NFS without lockd)
            os.close(fd)
            raise StreamIOError(f"cannot lock {path}: {exc.strerror}", path, 0, exc.errno) from exc
        if not locked:
            os.close(fd)
            return None
        if is_current_file(fd, path):
            return fd
        os.close(fd)
    raise StreamIOError(f"cannot take the lock {path}: it keeps being replaced", path, 0, errno.EAGAIN)


def lock_writer(path: str, what: str, advice: str, warn: Callable[[str], None]) -> int | None:
    """Hold the lock file ``path`` while this process does ``what`` (e.g. "a save of
    rank0 into /ckpt"); the holder (pid and host) is written inside it. Returns
    the fd to give :func:`unlock_file`; None where the filesystem has no flock
    (``warn`` is told: nothing then keeps a second writer out). Raises
    :class:`StreamIOError` (``EBUSY``) naming the holder while another process (or
    another lock of this one) holds it; ``advice`` says what to do."""
    try:
        fd = lock_file(path, 0)
    except StreamIOError as exc:
        if exc.errno not in NO_FLOCK:
            raise
        with contextlib.suppress(OSError):
            os.unlink(path)  # nobody can hold a lock there
        warn(
            f"the filesystem under {os.path.dirname(path)} has no flock ({os.strerror(exc.errno)}): {what} is not "
            "kept apart from another one into the same place; run one at a time"
        )
        return None
    if fd is None:
        raise StreamIOError(
            f"{what} is refused: another is under way ({_holder(path)} holds {path}); {advice}",
            path,
            0,
            errno.EBUSY,
        )
    try:
        # Who holds it, for a refused saver's message: worth no failure of its own (a full disk).
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except BaseException:  # an interrupt: the lock must not outlive this call
        unlock_file(path, fd)
        raise
    return fd


def _holder(path: str) -> str:
    """Who holds the lock file ``path``, as its holder wrote it (:func:`lock_writer`)."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        fd = open_file(path, os.O_RDONLY)
        try:
            text = os.pread(fd, 512, 0).decode().strip()
        finally:
            os.close(fd)
        if text:
            return text.splitlines()[0]
    return "another process"


def unlock_file(path: str, fd: int) -> None:
    """Drop a lock :func:`lock_file` took, and its file: unlinked while still held,
    so no other process can take a lock on the file being dropped."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


def is_current_file(fd: int, path: str) -> bool:
    """Whether the open file ``fd`` is still the one at ``path``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _flock_within(fd: int, seconds: float) -> bool:
    """Take an exclusive flock on ``fd``, trying for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
