"""Launch check for torch_memory_saver's disk-backup backend.

Disk offload of the paused training actor goes through torch_memory_saver,
loaded with ``LD_PRELOAD``. Only builds compiled with the disk-backup backend
can do it; a build without it would fall back to host RAM, which is what these
runs lack. Such builds carry the ``TMS_INIT_ENABLE_DISK_BACKUP`` marker string.
"""

from __future__ import annotations

import os

DISK_BACKUP_MARKER = b"TMS_INIT_ENABLE_DISK_BACKUP"
TMS_LIBRARY_HINT = "torch_memory_saver"

_CHUNK = 1 << 20


class TorchMemorySaverError(RuntimeError):
    """The torch_memory_saver library cannot back up to disk; the message says why."""


def _contains(path: str, needle: bytes) -> bool:
    overlap = len(needle) - 1
    tail = b""
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            if needle in tail + chunk:
                return True
            tail = chunk[-overlap:]
    return False


def check_disk_backup_support(library_path: str) -> None:
    """Refuse unless ``library_path`` is a torch_memory_saver build with the disk-backup backend."""
    if not os.path.isfile(library_path):
        raise TorchMemorySaverError(
            f"torch_memory_saver library {library_path} (from LD_PRELOAD) does not exist; "
            "point LD_PRELOAD at the installed torch_memory_saver_hook_mode_preload*.so"
        )
    if not _contains(library_path, DISK_BACKUP_MARKER):
        raise TorchMemorySaverError(
            f"torch_memory_saver library {library_path} was built without the disk-backup backend "
            f"(no {DISK_BACKUP_MARKER.decode()} in the binary): disk offload would silently keep the "
            "state in host RAM. Install torch-memory-saver >= 0.0.10 or rebuild it with disk backup."
        )


def check_preloaded_tms(ld_preload: str | None = None) -> list[str]:
    """Check every torch_memory_saver library named in ``LD_PRELOAD``; return the ones checked.

    Raises when none is preloaded: disk offload needs it.
    """
    ld_preload = os.environ.get("LD_PRELOAD", "") if ld_preload is None else ld_preload
    libraries = [p for p in ld_preload.replace(":", " ").split() if TMS_LIBRARY_HINT in os.path.basename(p)]
    if not libraries:
        raise TorchMemorySaverError(
            "disk offload needs torch_memory_saver preloaded, but LD_PRELOAD names no "
            f"{TMS_LIBRARY_HINT} library (LD_PRELOAD={ld_preload!r})"
        )
    for library in libraries:
        check_disk_backup_support(library)
    return libraries
