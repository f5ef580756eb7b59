"""The per-process scratch directory that holds the bucket files, and its cleanup.

Layout under the configured directory::

    <directory>/<name>/        this process's bucket files (mode 0700)
    <directory>/.<name>.lock   held (flock) while a process uses <name>

The subdirectory is named per rank, not per pid, so a restart of the same rank
finds and purges what a killed run left behind. The lock makes a second process
pointed at the same name refuse instead of corrupting the first one's state.

The scratch goes away at ``close()``, at interpreter exit, and on SIGTERM (the
way schedulers stop jobs): see :func:`_on_sigterm`. What a SIGKILL leaves is
reclaimed by the next run of the same rank, or by the purge command a job
epilog can run (``scratch_purge.py``). Neither purge deletes a directory
holding a save's ``manifest.json`` (a checkpoint saved where the scratch
belongs): they leave it and say so. No torch is imported.

The live scratch directories of this process are known (:func:`live_scratch_overlap`):
a checkpoint save or load aimed at one is refused (``checkpoint/persistence.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import stat
import threading

from miles_plugins.optimizers.errors import StreamConfigError, StreamIOError
from miles_plugins.optimizers.homes.fs import (
    MANIFEST_NAME,
    check_plain_dir,
    filesystem_type,
    make_dirs,
    make_private_dir,
    nearest_existing,
    remove_private_dir,
    require_free_space,
)
from miles_plugins.optimizers.homes.locks import lock_file, unlock_file

logger = logging.getLogger(__name__)

RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
# Written into every lock file: the purge command removes only scratch whose
# lock file says it is one (a stray ".x.lock" beside a directory "x" is not).
LOCK_MARKER = b"miles optimizer-state scratch lock\n"
# The subdirectory of an --offload-train-disk-dir the store's scratch lives in
# (defined here, where the purge command needs it without torch; args.py uses it).
STATE_SUBDIR = "optimizer_state"
# How the demo (``miles_plugins.demo``) names its scratch, ``<prefix><pid>``, directly
# in its --dir, where the purge command finds what a killed demo left.
DEMO_SCRATCH_PREFIX = "miles-demo-"


class ScratchDir:
    """This process's private, locked scratch subdirectory, made in two steps.

    Construction checks that the directory is creatable and writable, creates
    it, takes the lock and purges what a previous run of the same name left.
    :meth:`create` then checks that ``needed_bytes`` are free and creates the
    subdirectory: free space is measured only once the stale scratch is gone, so
    a restart after a kill has the room its killed run held (the caller may
    measure in between too, as ``Placement`` does to deal buckets over
    directories). ``remove()`` (also run at interpreter exit and on SIGTERM)
    deletes the subdirectory and releases the lock; a caller whose
    :meth:`create` failed calls it (the state directory itself stays, empty).
    """

    def __init__(self, directory: str, name: str) -> None:
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, name)
        self._lock_path = _lock_path(self.directory, name)
        self._lock_fd: int | None = None
        # A forked child inherits this object, the atexit hook and the SIGTERM
        # handler: only the process that made the scratch may remove it.
        self._owner_pid = os.getpid()
        self._preflight()
        make_dirs(self.directory)
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
        except BaseException:
            self._unlock()
            raise
        # Compared with checkpoint targets, which are compared as real paths too.
        self.real_path = os.path.realpath(self.path)
        atexit.register(self.remove)
        with _live_lock:
            _live.add(self)
        _install_sigterm_cleanup()

    def create(self, needed_bytes: int) -> None:
        """Create the subdirectory, once ``needed_bytes`` are free where it goes."""
        require_free_space(self.directory, needed_bytes, "the optimizer state's bucket files")
        make_private_dir(self.path)

    def _preflight(self) -> None:
        existing = nearest_existing(self.directory)
        if not os.path.isdir(existing):
            raise StreamConfigError(
                f"cannot create state directory {self.directory}: {existing} exists and is not a directory"
            )
        if not os.access(existing, os.W_OK | os.X_OK):
            raise StreamConfigError(
                f"state directory {self.directory} is not writable: no write permission on {existing}"
            )

    def _lock(self) -> None:
        fd = lock_file(self._lock_path, _LOCK_WAIT_S)
        if fd is None:
            raise StreamConfigError(
                f"{self.path} is in use by another process, or by another store of this one (lock "
                f"{self._lock_path} held for {_LOCK_WAIT_S:g} s); give each its own scratch name or directory"
            )
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, LOCK_MARKER, 0)  # the purge command removes only scratch whose lock says so
        except BaseException as exc:
            unlock_file(self._lock_path, fd)
            if isinstance(exc, OSError):
                raise StreamIOError(
                    f"cannot write the lock {self._lock_path}: {exc.strerror}", self._lock_path, 0, exc.errno
                ) from exc
            raise
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is None:
            return
        unlock_file(self._lock_path, self._lock_fd)
        self._lock_fd = None

    def _purge(self) -> None:
        if not os.path.lexists(self.path):
            return
        check_plain_dir(self.path)
        if holds_a_save(self.path):
            raise StreamConfigError(
                f"{self.path} holds a save ({MANIFEST_NAME}), not scratch: a checkpoint was saved into the state "
                f"directory {self.directory} under this store's name; left as it is. Move it out of "
                f"{self.directory} (load it from its new parent directory) or delete it, then start again"
            )
        logger.info("purging stale optimizer-state scratch %s", self.path)
        remove_private_dir(self.path)

    def remove(self) -> None:
        """Delete the subdirectory and release the lock; safe to call twice, and a
        no-op in a forked child (the scratch is its parent's)."""
        if self._lock_fd is None or os.getpid() != self._owner_pid:
            return
        atexit.unregister(self.remove)
        with _live_lock:
            _live.discard(self)
        try:
            remove_private_dir(self.path)
        except (FileNotFoundError, StreamIOError):
            pass  # gone, or replaced by something that is not ours: never followed
        finally:
            self._unlock()


def _lock_path(directory: str, name: str) -> str:
    return os.path.join(directory, f".{name}.lock")


# How long a starting process waits for a lock held by someone else: long enough
# for a purge (a job epilog) to finish with a stale scratch of the same name, short
# enough that two processes given the same name are told so at once.
_LOCK_WAIT_S = 5.0


# ---- SIGTERM -----------------------------------------------------------------------

# The scratch directories of this process not yet removed. Stores are made and closed
# from any thread; reentrant, as the SIGTERM handler may run while the main thread holds it.
_live: set[ScratchDir] = set()
_live_lock = threading.RLock()


def live_scratch_overlap(path: str) -> str | None:
    """How ``path`` meets the scratch directory of a live store of this process
    (one not yet removed), e.g. ``"is the scratch directory /nvme/state/rank0"``
    (or ``holds``, ``lies inside``), comparing real paths; None when it meets none."""
    real = os.path.realpath(path)
    with _live_lock:
        scratches = sorted(scratch.real_path for scratch in _live)
    for scratch in scratches:
        if real == scratch:
            return f"is the scratch directory {scratch}"
        if os.path.commonpath([real, scratch]) == real:
            return f"holds the scratch directory {scratch}"
        if os.path.commonpath([real, scratch]) == scratch:
            return f"lies inside the scratch directory {scratch}"
    return None


def holds_a_save(path: str) -> bool:
    """Whether ``path`` is a plain directory holding a save's manifest: a checkpoint,
    not scratch, whatever its name (a save aimed at the state directory puts it there)."""
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False
    return is_dir and os.path.lexists(os.path.join(path, MANIFEST_NAME))


# The SIGTERM handler found when ours was installed (what it chains to).
_previous_handler: object = None
_installed = False
# The process that installed it (a forked child inherits the handler, not the scratch).
_installer_pid: int | None = None


def _forget_in_child() -> None:
    """After fork, in the child: the scratch and its lock are the parent's. Closing
    the inherited lock fd keeps a long-lived child (an async-save worker) from
    holding the lock past its parent's death, which would refuse the restart. The
    set's lock is made anew: a thread of the parent may have held it at the fork."""
    global _live_lock
    _live_lock = threading.RLock()
    for scratch in _live:
        if scratch._lock_fd is not None:
            os.close(scratch._lock_fd)
            scratch._lock_fd = None
    _live.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _install_sigterm_cleanup() -> None:
    """Remove the scratch on SIGTERM (see :func:`_on_sigterm`). Installed once, from
    the main thread only (Python delivers signals there); elsewhere the exit
    cleanup still runs on a graceful exit. Not installed when the process
    ignores SIGTERM: it goes on running, and so must its scratch."""
    global _installed, _previous_handler, _installer_pid
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN or previous is None:
        # Ignored, or a handler installed outside Python that cannot be chained to:
        # leave SIGTERM alone (the exit cleanup still runs on a graceful exit).
        return
    _previous_handler = previous
    _installer_pid = os.getpid()
    signal.signal(signal.SIGTERM, _on_sigterm)
    _installed = True


def _on_sigterm(signum: int, frame) -> None:
    """SIGTERM: chain to a handler the launcher installed first, else clean up and die.

    A Python handler found at install time (e.g. Megatron's
    ``--exit-signal-handler``, which lets the training loop save a checkpoint
    and exit) runs instead; if it returns, the process goes on and needs its
    scratch, which the exit cleanup removes when the process ends. Otherwise
    (the default action) every live scratch of this process (not of a parent it
    was forked from) is removed and the signal is raised
    again with the default action, so the process ends as SIGTERM would have
    ended it (exit status -15 to its parent).
    """
    if callable(_previous_handler):
        _previous_handler(signum, frame)
        return
    # In a forked child (an async-save worker, say) the scratch is the parent's: keep it.
    with _live_lock:
        scratches = list(_live) if os.getpid() == _installer_pid else []
    for scratch in scratches:
        try:
            scratch.remove()
        except Exception:  # noqa: BLE001 - dying anyway; leave the rest to the purge
            logger.exception("removing %s on SIGTERM failed", scratch.path)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
