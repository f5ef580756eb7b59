"""Putting a complete directory in place of another, with no moment where neither is there.

:func:`replace_dir` trades the two places in one atomic step with
``renameat2(RENAME_EXCHANGE)``, or, where the filesystem or libc has no exchange,
with a pair of renames through :func:`previous_path`; :func:`saved_dirs` finds
what a replace left, a cut-off one included. Checkpoint saves and reshards publish
through it. No torch here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
from collections.abc import Callable

from miles_plugins.optimizers.errors import StreamIOError
from miles_plugins.optimizers.homes.fs import check_plain_dir, fsync_dir, remove_private_dir

logger = logging.getLogger(__name__)

# renameat2(2) flags and the "current directory" fd (Linux >= 3.15).
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# What renameat2 answers where the filesystem (NFS, some FUSE and network
# filesystems) or the kernel cannot exchange: fall back, do not fail.
_EXCHANGE_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})


def _rename(src: str, dst: str) -> None:
    try:
        os.rename(src, dst)
    except OSError as exc:
        raise StreamIOError(f"cannot rename {src} to {dst}: {exc.strerror}", dst, 0, exc.errno) from exc


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


def _remove_replaced(path: str) -> None:
    """Remove a directory a replace has made obsolete; the new one is in place
    already, so a failure here is reported, not raised."""
    try:
        remove_private_dir(path)
    except StreamIOError as exc:
        logger.warning("%s; remove it by hand (the new save is complete and in place)", exc)
