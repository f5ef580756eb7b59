"""Filesystem operations on the store's private files and directories.

Scratch and checkpoint directories often sit on shared filesystems where
another user can plant a symlink. Everything here opens with ``O_NOFOLLOW``,
creates files ``0600`` and directories ``0700``, refuses a symlink or a file
where one of its directories belongs (:class:`StreamIOError` with ``ELOOP``)
and removes directories without following links inside them. Every failure is
a :class:`StreamIOError` naming the path.

:func:`replace_dir` puts a complete directory in place of another without a
moment where neither is there, with or without ``renameat2(RENAME_EXCHANGE)``.

No torch here: the scratch purge command imports this module alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterator

from miles_plugins.optimizers.errors import StreamIOError

logger = logging.getLogger(__name__)

# The file a complete save holds (written last, see ``checkpoint/manifest.py``). Named here, where
# no torch is imported, so that the scratch purge can tell a save from scratch.
MANIFEST_NAME = "manifest.json"

# Every open: never through a symlink (a planted link would redirect our writes),
# never inherited by a child process.
_SAFE_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC


def open_file(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that never follows a symlink; errors name the path."""
    try:
        return os.open(path, flags | _SAFE_OPEN, mode)
    except OSError as exc:
        raise StreamIOError(f"cannot open {path}: {exc.strerror}", path, 0, exc.errno) from exc


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


# flock's errors where the filesystem has none (Lustre mounted noflock, NFS without a
# lock manager): a writer's lock is then skipped, with a warning.
NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


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
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
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


# A lock file's holder unlinks it before closing it: whoever opened it just before
# can then lock a file no longer in place. Checked after every lock; this many tries.
_LOCK_ATTEMPTS = 5


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


@contextlib.contextmanager
def create_file(directory: str, name: str) -> Iterator[int]:
    """A new private file (``0600``, must not exist) in ``directory``; yields its fd."""
    fd = open_file(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        yield fd
    finally:
        os.close(fd)


def fsync(fd: int, path: str) -> None:
    """``os.fsync`` whose error names the file."""
    try:
        os.fsync(fd)
    except OSError as exc:
        raise StreamIOError(f"cannot make {path} durable (fsync): {exc.strerror}", path, 0, exc.errno) from exc


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (creations, renames) durable."""
    fd = open_file(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync(fd, path)
    finally:
        os.close(fd)


def check_plain_dir(path: str) -> None:
    """Refuse anything but a real directory at ``path`` (a symlink is not followed)."""
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise StreamIOError(
            f"refusing to use {path}: it is not a plain directory (a symlink or file sits where this "
            "process's state belongs); remove it or choose another directory",
            path,
            0,
            errno.ELOOP,
        )


def make_dirs(path: str) -> None:
    """Create directory ``path`` and any missing parents (``0700``); an existing
    one (a link to one included: it is the caller's choice of place) is fine."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise StreamIOError(f"cannot create directory {path}: {exc.strerror}", path, 0, exc.errno) from exc


def make_private_dir(path: str) -> None:
    """Create the new directory ``path`` (``0700``; it must not exist)."""
    try:
        os.mkdir(path, 0o700)
    except OSError as exc:
        raise StreamIOError(f"cannot create directory {path}: {exc.strerror}", path, 0, exc.errno) from exc


def dir_identity(path: str) -> tuple[int, int]:
    """(device, inode) of the directory entry ``path`` (not followed): which directory is there."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def remove_private_dir(path: str, only: tuple[int, int] | None = None) -> None:
    """Delete a directory the store made, never following symlinks inside it
    (``shutil.rmtree`` works through directory fds on Linux); refuse anything
    else found at that name. Nothing there is fine. With ``only`` (a
    :func:`dir_identity`), only while that directory is still the one at ``path``:
    after a :func:`replace_dir` another may have taken its name."""
    if not os.path.lexists(path):
        return
    check_plain_dir(path)
    if only is not None and dir_identity(path) != only:
        return
    try:
        shutil.rmtree(path)
    except OSError as exc:
        raise StreamIOError(f"cannot remove {path}: {exc.strerror}", path, 0, exc.errno) from exc


def _remove_replaced(path: str) -> None:
    """Remove a directory a replace has made obsolete; the new one is in place
    already, so a failure here is reported, not raised."""
    try:
        remove_private_dir(path)
    except StreamIOError as exc:
        logger.warning("%s; remove it by hand (the new save is complete and in place)", exc)


def nearest_existing(path: str) -> str:
    """``path``, or its closest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def format_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size such as ``3M``, ``2G``, ``1.5T`` or ``4096`` (binary units:
    K is 2**10, ... T is 2**40; an optional trailing ``B`` or ``iB`` is accepted).
    Raises ValueError saying what a size looks like."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*(?:([KMGT])(?:IB|B)?|B)?\s*", text.upper())
    if match is None:
        raise ValueError(f"{text!r} is not a size: give a number of bytes with an optional K, M, G or T, e.g. 3M, 2G")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])


def require_free_space(path: str, needed: int, what: str, note: str = "") -> None:
    """Refuse (``ENOSPC``) unless the filesystem holding ``path`` (or its nearest
    existing ancestor) has ``needed`` bytes free; ``what`` says what they are for,
    ``note`` is added to the message."""
    existing = nearest_existing(path)
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise StreamIOError(
            f"not enough free space for {what} in {path}: needs {format_bytes(needed)} ({needed} bytes), "
            f"{format_bytes(free)} ({free} bytes) free; nothing was written{note}",
            path,
            0,
            errno.ENOSPC,
        )


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem holding ``path``, from /proc/mounts (Linux)."""
    real = os.path.realpath(path)
    best, best_type = "", None
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount_point = fields[1].replace("\\040", " ")
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, fields[2]
    except OSError:
        return None
    return best_type


def _rename(src: str, dst: str) -> None:
    try:
        os.rename(src, dst)
    except OSError as exc:
        raise StreamIOError(f"cannot rename {src} to {dst}: {exc.strerror}", dst, 0, exc.errno) from exc


# ---- replacing a directory ------------------------------------------------------

# renameat2(2) flags and the "current directory" fd (Linux >= 3.15).
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# What renameat2 answers where the filesystem (NFS, some FUSE and network
# filesystems) or the kernel cannot exchange: fall back, do not fail.
_EXCHANGE_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})


@functools.cache
def _renameat2():
    """libc's renameat2, or None where libc lacks the symbol (glibc < 2.28, other libcs).
    Looked up on first use, not at import."""
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None


def _exchange(a: str, b: str) -> bool:
    """Atomically swap the directories at ``a`` and ``b``; False where the
    exchange is unavailable (nothing was changed then)."""
    renameat2 = _renameat2()
    if renameat2 is None:
        _note_fallback(b, "this libc has no renameat2")
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _EXCHANGE_UNSUPPORTED:
        _note_fallback(b, f"renameat2(RENAME_EXCHANGE) answered {errno.errorcode.get(err, err)}")
        return False
    raise StreamIOError(
        f"cannot swap {a} into place at {b}: {os.strerror(err)} (renameat2 RENAME_EXCHANGE; the previous "
        f"directory at {b} is untouched)",
        b,
        0,
        err,
    )


_fallback_noted: set[str] = set()


def _note_fallback(path: str, why: str) -> None:
    directory = os.path.dirname(path)
    if directory not in _fallback_noted:
        _fallback_noted.add(directory)
        logger.info("%s: %s; replacing saved state with a rename pair instead (see previous_path)", directory, why)


def previous_path(final: str) -> str:
    """Where :func:`replace_dir` keeps the previous directory while it renames
    without an atomic exchange: ``<parent>/.<name>.previous``."""
    return os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.previous")


def saved_dirs(directory: str) -> dict[str, str]:
    """Name -> path of every directory saved under ``directory`` by :func:`replace_dir`:
    ``<name>``, or ``.<name>.previous`` where a replace without an atomic exchange
    was cut off between its two renames (the previous complete save)."""
    names = set(os.listdir(directory))
    saved = {name: os.path.join(directory, name) for name in names if not name.startswith(".")}
    for name in names:
        original = name[1 : -len(".previous")] if name.startswith(".") and name.endswith(".previous") else ""
        if (
            original
            and original not in saved
            and previous_path(os.path.join(directory, original)) == os.path.join(directory, name)
        ):
            saved[original] = os.path.join(directory, name)
    return saved


def replace_dir(new: str, final: str) -> None:
    """Put the complete directory ``new`` at ``final``, removing what was there.

    With ``renameat2(RENAME_EXCHANGE)`` the two trade places in one atomic step.
    Where it is unavailable (NFS, old glibc) the sequence is: the previous
    directory moves to :func:`previous_path`, ``new`` moves to ``final``, the
    previous one is removed. A crash between the first two renames leaves no
    ``final`` but the complete previous directory at ``previous_path(final)``:
    readers fall back to it (see ``checkpoint/persistence.py``), and the next replace
    removes it only once a new ``final`` is in place. At no instant is neither
    complete directory there. Entries are fsynced after every rename.

    An error raised here leaves ``final`` (or, cut off between the fallback's renames,
    ``previous_path(final)``) holding what it held before and ``new`` holding the new
    directory: where the new one was in place already and making that durable failed,
    the previous one is put back first. Where even that fails, the new one stays,
    complete, and the replace returns (a warning says its entry may not be durable).
    The previous directory is removed only once the new one's entry is durable.
    """
    parent = os.path.dirname(final)
    backup = previous_path(final)
    if not os.path.lexists(final):
        # A backup here is the only complete previous state (a replace was cut off
        # after moving it aside): it goes only once `final` exists again.
        _rename(new, final)
        _make_durable_or_undo(parent, final, lambda: os.rename(final, new))
        _remove_replaced(backup)
        return
    check_plain_dir(final)
    if _exchange(new, final):
        _make_durable_or_undo(parent, final, lambda: _exchange_back(new, final))
        _remove_replaced(new)  # the previous directory, now at `new`
        _remove_replaced(backup)  # left by a fallback replace cut off after its second rename
        return
    remove_private_dir(backup)  # `final` is complete: a stale backup is not needed
    _rename(final, backup)
    try:
        fsync_dir(parent)
        _rename(new, final)
    except StreamIOError:
        with contextlib.suppress(OSError):
            os.rename(backup, final)  # put the previous one back; if that fails too, readers find the backup
        raise

    def undo() -> None:
        os.rename(final, new)  # fails: the new one stays in place
        with contextlib.suppress(OSError):
            os.rename(backup, final)  # if this fails, readers find the previous one at the backup

    _make_durable_or_undo(parent, final, undo)
    _remove_replaced(backup)


def _make_durable_or_undo(parent: str, final: str, undo: Callable[[], None]) -> None:
    """Fsync ``parent`` once a new directory took ``final``'s place; where that fails,
    ``undo()`` puts the previous one back and the failure is raised. Where the undo
    fails too, the new directory stays in place, complete, and this returns."""
    try:
        fsync_dir(parent)
    except StreamIOError as exc:
        try:
            undo()
        except OSError as undo_error:
            logger.warning(
                "%s; putting the previous directory back failed too (%s): the new one stays at %s, complete, "
                "but its entry may not survive a power loss until the filesystem is synced",
                exc,
                undo_error,
                final,
            )
            return
        with contextlib.suppress(OSError):
            fsync_dir(parent)
        raise StreamIOError(f"{exc}; the previous directory is back in place", exc.path, exc.offset, exc.errno) from exc


def _exchange_back(a: str, b: str) -> None:
    """Swap back what :func:`_exchange` swapped; raises OSError where it cannot."""
    renameat2 = _renameat2()
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), b)
