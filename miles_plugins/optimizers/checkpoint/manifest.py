"""The manifest of a saved streamed state: what a checkpoint holds and how to verify it.

A saved store is one directory::

    <checkpoint>/streamed_optimizer_state/<store name>/
        bucket_00000.bin ...   byte copies of the scratch bucket files
        resident.bin           moments of the fp32-native (resident) params, if any
        manifest.json          written last: its presence marks the save complete

The manifest records everything a load must match before it touches the live
state: the format version, the on-disk dtypes, the layout (buckets, per-entry
sizes, file sizes), the parallel topology (sizes and this rank's coordinates),
the optimizer's step counts and its small per-param state, which elements of
which param each entry holds (``pieces``), each file's size and checksums, and
a CRC-32 of the manifest itself, so a damaged or edited manifest is refused
before anything in it is believed.

Format versions, all read: 1 has one CRC-32 per file; 2 adds the manifest's own
CRC-32; 3 checksums each file per ``crc_block_bytes`` block, so a read of part
of a file (a load at another DP size) can verify what it read; 4 records where
each param sits in the global tensors Megatron checkpoints (``param_facts``: its
key and global boxes, ``megatron/param_facts.py``; None for a plain-PyTorch save),
so a load at another TP, PP or EP size finds the saved elements it needs.
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
from miles_plugins.optimizers.homes.fs import MANIFEST_NAME, fsync, open_file

logger = logging.getLogger(__name__)

FORMAT = "miles.streamed_optimizer_state"
# The version written, and those read (see the module docstring).
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
CHECKSUM_KEY = "manifest_crc32"
# A multiple of the direct-I/O alignment, so a block-aligned partial read can be direct.
CRC_BLOCK_BYTES = 4 << 20
RESIDENT_FILE = "resident.bin"
# What a refusal to load a saved state offers instead of resuming it.
START_FRESH = "start the optimizer fresh from the checkpoint's params (Megatron: --no-load-optim)"


# The fields a save adds to its store's description: the saved state, and the file table.
SAVED_STATE_FIELDS = ("steps_taken", "bucket_state", "resident_state", "main_exceptions", "master_options", "files")
# The fields Manifest.write adds.
FORMAT_FIELDS = ("format", "format_version", "crc_block_bytes", CHECKSUM_KEY)


def description_of(data: dict[str, Any]) -> dict[str, Any]:
    """The description of the store a manifest's ``data`` was saved from: every
    field but the saved state and the format's own."""
    return {k: v for k, v in data.items() if k not in SAVED_STATE_FIELDS and k not in FORMAT_FIELDS}


def checksum(data: dict[str, Any]) -> int:
    """CRC-32 of the manifest's canonical JSON, its own checksum left out."""
    body = {k: v for k, v in data.items() if k != CHECKSUM_KEY}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@dataclass
class Manifest:
    """The parsed ``manifest.json`` of one saved store."""

    data: dict[str, Any]

    @classmethod
    def of_save(
        cls,
        description: dict[str, Any],
        *,
        steps_taken: int,
        bucket_state: list,
        resident_state: dict | None,
        main_exceptions: list | None,
        master_options: list | None,
        files: dict[str, dict],
    ) -> Manifest:
        """The manifest of a save: the store's ``description`` and what the save
        holds (:data:`SAVED_STATE_FIELDS`); :meth:`write` adds the format's fields."""
        saved = {
            "steps_taken": steps_taken,
            "bucket_state": bucket_state,
            "resident_state": resident_state,
            "main_exceptions": main_exceptions,
            "master_options": master_options,
            "files": files,
        }
        return cls({**description, **saved})

    @property
    def files(self) -> dict[str, dict]:
        """File name -> {"size": bytes, "block_crc32": [CRC-32 per block]} (format 3)
        or {"size": bytes, "crc32": CRC-32 of the file} (formats 1 and 2)."""
        return self.data["files"]

    @property
    def block_bytes(self) -> int | None:
        """The block size of the files' checksums; None: one checksum per file."""
        return self.data.get("crc_block_bytes") if self.data.get("format_version", 1) >= 3 else None

    def crcs(self, name: str) -> list[int]:
        """The checksums of file ``name``, as :class:`io.BlockCrc` with
        :attr:`block_bytes` computes them over the whole file."""
        entry = self.files[name]
        return entry["block_crc32"] if self.block_bytes is not None else [entry["crc32"]]

    def write(self, directory: str) -> None:
        """Write the manifest durably into ``directory`` (the save's last file),
        with its own checksum; the files' checksums are per ``CRC_BLOCK_BYTES`` block."""
        data = {**self.data, "format": FORMAT, "format_version": FORMAT_VERSION, "crc_block_bytes": CRC_BLOCK_BYTES}
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
        block = data.get("crc_block_bytes") if version >= 3 else None
        if version >= 3 and (type(block) is not int or block <= 0):
            raise CheckpointMismatchError(f"{path} has crc_block_bytes {block!r}, not a block size")
        files = data.get("files")
        if not isinstance(files, dict) or not all(_valid_file_entry(v, block) for v in files.values()):
            raise CheckpointMismatchError(f"{path} has a malformed file table; the checkpoint is damaged")
        for name in files:
            # A file name must stay inside the directory: no separators, no dot names.
            if not name or os.sep in name or name in (".", "..") or name.startswith("."):
                raise CheckpointMismatchError(f"{path} names a file outside its directory: {name!r}")
        return cls(data)


def crc_mismatch(got: list[int], expected: list[int], block_bytes: int | None) -> str | None:
    """What differs between a file's computed checksums and the manifest's; None when they match."""
    if got == expected:
        return None
    if block_bytes is None or len(got) != len(expected):
        return f"CRC-32 {_crc_text(got)} does not match the manifest's {_crc_text(expected)}"
    bad = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    return (
        f"the CRC-32 of {len(bad)} of its {len(got)} blocks of {block_bytes} bytes does not match the manifest's "
        f"(first: block {bad[0]}, bytes {bad[0] * block_bytes}-{(bad[0] + 1) * block_bytes - 1})"
    )


def _crc_text(crcs: list[int]) -> str:
    return ", ".join(f"{c:#010x}" for c in crcs[:4]) + (" ..." if len(crcs) > 4 else "")


def _valid_file_entry(entry: object, block_bytes: int | None) -> bool:
    """A size and, per block of ``block_bytes`` (None: the whole file), a CRC-32."""
    if not isinstance(entry, dict) or type(entry.get("size")) is not int or entry["size"] < 0:
        return False
    if block_bytes is None:
        crcs = [entry.get("crc32")] if set(entry) == {"size", "crc32"} else None
    else:
        crcs = entry.get("block_crc32") if set(entry) == {"size", "block_crc32"} else None
        if not isinstance(crcs, list) or len(crcs) != -(-entry["size"] // block_bytes):
            return False
    return crcs is not None and all(type(c) is int and 0 <= c < 2**32 for c in crcs)


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


# The fields that differ between two saves of one optimizer at different data-parallel
# shardings (or between two ranks' saves): a resharded load accepts these differences.
SHARDING_FIELDS = frozenset({"store", "topology", "layout", "resident_numels"})


def _has_fp32_params(description: dict[str, Any]) -> bool:
    """Whether a store holds fp32 params (their moments resident, or in moments-only buckets)."""
    layout = description.get("layout") or []
    return bool(description.get("resident_numels")) or any(b.get("main") is False for b in layout)


def removed_moment_dtype(saved: dict[str, Any]) -> str | None:
    """Why a save whose moments are stored in a dtype this version no longer offers
    (``REMOVED_MOMENT_DTYPES``) cannot be read, with what to do instead; None for
    any other save. ``saved``: a manifest's data."""
    dtype = saved.get("moment_dtype")
    if dtype not in REMOVED_MOMENT_DTYPES:
        return None
    return (
        f"the checkpoint stores its moments as {dtype}, which this version no longer reads: "
        f"{REMOVED_MOMENT_DTYPES[dtype]}. Start the optimizer fresh from the checkpoint's params "
        "(Megatron: --no-load-optim; plain PyTorch: skip load_from), or resume it with the version "
        "that wrote it"
    )


def differences(saved: dict[str, Any], live: dict[str, Any], sharding: bool = True) -> list[str]:
    """Every compared field where ``saved`` and ``live`` differ, described; with
    ``sharding`` False, only those a resharded load cannot bridge (formats, optimizer)."""
    found = []
    # A save that does not record the setting kept fp32 params' moments resident.
    kept = saved.get("fp32_param_moments", "resident"), live.get("fp32_param_moments", "resident")
    if kept[0] != kept[1] and (_has_fp32_params(saved) or _has_fp32_params(live)):
        found.append(
            f"the fp32 params' moments were saved {kept[0]}, this run keeps them {kept[1]} (fp32_param_moments, "
            f"--stream-optimizer-state-fp32-param-moments): load with fp32_param_moments={kept[0]!r}"
        )
    if "shard_peers" not in (saved.get("topology") or {}):  # saved before topologies named them
        live = {**live, "topology": {k: v for k, v in (live.get("topology") or {}).items() if k != "shard_peers"}}
    for key, label in COMPARED_FIELDS:
        if saved.get(key) == live.get(key) or (not sharding and key in SHARDING_FIELDS):
            continue
        if key == "moment_dtype" and (removed := removed_moment_dtype(saved)):
            found.append(removed)
        elif key == "layout":
            found.append(_layout_difference(saved.get(key) or [], live.get(key) or []))
        elif key == "topology":
            s, v = saved.get(key) or {}, live.get(key) or {}
            changed = ", ".join(
                f"{k} {s.get(k)} -> {v.get(k)}" for k in sorted(set(s) | set(v)) if s.get(k) != v.get(k)
            )
            found.append(f"{label} differs (checkpoint -> this run): {changed}")
            if saved.get("pieces") is None:
                found.append(
                    "this checkpoint was saved before checkpoints recorded each entry's param range, so it loads "
                    f"only at the parallel sizes it was saved at: resume at those, or {START_FRESH}"
                )
            elif s.get("shard_peers") != v.get("shard_peers") and not saved.get("param_facts"):
                found.append(
                    "a change of TP, PP or EP size (or of this rank's TP, PP or EP coordinates) is resharded only from "
                    "saves that record each param's key and global boxes (format 4, Megatron's binding): resume with "
                    f"the saved TP, PP and EP sizes, or {START_FRESH}"
                )
        else:
            found.append(
                f"{label} differs: checkpoint has {_short(saved.get(key))}, this run has {_short(live.get(key))}"
            )
    pieces = [(saved.get(k), live.get(k)) for k in ("pieces", "resident_pieces")]
    if sharding and saved.get("pieces") is not None and any(s != v for s, v in pieces):
        # Same sizes can hide other params (another DDP bucket size, another param order).
        found.append("its entries hold other params or param ranges than this run's")
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
