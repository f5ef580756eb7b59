"""Operator's commands for saved streamed optimizer state; no GPU, no live store.

    python -m miles_plugins.optimizers.ckpt inspect DIR

``DIR`` is a checkpoint's iteration directory (its ``streamed_optimizer_state/``
is read), that directory itself, or one saved store. For every saved store it
prints the topology, the storage formats, the layout and the step count, and
checks every file against the manifest: the manifest's own checksum first,
then each file's presence, size and CRC-32 (every byte is read). Exit status:
0 when everything verifies, 1 on any problem (each one listed), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

from megatron_hooks.checkpoint import STATE_DIRNAME
from miles_plugins.optimizers.errors import CheckpointMismatchError, StreamIOError
from miles_plugins.optimizers.fs import open_file
from miles_plugins.optimizers.manifest import MANIFEST_NAME, Manifest

READ_BYTES = 16 << 20


def stores_under(directory: str) -> list[str]:
    """The saved-store directories ``directory`` holds (or is): every subdirectory
    but the hidden ones a save works in; a store missing its manifest included."""
    if os.path.isfile(os.path.join(directory, MANIFEST_NAME)):
        return [directory]
    if os.path.isdir(os.path.join(directory, STATE_DIRNAME)):
        directory = os.path.join(directory, STATE_DIRNAME)
    return sorted(
        os.path.join(directory, name)
        for name in os.listdir(directory)
        if not name.startswith(".") and os.path.isdir(os.path.join(directory, name))
    )


def file_crc32(path: str) -> int:
    crc = 0
    with os.fdopen(open_file(path, os.O_RDONLY), "rb", buffering=0) as f:
        buffer = bytearray(READ_BYTES)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


def describe(manifest: Manifest) -> str:
    data = manifest.data
    topology = ", ".join(f"{k} {v}" for k, v in sorted((data.get("topology") or {}).items())) or "none recorded"
    layout = data.get("layout") or []
    elements = sum(sum(bucket.get("numels", ())) for bucket in layout)
    moments = data.get("moment_dtype")
    if data.get("moment_format"):
        moments = f"{moments} ({data['moment_format']})"
    return (
        f"format {data.get('format_version')}, step {data.get('steps_taken')}, optimizer {data.get('optimizer_class')}\n"
        f"  topology: {topology}\n"
        f"  mains {data.get('main_dtype')}, moments {moments}\n"
        f"  {len(layout)} buckets, {elements:,} streamed elements, "
        f"{len(data.get('resident_numels') or [])} resident params; "
        f"{sum(f['size'] for f in manifest.files.values()) / 1e9:.3f} GB in {len(manifest.files)} files"
    )


def verify(store: str, manifest: Manifest) -> list[str]:
    """Every file of ``manifest`` that is missing, of another size or CRC-32."""
    problems = []
    for name, entry in sorted(manifest.files.items()):
        path = os.path.join(store, name)
        try:
            size = os.lstat(path).st_size
            if size != entry["size"]:
                problems.append(f"{name} has {size} bytes, the manifest says {entry['size']} (truncated?)")
                continue
            crc = file_crc32(path)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except (OSError, StreamIOError) as exc:
            problems.append(f"{name} cannot be read: {exc}")
            continue
        if crc != entry["crc32"]:
            problems.append(f"{name} fails its CRC-32 ({crc:#010x}, the manifest says {entry['crc32']:#010x})")
    return problems


def inspect(directory: str) -> int:
    stores = stores_under(directory)
    if not stores:
        print(f"no saved streamed optimizer state under {directory}", file=sys.stderr)
        return 1
    failed = 0
    for store in stores:
        start = time.perf_counter()
        print(f"{store}:", flush=True)
        try:
            manifest = Manifest.read(store)
        except (CheckpointMismatchError, StreamIOError) as exc:
            print(f"  PROBLEM: {exc}", flush=True)
            failed += 1
            continue
        print("  " + describe(manifest), flush=True)
        problems = verify(store, manifest)
        for problem in problems:
            print(f"  PROBLEM: {problem}", flush=True)
        if problems:
            failed += 1
        else:
            print(f"  OK: every file's size and CRC-32 match ({time.perf_counter() - start:.1f} s)", flush=True)
    print(f"{len(stores) - failed} of {len(stores)} saved stores verify", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m miles_plugins.optimizers.ckpt", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect_parser = commands.add_parser("inspect", help="describe and verify every saved store under DIR")
    inspect_parser.add_argument("dir", metavar="DIR")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        parser.error(f"{args.dir} is not a directory")
    return inspect(args.dir)


if __name__ == "__main__":
    raise SystemExit(main())
