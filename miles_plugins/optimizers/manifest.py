"""The manifest of a saved streamed state: what a checkpoint holds and how to verify it.

A saved store is one directory::

    <checkpoint>/streamed_optimizer_state/<store name>/
        bucket_00000.bin ...   byte copies of the scratch bucket files
        resident.bin           moments of the fp32-native (resident) params, if any
        manifest.json          written last: its presence marks the save complete

The manifest records everything a load must match before it touches the live
state: the format version, the on-disk dtypes, the layout (buckets, per-entry
sizes, file sizes), the parallel topology (sizes and this rank's coordinates),
the optimizer's step counts and its small per-param state, and a size and
CRC-32 per file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

FORMAT = "miles.streamed_optimizer_state"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
RESIDENT_FILE = "resident.bin"


class CheckpointMismatchError(RuntimeError):
    """A saved streamed state that cannot be loaded into this store; the message says
    every way it differs (dtype, layout, topology, checksum, ...)."""


@dataclass
class Manifest:
    """The parsed ``manifest.json`` of one saved store."""

    data: dict[str, Any]

    @property
    def files(self) -> dict[str, dict[str, int]]:
        """File name -> {"size": bytes, "crc32": checksum}."""
        return self.data["files"]

    def write(self, directory: str) -> None:
        """Write the manifest durably into ``directory`` (the save's last file)."""
        path = os.path.join(directory, MANIFEST_NAME)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read(cls, directory: str) -> Manifest:
        path = os.path.join(directory, MANIFEST_NAME)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CheckpointMismatchError(
                f"{directory} holds no {MANIFEST_NAME}: the save that wrote it did not complete "
                "(or the directory is not a streamed optimizer state); it cannot be loaded"
            ) from None
        with os.fdopen(fd) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise CheckpointMismatchError(f"{path} is not valid JSON ({exc}); the checkpoint is damaged") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointMismatchError(f"{path} is not a streamed optimizer state manifest")
        if data.get("format_version") != FORMAT_VERSION:
            raise CheckpointMismatchError(
                f"{path} has format version {data.get('format_version')!r}; this version reads {FORMAT_VERSION}"
            )
        manifest = cls(data)
        for name in manifest.files:
            # A file name must stay inside the directory: no separators, no dot names.
            if not name or os.sep in name or name in (".", "..") or name.startswith("."):
                raise CheckpointMismatchError(f"{path} names a file outside its directory: {name!r}")
        return manifest


# The manifest fields a load compares with the live store, and how to name them.
COMPARED_FIELDS = (
    ("store", "store name"),
    ("main_dtype", "main dtype"),
    ("moment_dtype", "moment dtype"),
    ("topology", "parallel topology"),
    ("layout", "bucket layout"),
    ("resident_numels", "resident (fp32-native) params"),
    ("optimizer_class", "optimizer class"),
)


def _short(value: Any, limit: int = 200) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "..."


def differences(saved: dict[str, Any], live: dict[str, Any]) -> list[str]:
    """Every compared field where ``saved`` and ``live`` differ, described."""
    found = []
    for key, label in COMPARED_FIELDS:
        if saved.get(key) == live.get(key):
            continue
        if key == "layout":
            found.append(_layout_difference(saved.get(key) or [], live.get(key) or []))
        elif key == "topology":
            s, v = saved.get(key) or {}, live.get(key) or {}
            changed = ", ".join(
                f"{k} {s.get(k)} -> {v.get(k)}" for k in sorted(set(s) | set(v)) if s.get(k) != v.get(k)
            )
            found.append(f"{label} differs (checkpoint -> this run): {changed}")
        else:
            found.append(
                f"{label} differs: checkpoint has {_short(saved.get(key))}, this run has {_short(live.get(key))}"
            )
    return found


def _layout_difference(saved: list, live: list) -> str:
    if len(saved) != len(live):
        return f"bucket layout differs: checkpoint has {len(saved)} buckets, this run has {len(live)}"
    for i, (s, v) in enumerate(zip(saved, live, strict=True)):
        if s != v:
            return (
                f"bucket layout differs from bucket {i} on: checkpoint {_short(s, 120)}, this run {_short(v, 120)} "
                "(different model, parallel layout or bucket cap)"
            )
    return "bucket layout differs"
