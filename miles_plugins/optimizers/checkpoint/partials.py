"""Where a save is written before it replaces the previous one: a partial directory of
its own, ``<base_dir>/.<name>.partial-<host>-<pid>-<token>`` (``<host>``: 8 hex digits
of a hash of the host's name, which may be 64 bytes long).

Each saver writes into its own, so two savers of one name never write into the same
directory, also where the filesystem has no flock to keep them apart (Lustre mounted
``noflock``, NFS without a lock manager): the last one to publish wins, whole. What a
saver that was killed left is removed by a later save of the name: all of it while
that save holds the name's lock (no other saver can be running), and otherwise only
the partial directories of processes of this host that are gone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket

from miles_plugins.optimizers.homes.fs import remove_private_dir

logger = logging.getLogger(__name__)


def new_partial_path(base_dir: str, name: str) -> str:
    """A partial directory path no other saver uses (not created here)."""
    return os.path.join(base_dir, f"{_prefix(name)}-{_host()}-{os.getpid()}-{secrets.token_hex(4)}")


def remove_stale_partials(base_dir: str, name: str, locked: bool) -> None:
    """Remove what cut-off saves of ``name`` left in ``base_dir``: every partial directory
    where the caller holds the name's lock (``locked``), else those of gone processes of
    this host (a live saver elsewhere may still be writing its own)."""
    host = _host()
    for entry in sorted(os.listdir(base_dir)):
        owner = _owner(entry, name)
        if owner is None or not (locked or (owner[0] == host and not _alive(owner[1]))):
            continue
        logger.info("removing %s, left by a save of %s that was cut off", os.path.join(base_dir, entry), name)
        remove_private_dir(os.path.join(base_dir, entry))


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _prefix(name: str) -> str:
    return f".{name}.partial"


def _owner(entry: str, name: str) -> tuple[str, int] | None:
    """(host, pid) of the saver a partial directory of ``name`` belongs to; ("", 0) for the
    unnamed one of earlier versions; None for any other entry (the lock file included)."""
    if entry == _prefix(name):
        return "", 0
    if not entry.startswith(_prefix(name) + "-"):
        return None
    parts = entry[len(_prefix(name)) + 1 :].split("-")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2]:
        return None
    return parts[0], int(parts[1])


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True
