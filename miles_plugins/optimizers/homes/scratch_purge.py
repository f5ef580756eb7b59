"""The purge command: remove the scratch that killed runs left, for job epilogs::

    python -m miles_plugins.optimizers.scratch purge DIR[,DIR...] [DIR ...]   (DIR/optimizer_state too)

It removes only scratch (``scratch.ScratchDir``'s layout) whose marked lock file
no process holds, owned by the caller, never following symlinks, and says what
it removed and what it left and why; a directory holding a save's
``manifest.json`` is left. No torch is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import stat
import sys

from miles_plugins.optimizers.errors import StreamIOError
from miles_plugins.optimizers.homes.fs import MANIFEST_NAME, format_bytes, open_file, remove_private_dir
from miles_plugins.optimizers.homes.locks import is_current_file
from miles_plugins.optimizers.homes.scratch import LOCK_MARKER, STATE_SUBDIR, holds_a_save


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
