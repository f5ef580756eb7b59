"""Filesystem operations on the store's private files and directories.

Scratch and checkpoint directories often sit on shared filesystems where
another user can plant a symlink. Everything here opens with ``O_NOFOLLOW``,
creates files ``0600`` and directories ``0700``, refuses a symlink or a file
where one of its directories belongs (:class:`StreamIOError` with ``ELOOP``)
and removes directories without following links inside them. Every failure is
a :class:`StreamIOError` naming the path. Also here: the free-space check and
the size strings its messages and the flags use, and the filesystem type of a
path. Lock files are in ``locks.py``, replacing a directory in ``dir_replace.py``.

No torch here, nor in those two: the scratch purge command imports them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
from collections.abc import Iterator

from miles_plugins.optimizers.errors import StreamIOError

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
    after a ``dir_replace.replace_dir`` another may have taken its name."""
    if not os.path.lexists(path):
        return
    check_plain_dir(path)
    if only is not None and dir_identity(path) != only:
        return
    try:
        shutil.rmtree(path)
    except OSError as exc:
        raise StreamIOError(f"cannot remove {path}: {exc.strerror}", path, 0, exc.errno) from exc


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
