"""What a directory of saved streamed state holds, and what a load would refuse in it.

Read without a live store (``ckpt inspect`` and ``ckpt reshard``): the saved
stores a directory holds or is, found as a load finds them (:func:`stores_under`);
each store's manifest and files checked as a load checks them, every byte read
(:func:`check_store`); and across the stores (:class:`CrossStoreCheck`), saves
mixed in one directory, the ranks of the recorded world without a store
(:func:`missing_ranks`) and the data-parallel groups with some of their stores
missing (:func:`incomplete_groups`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from megatron_hooks.checkpoint import STATE_DIRNAME
from miles_plugins.optimizers.checkpoint.manifest import (
    MANIFEST_NAME,
    RESIDENT_FILE,
    Manifest,
    crc_mismatch,
    removed_moment_dtype,
)
from miles_plugins.optimizers.homes.dir_replace import saved_dirs
from miles_plugins.optimizers.homes.file_io import file_crcs

# How a Megatron chain names its stores: rank<global rank>.opt<position in the chain>.
STORE_NAME = re.compile(r"rank(\d+)\.(opt\d+)")
# The names a load reads in a state directory: its own store's, and for a resharded
# load every ``<...>.opt<i>`` of its optimizer (reshard_peers.find_peers), each refused
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
        if not_plain_dir(path) and not _LOAD_READS.fullmatch(name):
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


def not_plain_dir(path: str) -> str | None:
    """Why a load would refuse the store at ``path`` before reading it, or None."""
    if os.path.islink(path) or not os.path.isdir(path):
        return f"{path} is not a plain directory (a load refuses it)"
    return None


def missing_ranks(names: list[str], world_size: object) -> list[int]:
    """Ranks of ``world_size`` (from a manifest's topology) no store is named after."""
    if type(world_size) is not int or world_size <= 0:
        return []
    present = {int(m.group(1)) for name in names if (m := STORE_NAME.fullmatch(name))}
    return [rank for rank in range(world_size) if rank not in present] if present else []


def incomplete_groups(topologies: dict[str, dict]) -> list[str]:
    """Data-parallel groups of which some stores are saved and others are not: every
    rank of a group holds the same optimizers (a pipeline stage without experts has no
    expert optimizer on any of its ranks, which is no problem). ``topologies``: store
    name -> its manifest's topology."""
    groups: dict[tuple, set] = {}
    for name, topology in topologies.items():
        m = STORE_NAME.fullmatch(name)
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
    """A saved store in a few lines: format, step, optimizer, topology, storage
    formats, layout and size."""
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


def check_store(name: str, path: str) -> tuple[list[str], Manifest | None]:
    """Every problem a load of the store at ``path`` would meet in its files,
    with the manifest (None when that is unreadable)."""
    if not_plain := not_plain_dir(path):
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


@dataclass
class CrossStoreCheck:
    """What the readable saved stores record (:meth:`add` each), compared across them."""

    topologies: dict[str, dict] = field(default_factory=dict)
    world_sizes: set = field(default_factory=set)
    steps: set = field(default_factory=set)

    def add(self, name: str, manifest: Manifest) -> None:
        self.topologies[name] = manifest.data.get("topology") or {}
        self.world_sizes.add(self.topologies[name].get("world_size"))
        self.steps.add(manifest.data.get("steps_taken"))

    def problems(self, names: list[str]) -> list[str]:
        """What is wrong with the stores ``names`` together. A Megatron save (its stores
        record the world) is one run's at one iteration: a load checks every store
        against the same world and step (plain-PyTorch stores may step apart). A rank
        without a store, a data-parallel group with some of its stores missing."""
        problems = []
        if len(self.world_sizes) > 1:
            problems.append(f"the stores record different world sizes {sorted(self.world_sizes, key=str)}")
        if None not in self.world_sizes and len(self.steps) > 1:
            problems.append(f"the stores record different step counts {sorted(self.steps, key=str)}")
        problems = [f"{problem}: the directory mixes saves" for problem in problems]
        world_size = next(iter(self.world_sizes)) if len(self.world_sizes) == 1 else None
        if absent := missing_ranks(names, world_size):
            problems.append(f"the run had {world_size} ranks; no store for rank(s) {absent}")
        return problems + incomplete_groups(self.topologies)
