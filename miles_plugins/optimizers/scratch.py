"""The per-process scratch directory that holds the bucket files.

Layout under the configured directory::

    <directory>/<name>/        this process's bucket files (mode 0700)
    <directory>/.<name>.lock   held (flock) while a process uses <name>

The subdirectory is named per rank, not per pid, so a restart of the same rank
finds and purges what a killed run left behind. The lock makes a second process
pointed at the same name refuse instead of corrupting the first one's state.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shutil
import stat

from miles_plugins.optimizers.config import StreamConfigError

logger = logging.getLogger(__name__)

RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


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


def _format_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class ScratchDir:
    """This process's private, locked scratch subdirectory.

    Construction checks before writing anything (directory creatable and
    writable, ``needed_bytes`` free), then takes the lock, purges what a previous
    run of the same name left, and creates the subdirectory. ``remove()`` (also
    run at interpreter exit) deletes it and releases the lock.
    """

    def __init__(self, directory: str, name: str, needed_bytes: int) -> None:
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, name)
        self._lock_path = os.path.join(self.directory, f".{name}.lock")
        self._lock_fd: int | None = None
        self._preflight(needed_bytes)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise StreamConfigError(f"cannot create state directory {self.directory}: {exc.strerror}") from exc
        fs_type = filesystem_type(self.directory)
        if fs_type in RAM_FILESYSTEMS:
            logger.warning(
                "state directory %s is on %s: the streamed optimizer state will live in "
                "host RAM, not on disk; point the directory at node-local NVMe to save RAM",
                self.directory,
                fs_type,
            )
        self._lock()
        try:
            self._purge()
            os.mkdir(self.path, 0o700)
        except BaseException:
            self._unlock()
            raise
        atexit.register(self.remove)

    def _preflight(self, needed_bytes: int) -> None:
        existing = _nearest_existing(self.directory)
        if not os.path.isdir(existing):
            raise StreamConfigError(
                f"cannot create state directory {self.directory}: {existing} exists and is not a directory"
            )
        if not os.access(existing, os.W_OK | os.X_OK):
            raise StreamConfigError(
                f"state directory {self.directory} is not writable: no write permission on {existing}"
            )
        free = shutil.disk_usage(existing).free
        if free < needed_bytes:
            raise StreamConfigError(
                f"not enough free space for the optimizer state in {self.directory}: "
                f"needs {_format_bytes(needed_bytes)} ({needed_bytes} bytes), "
                f"{_format_bytes(free)} ({free} bytes) free"
            )

    def _lock(self) -> None:
        try:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise StreamConfigError(f"cannot create lock file {self._lock_path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StreamConfigError(
                f"{self.path} is in use by another process (lock {self._lock_path} is held); "
                "give each process its own scratch name or directory"
            ) from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is None:
            return
        # Unlink while still holding the lock, so no other process can take a lock
        # on the file we are about to drop.
        try:
            os.unlink(self._lock_path)
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)
        self._lock_fd = None

    def _purge(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise StreamConfigError(
                f"refusing to purge {self.path}: it is not a plain directory "
                "(a symlink or file sits where this process's scratch belongs)"
            )
        logger.info("purging stale optimizer-state scratch %s", self.path)
        shutil.rmtree(self.path)

    @property
    def removed(self) -> bool:
        return self._lock_fd is None

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        """Delete the subdirectory and release the lock; safe to call twice."""
        if self._lock_fd is None:
            return
        atexit.unregister(self.remove)
        try:
            st = os.lstat(self.path)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(self.path)
        except FileNotFoundError:
            pass
        finally:
            self._unlock()
