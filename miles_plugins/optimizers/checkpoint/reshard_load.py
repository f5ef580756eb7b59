"""A load of a state saved under another sharding: another DP size, or other TP, PP or EP sizes.

When this rank's store has no save of its own in the checkpoint, or its save
differs in the sharding (DP size and rank, so the layout) or in its TP, PP or
EP sizes, the state is rebuilt from its peers' saves (``reshard_peers``). Each
peer's manifest (format 3) records which elements of which param each of its
entries holds; at the saved TP, PP and EP sizes they are matched by param name
(``reshard_plan.plan``), at others by the params' keys and global boxes
(format 4, ``reshard_keys``). This rank's entries are filled from those ranges,
one entry of one segment at a time (memory: one entry's stored bytes, never the
whole state), every byte read verified (``saved_ranges``). The small state
follows the elements: per-param step counts (equal across the pieces of one
param, or refused), group step state, remainder exceptions (their indices
remapped), the moments of resident fp32 params. Storage formats must match the
live store's.

Like the same-sharding load, it is a transaction: everything is read and
checked before the live state changes (disk tier: into the spare slots; host
tier: a first pass reads and verifies, a second writes). The same load fills
the new stores of an offline reshard (``reshard_output``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from miles_plugins.optimizers.checkpoint.manifest import RESIDENT_FILE
from miles_plugins.optimizers.checkpoint.reshard_keys import SavedBoxes
from miles_plugins.optimizers.checkpoint.reshard_peers import Peer, by_keys
from miles_plugins.optimizers.checkpoint.reshard_plan import Copy, Piece, RemapError, plan
from miles_plugins.optimizers.checkpoint.saved_ranges import SavedEntry, SavedFiles, copied_segment, requantized_segment
from miles_plugins.optimizers.errors import CheckpointMismatchError
from miles_plugins.optimizers.formats import remainder
from miles_plugins.optimizers.formats.layout import MAIN_DTYPE, BucketLayout, layout_bucket
from miles_plugins.optimizers.homes.host_memory import HostMemory

if TYPE_CHECKING:
    from miles_plugins.optimizers.homes.protocols import Backing, Handle

# Bytes per element of the resident (fp32-native) params' moments, and moments per param.
_RESIDENT_ITEMSIZE, _RESIDENT_MOMENTS = 4, 2


class ReshardTarget(Protocol):
    """The store a resharded load fills: a live store's persistence, or a new
    store an offline reshard writes.

    ``description``: the store's manifest description, with ``pieces`` (per bucket,
    per entry [param name, start, master group]) and ``resident_pieces``;
    ``buckets``: its layout; ``resident_mains``: the fp32-native entries' mains
    (only their sizes are read); ``backing``: where the bucket bytes go (its spare
    slot on disk); ``buffer()``: a host staging buffer free for the load.
    """

    description: dict
    buckets: Sequence[BucketLayout]
    resident_mains: Sequence[torch.Tensor]
    backing: Backing
    buffer: Callable[[], HostMemory]


class ReshardedLoad:
    """Rebuild one store's state from its peers' saves (see the module docstring).

    Construction plans every copy and checks the peers' files (presence, sizes,
    layouts) without reading them; :attr:`steps` is the saved step count.
    ``by_key``: match entries by key and global box (default: where the peers were
    saved at other TP, PP or EP sizes than the target's).
    """

    def __init__(self, target: ReshardTarget, peers: Sequence[Peer], by_key: bool | None = None) -> None:
        self.target, self.peers = target, list(peers)
        # Entries matched by key and global box (another TP/PP/EP layout), or by param name.
        self.by_key = by_keys(self.peers, target.description) if by_key is None else by_key
        live = target.description
        self.live_pieces = [
            [Piece(n, s, numel) for (n, s, _), numel in zip(pieces, b.numels, strict=True)]
            for pieces, b in zip(live["pieces"], target.buckets, strict=True)
        ]
        self.live_groups = [[g for _, _, g in pieces] for pieces in live["pieces"]]
        resident_numels = [m.numel() for m in target.resident_mains]
        self.live_resident = [
            Piece(n, s, numel) for (n, s, _), numel in zip(live["resident_pieces"], resident_numels, strict=True)
        ]
        self.live_resident_groups = [g for _, _, g in live["resident_pieces"]]
        # Per peer: each saved bucket's layout and optimizer slots, the resident slots and file offsets.
        self.source_layouts: list[list[BucketLayout | None]] = []
        self.source_slots: list[list[list[tuple[int, int]]]] = []
        self.resident_slots: list[list[tuple[int, int]]] = []
        self.resident_offsets: list[list[int]] = []
        self._plan()

    # ---- the plan ------------------------------------------------------------------

    def _plan(self) -> None:
        """Every live entry's copies from the peers' pieces; raises naming every problem."""
        sources: list[tuple[Hashable, Piece]] = []
        resident_sources: list[tuple[Hashable, Piece]] = []
        problems = []
        for index, peer in enumerate(self.peers):
            problems += self._add_peer(index, peer, sources, resident_sources)
        steps = {peer.data.get("steps_taken") for peer in self.peers}
        if len(steps) != 1:
            problems.append(f"the saved stores hold the state after different steps: {sorted(steps)}")
        try:
            if self.by_key:
                self.copies, self.resident_copies = self._plan_by_keys(sources, resident_sources)
            else:
                self.copies = [plan(pieces, sources) for pieces in self.live_pieces]
                self.resident_copies = plan(self.live_resident, resident_sources)
        except RemapError as exc:
            problems.append(str(exc))
        if problems:
            listed = problems[0] if len(problems) == 1 else "\n  - " + "\n  - ".join(problems)
            raise CheckpointMismatchError(
                f"cannot reshard the streamed optimizer state from {len(self.peers)} saved stores ({self._names()}): "
                + listed
            )
        self.steps = steps.pop()

    def _plan_by_keys(self, sources: list, resident_sources: list) -> tuple[list[list[list[Copy]]], list[list[Copy]]]:
        """The copies of saves at another TP, PP or EP layout, found by each param's key
        and global boxes (``reshard_keys``)."""
        facts = self.target.description["param_facts"]["params"]

        def with_facts(located: list) -> list:
            return [(at, piece, self.peers[at[0]].data["param_facts"]["params"][piece.key]) for at, piece in located]

        saved, saved_resident = SavedBoxes(with_facts(sources)), SavedBoxes(with_facts(resident_sources))
        return [saved.plan(pieces, facts) for pieces in self.live_pieces], saved_resident.plan(
            self.live_resident, facts
        )

    def _add_peer(self, index: int, peer: Peer, sources: list, resident_sources: list) -> list[str]:
        """Record peer ``index``'s bucket layouts, optimizer slots and resident offsets,
        add its pieces to ``sources`` and ``resident_sources``; the problems of its files."""
        data = peer.data
        problems = list(peer.manifest.file_problems(peer.directory).values())
        layouts = [self._source_layout(b, bucket, data["main_dtype"]) for b, bucket in enumerate(data["layout"])]
        problems += [
            f"{peer.directory}: {bucket['file']} is laid out for {bucket['size']} bytes, this version lays "
            f"it out in {layout.file_size} (written by a version with another file layout)"
            for bucket, layout in zip(data["layout"], layouts, strict=True)
            if layout is not None and (layout.file_size != bucket["size"] or layout.file_name != bucket["file"])
        ]
        self.source_layouts.append(layouts)
        self.source_slots.append([_optimizer_slots([g for _, _, g in pieces]) for pieces in data["pieces"]])
        store = os.path.basename(peer.directory)
        for b, (bucket, pieces) in enumerate(zip(data["layout"], data["pieces"], strict=True)):
            for k, (name, start, _) in enumerate(pieces):
                where = _SavedLocation(f"{store} bucket {b} entry {k}", index, b, k)
                sources.append((where, Piece(name, start, bucket["numels"][k])))
        slots = _optimizer_slots([g for _, _, g in data["resident_pieces"]])
        self.resident_slots.append(slots)
        offsets, total = _resident_offsets(data, slots)
        self.resident_offsets.append(offsets)
        if data["resident_pieces"] and data["files"].get(RESIDENT_FILE, {}).get("size") != total:
            problems.append(f"{peer.directory}: {RESIDENT_FILE} does not hold the moments its state describes")
        for k, ((name, start, _), numel) in enumerate(
            zip(data["resident_pieces"], data["resident_numels"], strict=True)
        ):
            where = _SavedLocation(f"{store} resident entry {k}", index, k)
            resident_sources.append((where, Piece(name, start, numel)))
        return problems

    def _names(self) -> str:
        names = [os.path.basename(p.directory) for p in self.peers]
        return ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")

    def _source_layout(self, index: int, bucket: dict, main_dtype: str) -> BucketLayout | None:
        """A saved bucket's file layout, from its entry sizes and the saved main storage
        (the moments' format equals the live one: ``reshard_peers.can_reshard_from``);
        checked against the saved file size by :meth:`_add_peer`."""
        if not self.target.buckets:
            return None
        main = MAIN_DTYPE if main_dtype == "fp32" else remainder.STORAGE_DTYPE
        moment = self.target.buckets[0].segments["exp_avg"]
        numels = bucket["numels"]
        with_main = bucket.get("main", True)
        return layout_bucket(index, range(len(numels)), numels, moment.dtype, main, moment.blockwise, with_main)

    # ---- the small state ---------------------------------------------------------

    def bucket_states(self) -> list[dict]:
        """Each live bucket optimizer's saved state, assembled from its pieces' sources."""
        return [
            self._state(groups, copies, self._bucket_param_state)
            for groups, copies in zip(self.live_groups, self.copies, strict=True)
        ]

    def resident_state(self) -> dict:
        """The resident params' optimizer state, assembled from their pieces' sources."""
        return self._state(self.live_resident_groups, self.resident_copies, self._resident_param_state)

    def _state(self, groups: Sequence[int], copies: Sequence[Sequence[Copy]], source_state: Callable) -> dict:
        """An ``export_state`` dict for entries of master ``groups`` from their copies'
        sources (``source_state(copy)`` -> (group state, param state)): every source
        of one param must agree, and every source of one group."""
        out_groups: dict[int, dict] = {}
        out_params: list[list] = [[] for _ in range(len(set(groups)))]
        for (gi, _), entry_copies in zip(_optimizer_slots(groups), copies, strict=True):
            states = [source_state(c) for c in entry_copies]
            group_state, param_state = states[0]
            if any(other != states[0] for other in states[1:]):
                raise CheckpointMismatchError(
                    f"the saved ranks disagree on the optimizer state of one param: {[s for _, s in states]}"
                )
            if out_groups.setdefault(gi, group_state) != group_state:
                raise CheckpointMismatchError(
                    f"the saved ranks disagree on a param group's step state: {out_groups[gi]} vs {group_state}"
                )
            out_params[gi].append(param_state)
        return {"groups": [out_groups.get(gi, {}) for gi in range(len(out_params))], "params": out_params}

    def _bucket_param_state(self, copy: Copy) -> tuple[dict, object]:
        peer, b, k = copy.source
        gi, j = self.source_slots[peer][b][k]
        saved = self.peers[peer].data["bucket_state"][b]
        return saved["groups"][gi], saved["params"][gi][j]

    def _resident_param_state(self, copy: Copy) -> tuple[dict, object]:
        peer, k = copy.source
        gi, j = self.resident_slots[peer][k]
        saved = self.peers[peer].data["resident_state"]
        return saved["groups"][gi], saved["params"][gi][j]

    def exceptions(self) -> list:
        """The remainder exceptions of every live entry, remapped from its sources'."""
        out = []
        for copies_of_bucket in self.copies:
            bucket_out = []
            for entry_copies in copies_of_bucket:
                index, high = [], []
                for c in entry_copies:
                    peer, b, k = c.source
                    saved_index, saved_high = self.peers[peer].data["main_exceptions"][b][k]
                    for i, h in zip(saved_index, saved_high, strict=True):
                        if (at := c.target_of(i)) is not None:
                            index.append(at)
                            high.append(h)
                order = sorted(range(len(index)), key=index.__getitem__)
                bucket_out.append([[index[i] for i in order], [high[i] for i in order]])
            out.append(bucket_out)
        return out

    # ---- the bytes ---------------------------------------------------------------

    def write_buckets(self, buckets: Sequence[BucketLayout], write: bool) -> None:
        """Assemble the live ``buckets``' segments from the peers' files, verifying
        each block read; with ``write``, into the backing (its spare slot on disk).
        Host memory: one entry's segment, and one checksum block per saved file a
        live bucket reads (those files are closed before the next bucket)."""
        for bucket in buckets:
            with SavedFiles() as files:
                handle = self.target.backing.open(bucket) if write else None
                try:
                    for name, segment in bucket.segments.items():
                        for k, entry_copies in enumerate(self.copies[bucket.index]):
                            ranges = ((self._saved_entry(c, name, files), c) for c in entry_copies)
                            if segment.blockwise:
                                out = requantized_segment(name, bucket.numels[k], ranges)
                            else:
                                out = copied_segment(segment.dtype.itemsize, bucket.numels[k], ranges)
                            if handle is not None:
                                self._write(handle, segment.entry_offsets[k], out)
                finally:
                    if handle is not None:
                        handle.close()

    def _saved_entry(self, copy: Copy, segment: str, files: SavedFiles) -> SavedEntry:
        """Where the saved entry a copy reads lies in its bucket file."""
        peer, b, k = copy.source
        layout = self.source_layouts[peer][b]
        file = files.open(self.peers[peer].directory, self.peers[peer].manifest, layout.file_name)
        return SavedEntry(file, layout.segments[segment].entry_offsets[k], layout.numels[k])

    def _write(self, handle: Handle, offset: int, data: memoryview) -> None:
        """``data`` into the bucket at ``offset``, in chunks of the staging buffer."""
        staging = self.target.buffer()
        step = len(staging.view)
        view = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        for at in range(0, len(data), step):
            handle.write(offset + at, view[at : at + step], staging)

    def resident_bytes(self, state: dict) -> bytes:
        """The live resident moments (exp_avg then exp_avg_sq of each param with
        state, :meth:`resident_state`'s), gathered from the peers' resident files."""
        out = bytearray()
        with SavedFiles() as files:
            slots = _optimizer_slots(self.live_resident_groups)
            for (gi, j), entry_copies, piece in zip(slots, self.resident_copies, self.live_resident, strict=True):
                if state["params"][gi][j] is None:
                    continue
                for moment in range(_RESIDENT_MOMENTS):
                    ranges = ((self._saved_resident_moment(c, moment, files), c) for c in entry_copies)
                    out += copied_segment(_RESIDENT_ITEMSIZE, piece.numel, ranges)
        return bytes(out)

    def _saved_resident_moment(self, copy: Copy, moment: int, files: SavedFiles) -> SavedEntry:
        """Where moment ``moment`` of the saved resident entry a copy reads lies."""
        peer, k = copy.source
        saved = self.peers[peer]
        numel = saved.data["resident_numels"][k]
        file = files.open(saved.directory, saved.manifest, RESIDENT_FILE)
        return SavedEntry(file, self.resident_offsets[peer][k] + moment * numel * _RESIDENT_ITEMSIZE, numel)


def _optimizer_slots(groups: Sequence[int]) -> list[tuple[int, int]]:
    """Per entry (given its master group index, in bucket order) its (group, position)
    in the bucket optimizer, whose groups follow the order of first appearance."""
    order: dict[int, int] = {}
    counts: dict[int, int] = {}
    slots = []
    for g in groups:
        gi = order.setdefault(g, len(order))
        slots.append((gi, counts.get(gi, 0)))
        counts[gi] = counts.get(gi, 0) + 1
    return slots


def _resident_offsets(data: dict, slots: Sequence[tuple[int, int]]) -> tuple[list[int], int]:
    """Where each saved resident entry's moments start in the resident file (a param
    without optimizer state has none), and the file's size."""
    offsets, offset = [], 0
    for (gi, j), numel in zip(slots, data["resident_numels"], strict=True):
        offsets.append(offset)
        if data["resident_state"]["params"][gi][j] is not None:
            offset += _RESIDENT_MOMENTS * _RESIDENT_ITEMSIZE * numel
    return offsets, offset


class _SavedLocation(tuple):
    """Where a saved piece lives: (peer, bucket, entry) or (peer, resident entry),
    named for messages by its store directory."""

    def __new__(cls, label: str, *index: int) -> _SavedLocation:
        location = super().__new__(cls, index)
        location.label = label
        return location

    def __str__(self) -> str:
        return self.label
