"""The manifest of a saved streamed state: what a checkpoint holds and how to verify it.

A saved store is one directory::

    <checkpoint>/streamed_optimizer_state/<store name>/
        bucket_00000.bin ...   byte copies of the scratch bucket files
        resident.bin           moments of the fp32-native (resident) params, if any
        manifest.json          written last: its presence marks the save complete

The manifest records everything a load must match before it touches the live
state: the format version, the on-disk dtypes, the layout (buckets, per-entry
sizes, file sizes), the parallel topology (sizes and this rank's coordinates),
the optimizer's step counts and its small per-param state, a size and CRC-32
per file, and (from format version 2) a CRC-32 of the manifest itself, so a
damaged or edited manifest is refused before anything in it is believed.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import dataclass
from typing import Any

from miles_plugins.optimizers.config import REMOVED_MOMENT_DTYPES
from miles_plugins.optimizers.errors import CheckpointMismatchError
from miles_plugins.optimizers.fs import fsync, open_file

logger = logging.getLogger(__name__)

FORMAT = "miles.streamed_optimizer_state"
# 2: the manifest carries its own checksum. Version 1 manifests still load
# (without that check), so checkpoints written before it stay usable.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
CHECKSUM_KEY = "manifest_crc32"
MANIFEST_NAME = "manifest.json"
RESIDENT_FILE = "resident.bin"


def checksum(data: dict[str, Any]) -> int:
    """CRC-32 of the manifest's canonical JSON, its own checksum left out."""
    body = {k: v for k, v in data.items() if k != CHECKSUM_KEY}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@dataclass
class Manifest:
    """The parsed ``manifest.json`` of one saved store."""

    data: dict[str, Any]

    @property
    def files(self) -> dict[str, dict[str, int]]:
        """File name -> {"size": bytes, "crc32": checksum}."""
        return self.data["files"]

    def write(self, directory: str) -> None:
        """Write the manifest durably into ``directory`` (the save's last file),
        with its own checksum."""
        data = {**self.data, "format": FORMAT, "format_version": FORMAT_VERSION}
        data[CHECKSUM_KEY] = checksum(data)
        path = os.path.join(directory, MANIFEST_NAME)
        with os.fdopen(open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            fsync(f.fileno(), path)

    def file_problems(self, directory: str) -> dict[str, str]:
        """File name -> what is wrong with it in ``directory`` (missing, or not the
        size the manifest says), for every file that is; nothing is read."""
        problems = {}
        for name, entry in sorted(self.files.items()):
            try:
                size = os.lstat(os.path.join(directory, name)).st_size
            except FileNotFoundError:
                problems[name] = f"{name} is missing"
                continue
            if size != entry["size"]:
                problems[name] = f"{name} has {size} bytes, the manifest says {entry['size']} (truncated?)"
        return problems

    @classmethod
    def read(cls, directory: str) -> Manifest:
        """Parse and verify ``directory``'s manifest: its format, its own checksum,
        and the shape of its file table. Its content is compared by the caller."""
        path = os.path.join(directory, MANIFEST_NAME)
        if not os.path.lexists(path):
            raise CheckpointMismatchError(
                f"{directory} holds no {MANIFEST_NAME}: the save that wrote it did not complete "
                "(or the directory is not a streamed optimizer state); it cannot be loaded"
            )
        fd = open_file(path, os.O_RDONLY)
        with os.fdopen(fd) as f:
            try:
                data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CheckpointMismatchError(f"{path} is not valid JSON ({exc}); the checkpoint is damaged") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointMismatchError(f"{path} is not a streamed optimizer state manifest")
        version = data.get("format_version")
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise CheckpointMismatchError(
                f"{path} has format version {version!r}; this version reads {', '.join(map(str, READABLE_VERSIONS))}"
            )
        if version >= 2 and data.get(CHECKSUM_KEY) != checksum(data):
            raise CheckpointMismatchError(
                f"{path} fails its own checksum ({CHECKSUM_KEY} {data.get(CHECKSUM_KEY)!r}, computed "
                f"{checksum(data)}): the manifest was damaged or edited; the checkpoint cannot be trusted"
            )
        if version < 2:
            logger.info("%s is a format-%d manifest: it carries no checksum of its own", path, version)
        files = data.get("files")
        if not isinstance(files, dict) or not all(_valid_file_entry(v) for v in files.values()):
            raise CheckpointMismatchError(f"{path} has a malformed file table; the checkpoint is damaged")
        for name in files:
            # A file name must stay inside the directory: no separators, no dot names.
            if not name or os.sep in name or name in (".", "..") or name.startswith("."):
                raise CheckpointMismatchError(f"{path} names a file outside its directory: {name!r}")
        return cls(data)


def _valid_file_entry(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and set(entry) == {"size", "crc32"}
        and all(type(v) is int and v >= 0 for v in entry.values())
    )


# The manifest fields a load compares with the live store, and how to name them.
COMPARED_FIELDS = (
    ("store", "store name"),
    ("main_dtype", "main dtype"),
    ("moment_dtype", "moment dtype"),
    ("moment_format", "moment format"),  # blockwise formats only; absent (None) otherwise
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
        if key == "moment_dtype" and saved.get(key) in REMOVED_MOMENT_DTYPES:
            found.append(
                f"the checkpoint stores its moments as {saved[key]}, which this version no longer reads: "
                f"{REMOVED_MOMENT_DTYPES[saved[key]]}. Start the optimizer fresh from the checkpoint's params "
                "(Megatron: --no-load-optim; plain PyTorch: skip load_from), or resume it with the version "
                "that wrote it"
            )
        elif key == "layout":
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
