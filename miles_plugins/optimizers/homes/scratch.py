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
epilog can run::

    python -m miles_plugins.optimizers.scratch purge DIR[,DIR...] [DIR ...]   (DIR/optimizer_state too)

It removes only scratch whose lock no process holds, owned by the caller,
never following symlinks, and says what it removed. Neither purge deletes a
directory holding a save's ``manifest.json`` (a checkpoint saved where the
scratch belongs): they leave it and say so. No torch is imported.

The live scratch directories of this process are known (:func:`live_scratch_overlap`):
a checkpoint save or load aimed at one is refused (``checkpoint/persistence.py``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import logging
import os
import signal
import stat
import sys
import threading

from miles_plugins.optimizers.errors import StreamConfigError, StreamIOError
from miles_plugins.optimizers.homes.fs import (
    MANIFEST_NAME,
    check_plain_dir,
    filesystem_type,
    format_bytes,
    make_dirs,
    make_private_dir,
    nearest_existing,
    open_file,
    remove_private_dir,
    require_free_space,
)
from miles_plugins.optimizers.homes.locks import is_current_file, lock_file, unlock_file

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
        os.ftruncate(fd, 0)
        os.pwrite(fd, LOCK_MARKER, 0)
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


# ---- the purge command ---------------------------------------------------------------


def purge(directory: str, prefix: str = "") -> tuple[list[str], list[str]]:
    """Remove the stale scratch under ``directory``: each ``<name>`` (starting with
    ``prefix``) whose marked lock file ``.<name>.lock`` no process holds and which
    the caller owns. Returns (lines saying what was removed, lines saying what was
    skipped and why)."""
    removed, skipped = [], []
    for entry in sorted(os.listdir(directory)):
        if not (entry.startswith(".") and entry.endswith(".lock")) or len(entry) <= len("..lock"):
            continue
        name = entry[1:-5]
        if not name.startswith(prefix):
            continue
        lock, path = os.path.join(directory, entry), os.path.join(directory, name)
        try:
            fd = open_file(lock, os.O_RDWR)
        except StreamIOError as exc:
            if os.path.lexists(path):
                skipped.append(f"{path}: cannot open its lock file ({exc})")
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or os.pread(fd, len(LOCK_MARKER), 0) != LOCK_MARKER:
                if os.path.lexists(path):
                    skipped.append(
                        f"{path}: its lock file does not carry this plugin's marker (an older version's, or "
                        "not a scratch at all); remove it by hand if it is stale scratch"
                    )
                continue
            if st.st_uid != os.geteuid():
                skipped.append(f"{path}: owned by uid {st.st_uid}, not by this user")
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                skipped.append(f"{path}: in use (a running process holds {lock})")
                continue
            if not is_current_file(fd, lock):
                skipped.append(f"{path}: its lock file was replaced while purging (a run started); left alone")
                continue
            if holds_a_save(path):
                skipped.append(f"{path}: holds a save ({MANIFEST_NAME}), not scratch; left alone, with its lock file")
                continue
            what = _remove_stale(path)
            if what is None:
                skipped.append(f"{path}: not a plain directory owned by this user; left alone")
                continue
            os.unlink(lock)  # while holding it, as ScratchDir does
            removed.append(f"removed {what}")
        finally:
            os.close(fd)
    return removed, skipped


def _remove_stale(path: str) -> str | None:
    """Remove the scratch directory at ``path`` (none there is fine); None when
    something else is there (a symlink, a file, another user's directory)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path} (already gone; its lock file removed)"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return None
    files, nbytes = 0, 0
    for root, _, names in os.walk(path):
        for file_name in names:
            with contextlib.suppress(OSError):
                nbytes += os.lstat(os.path.join(root, file_name)).st_size
                files += 1
    remove_private_dir(path)
    return f"{path} ({files} files, {format_bytes(nbytes)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m miles_plugins.optimizers.scratch",
        description="Remove optimizer-state scratch that killed runs left behind (for job epilogs).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    purge_parser = commands.add_parser(
        "purge", help="remove stale scratch (lock not held, owned by you) under each DIR; symlinks are never followed"
    )
    purge_parser.add_argument(
        "directories",
        nargs="+",
        metavar="DIR",
        help="an --offload-train-disk-dir, or its comma-separated list (its optimizer_state/ subdirectory, "
        "where the store lives, is purged too)",
    )
    args = parser.parse_args(argv)
    status = 0
    directories = []
    for given in args.directories:
        if "" in given.split(","):
            parser.error(f"{given!r}: an empty part in the comma-separated list; remove the stray comma")
    for directory in (part for given in args.directories for part in given.split(",")):
        directories.append(directory)
        if os.path.isdir(os.path.join(directory, STATE_SUBDIR)) and not os.path.islink(
            os.path.join(directory, STATE_SUBDIR)
        ):
            directories.append(os.path.join(directory, STATE_SUBDIR))
    for directory in directories:
        if not os.path.lexists(directory):
            print(f"nothing to purge: {directory} does not exist")  # no rank ever ran on this node
            continue
        if not os.path.isdir(directory):
            print(f"error: {directory} is not a directory", file=sys.stderr)
            status = 2
            continue
        try:
            removed, skipped = purge(directory)
        except OSError as exc:
            print(f"error: purging {directory} failed: {exc}", file=sys.stderr)
            status = 1
            continue
        for line in removed + [f"skipped {s}" for s in skipped]:
            print(line)
        if not removed and not skipped:
            print(f"nothing to purge in {directory}")
    return status
