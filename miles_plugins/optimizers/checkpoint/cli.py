"""Operator's commands for saved streamed optimizer state; no GPU, no live store.

    python -m miles_plugins.optimizers.ckpt inspect DIR
    python -m miles_plugins.optimizers.ckpt reshard DIR --dp N --out NEW_ITER_DIR

``reshard`` rewrites the state for ``N`` data-parallel ranks
(``reshard_offline.py``), verifying every block it reads; exit status 1 on any
problem with the checkpoint or the output (nothing is left in ``--out`` then),
2 on bad usage, 130 on Ctrl-C and 143 on SIGTERM (the partial output removed).

``DIR`` is a checkpoint's iteration directory (its ``streamed_optimizer_state/``
is read), that directory itself, the directory given to
``StreamedOptimizer.save_to``, or one saved store. Entries no load reads (a
note copied in beside the stores) are listed as ignored. For every saved store it
prints the topology, the storage formats, the layout and the step count, and
checks what a load would: the manifest's own checksum, that it is the store
its directory is named after, its file table against its layout, and each
file's presence, size and checksums (every byte is read); a store whose replace
was cut off is read from ``.<name>.previous`` as a load does; a rank of the
recorded world size without a store, a data-parallel group with some of its
stores of an optimizer missing, and stores of different world sizes or
(Megatron's) step counts, a directory that mixes saves, are problems too. Exit status: 0 when
everything verifies, 1 on any problem (each one listed), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time

from megatron_hooks.checkpoint import STATE_DIRNAME
from miles_plugins.optimizers.checkpoint.manifest import (
    MANIFEST_NAME,
    RESIDENT_FILE,
    Manifest,
    crc_mismatch,
    removed_moment_dtype,
)
from miles_plugins.optimizers.errors import CheckpointMismatchError, StreamIOError
from miles_plugins.optimizers.homes.dir_replace import saved_dirs
from miles_plugins.optimizers.homes.file_io import file_crcs

_STORE_NAME = re.compile(r"rank(\d+)\.(opt\d+)")
# The names a load reads in a state directory: its own store's, and for a resharded
# load every ``<...>.opt<i>`` of its optimizer (reshard_load.find_peers), each refused
# when it is not a plain directory. Loads read nothing else there.
_LOAD_READS = re.compile(r".+\.opt\d+")


class NotAStateDir(Exception):
    """DIR holds no saved streamed optimizer state where one is looked for."""


def stores_under(directory: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(store name, the directory a load would read) for every saved store
    ``directory`` holds or is: one store, a ``streamed_optimizer_state/``, an
    iteration directory holding one, or the directory given to
    ``StreamedOptimizer.save_to`` (its stores are the directories holding a
    manifest); with a note for each other entry, which no load reads. A store
    whose save was cut off while replacing the previous one is read from
    ``.<name>.previous``, as a load does. Raises :class:`NotAStateDir` when
    ``directory`` is none of these."""
    if os.path.lexists(os.path.join(directory, MANIFEST_NAME)):
        return [(os.path.basename(os.path.normpath(directory)), directory)], []
    if os.path.isdir(os.path.join(directory, STATE_DIRNAME)):
        directory = os.path.join(directory, STATE_DIRNAME)
    state_dir = os.path.basename(os.path.normpath(directory)) == STATE_DIRNAME
    stores, ignored = [], []
    for name, path in sorted(saved_dirs(directory).items()):  # as persistence reads them
        if _not_plain_dir(path) and not _LOAD_READS.fullmatch(name):
            ignored.append(
                f"ignoring {path}: not a directory, so no saved store (a load reads only the store named after "
                "it, and a resharded load only the <...>.opt<N> ones)"
            )
        elif state_dir or os.path.lexists(os.path.join(path, MANIFEST_NAME)):
            stores.append((name, path))
        else:
            ignored.append(f"ignoring {path}: it holds no {MANIFEST_NAME}, so no saved store")
    if not state_dir and not stores:
        raise NotAStateDir(
            f"{directory} is not a saved streamed optimizer state: give a checkpoint's iteration directory "
            f"(…/iter_0001000, holding {STATE_DIRNAME}/), that {STATE_DIRNAME}/ directory, the directory given "
            "to StreamedOptimizer.save_to, or one store in either"
        )
    return stores, ignored


def missing_ranks(names: list[str], world_size: object) -> list[int]:
    """Ranks of ``world_size`` (from a manifest's topology) no store is named after."""
    if type(world_size) is not int or world_size <= 0:
        return []
    present = {int(m.group(1)) for name in names if (m := _STORE_NAME.fullmatch(name))}
    return [rank for rank in range(world_size) if rank not in present] if present else []


def incomplete_groups(topologies: dict[str, dict]) -> list[str]:
    """Data-parallel groups of which some stores are saved and others are not: every
    rank of a group holds the same optimizers (a pipeline stage without experts has no
    expert optimizer on any of its ranks, which is no problem). ``topologies``: store
    name -> its manifest's topology."""
    groups: dict[tuple, set] = {}
    for name, topology in topologies.items():
        m = _STORE_NAME.fullmatch(name)
        peers, dp_size, dp_rank = (topology.get(k) for k in ("shard_peers", "dp_size", "dp_rank"))
        if m and isinstance(peers, dict) and type(dp_size) is int and type(dp_rank) is int:
            groups.setdefault((m.group(2), dp_size, json.dumps(peers, sort_keys=True)), set()).add(dp_rank)
    return [
        f"{optimizer}: the data-parallel group of {', '.join(f'{k} {v}' for k, v in sorted(json.loads(peers).items()))} "
        f"has {len(ranks)} of its {dp_size} stores (dp rank(s) {sorted(set(range(dp_size)) - ranks)} missing)"
        for (optimizer, dp_size, peers), ranks in sorted(groups.items())
        if len(ranks) < dp_size
    ]


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
        f"  {len(layout)} bucket(s), {elements:,} streamed elements, "
        f"{len(data.get('resident_numels') or [])} resident params; "
        f"{sum(f['size'] for f in manifest.files.values()) / 1e9:.3f} GB in {len(manifest.files)} files"
    )


def verify(store: str, manifest: Manifest) -> list[str]:
    """Every file of ``manifest`` that is missing, of another size or checksum."""
    problems = manifest.file_problems(store)
    for name, entry in sorted(manifest.files.items()):
        if name in problems:
            continue
        try:
            crcs = file_crcs(os.path.join(store, name), entry["size"], manifest.block_bytes)
        except OSError as exc:  # StreamIOError included
            problems[name] = f"{name} cannot be read: {exc}"
            continue
        mismatch = crc_mismatch(crcs, manifest.crcs(name), manifest.block_bytes)
        if mismatch:
            problems[name] = f"{name} fails its checksum: {mismatch}"
    return [problems[name] for name in sorted(problems)]


def _not_plain_dir(path: str) -> str | None:
    """Why a load would refuse the store at ``path`` before reading it, or None."""
    if os.path.islink(path) or not os.path.isdir(path):
        return f"{path} is not a plain directory (a load refuses it)"
    return None


def check_store(name: str, path: str) -> tuple[list[str], Manifest | None]:
    """Every problem a load of the store at ``path`` would meet in its files,
    with the manifest (None when that is unreadable)."""
    if not_plain := _not_plain_dir(path):
        return [not_plain], None
    manifest = Manifest.read(path)  # raises on a missing, damaged or edited manifest
    problems = []
    if removed := removed_moment_dtype(manifest.data):
        problems.append(removed)  # a load refuses it, however sound its files are
    if manifest.data.get("store") != name:
        problems.append(f"the manifest is store {manifest.data.get('store')!r}'s, but it sits in {name!r}")
    try:
        layout = manifest.data.get("layout") or []
        expected = {bucket["file"] for bucket in layout} | (
            {RESIDENT_FILE} if manifest.data.get("resident_numels") else set()
        )
        if set(manifest.files) != expected:
            problems.append(f"the file table lists {sorted(manifest.files)}, the layout needs {sorted(expected)}")
        problems += [
            f"{b['file']}: the file table says {manifest.files[b['file']]['size']} bytes, the layout {b['size']}"
            for b in layout
            if b["file"] in manifest.files and manifest.files[b["file"]]["size"] != b["size"]
        ]
    except (KeyError, TypeError, AttributeError) as exc:
        problems.append(f"the manifest's layout is malformed ({type(exc).__name__}: {exc})")
    return problems + verify(path, manifest), manifest


def inspect(directory: str) -> int:
    try:
        stores, ignored = stores_under(directory)
    except (NotAStateDir, OSError) as exc:
        print(exc, file=sys.stderr)
        return 1
    if not stores:
        print(f"no saved streamed optimizer state under {directory}", file=sys.stderr)
        return 1
    for note in ignored:
        print(f"note: {note}", flush=True)
    failed, world_sizes, steps, topologies = 0, set(), set(), {}
    for name, path in stores:
        start = time.perf_counter()
        print(f"{path}:", flush=True)
        if os.path.basename(path) != name:
            print(f"  note: {name} is missing; a load reads the previous save, kept aside by a cut-off replace")
        try:
            problems, manifest = check_store(name, path)
            if manifest is not None:
                print("  " + describe(manifest), flush=True)
                topologies[name] = manifest.data.get("topology") or {}
                world_sizes.add(topologies[name].get("world_size"))
                steps.add(manifest.data.get("steps_taken"))
        except (CheckpointMismatchError, StreamIOError, OSError, TypeError, AttributeError) as exc:
            problems = [str(exc).splitlines()[0] if isinstance(exc, (TypeError, AttributeError)) else str(exc)]
        for problem in problems:
            print(f"  PROBLEM: {problem}", flush=True)
        if problems:
            failed += 1
        else:
            print(f"  OK: every file's size and CRC-32 match ({time.perf_counter() - start:.1f} s)", flush=True)
    # A Megatron save (its stores record the world) is one run's at one iteration: a load
    # checks every store against the same world and step. (Plain-PyTorch stores may step apart.)
    mixed = []
    if len(world_sizes) > 1:
        mixed.append(f"the stores record different world sizes {sorted(world_sizes, key=str)}")
    if None not in world_sizes and len(steps) > 1:
        mixed.append(f"the stores record different step counts {sorted(steps, key=str)}")
    for problem in mixed:
        print(f"PROBLEM: {problem}: the directory mixes saves", flush=True)
    absent = missing_ranks([name for name, _ in stores], next(iter(world_sizes)) if len(world_sizes) == 1 else None)
    if absent:
        print(f"PROBLEM: the run had {next(iter(world_sizes))} ranks; no store for rank(s) {absent}", flush=True)
    incomplete = incomplete_groups(topologies)
    for problem in incomplete:
        print(f"PROBLEM: {problem}", flush=True)
    print(f"{len(stores) - failed} of {len(stores)} saved stores verify", flush=True)
    return 1 if failed or absent or mixed or incomplete else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m miles_plugins.optimizers.ckpt", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect_parser = commands.add_parser("inspect", help="describe and verify every saved store under DIR")
    inspect_parser.add_argument(
        "dir",
        metavar="DIR",
        help=f"a checkpoint's iteration directory (holding {STATE_DIRNAME}/), that {STATE_DIRNAME}/ directory, "
        "the directory given to StreamedOptimizer.save_to, or one saved store",
    )
    reshard_parser = commands.add_parser(
        "reshard", help="rewrite the saved state under DIR for another data-parallel size, into --out"
    )
    reshard_parser.add_argument("dir", metavar="DIR")
    reshard_parser.add_argument("--dp", type=int, required=True, help="the new data-parallel size")
    reshard_parser.add_argument(
        "--out",
        required=True,
        help="the new checkpoint's iteration directory (its streamed_optimizer_state/ is written)",
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        parser.error(f"{args.dir} is not a directory")
    if args.command == "inspect":
        return inspect(args.dir)
    if args.dp < 1:
        parser.error(f"--dp {args.dp}: it must be at least 1")
    return reshard_command(args.dir, args.dp, args.out)


def reshard_command(directory: str, dp: int, out: str) -> int:
    from miles_plugins.optimizers.checkpoint.reshard_offline import reshard

    if not out.strip():
        print("cannot reshard: --out is empty: give the new checkpoint's iteration directory", file=sys.stderr)
        return 2
    out = os.path.normpath(os.path.abspath(out))  # a trailing slash would put the partial output inside
    out_dir = out if os.path.basename(out) == STATE_DIRNAME else os.path.join(out, STATE_DIRNAME)
    iteration = os.path.basename(os.path.dirname(out_dir))
    if not re.fullmatch(r"iter_\d+|release", iteration):
        print(
            f"warning: --out {out} is not an iteration directory (iter_<N> or release): Megatron loads the "
            "state from <checkpoint>/iter_<N>/, so copy it there",
            flush=True,
        )
    start = time.perf_counter()
    # SIGTERM (a scheduler's cancel) unwinds like Ctrl-C, so the partial output is removed.
    # (Only the main thread may set a handler; one set from C is left alone.)
    previous = signal.getsignal(signal.SIGTERM)
    handle = previous is not None and threading.current_thread() is threading.main_thread()
    if handle:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        stores, _ = stores_under(directory)
        if not stores:
            raise NotAStateDir(f"no saved streamed optimizer state under {directory}")
        for _, path in stores:  # what a load would read, and nothing else
            if not_plain := _not_plain_dir(path):
                raise NotAStateDir(not_plain)
        strays = [name for name, _ in stores if not _STORE_NAME.fullmatch(name)]
        if strays and len(strays) < len(stores):
            raise NotAStateDir(
                f"{', '.join(strays)}: not named as a Megatron chain's stores are (rank<N>.opt<M>); a copy? "
                "move it out of the state directory"
            )
        source = os.path.realpath(os.path.dirname(stores[0][1]))
        target = os.path.realpath(out_dir)
        if os.path.commonpath([source, target]) == source:
            raise NotAStateDir(f"--out {out} lies inside the state it reads ({source}): give a directory outside it")
        reshard(stores, dp, out_dir, log=lambda line: print(line, flush=True))
    except (NotAStateDir, CheckpointMismatchError, StreamIOError, OSError) as exc:
        print(f"cannot reshard {directory}: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Terminated) as exc:
        what = "terminated (SIGTERM)" if isinstance(exc, _Terminated) else "interrupted"
        done = f"{out_dir} is complete and in place" if os.path.lexists(out_dir) else f"nothing was written to {out}"
        print(f"reshard {what}: {done}", file=sys.stderr)
        return 143 if isinstance(exc, _Terminated) else 130
    finally:
        if handle:
            signal.signal(signal.SIGTERM, previous)
    print(f"wrote {dp} rank(s) of streamed optimizer state to {out_dir} in {time.perf_counter() - start:.1f} s")
    return 0


class _Terminated(BaseException):
    """SIGTERM, raised where the reshard is, so its cleanup runs."""


def _terminated(signum, frame) -> None:
    raise _Terminated
