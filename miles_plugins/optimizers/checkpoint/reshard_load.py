"""A load of a state saved under another data-parallel sharding (``reshard.plan`` applied).

When this rank's store has no save of its own in the checkpoint, or its save
differs only in the sharding (DP size and rank, so the layout), the state is
rebuilt from its *peers*: the saved stores of the same optimizer (the
``.opt<i>`` of the chain) whose topology names the same ``shard_peers`` (TP,
PP and EP sizes and the ranks that select the same params). Each peer's
manifest (format 3) records which elements of which param each of its entries
holds; this rank's entries are filled from those ranges, one entry of one
segment at a time (memory: one entry's stored bytes, never the whole state).

Every byte read is verified: reads cover whole checksum blocks of the saved
files (``manifest.CRC_BLOCK_BYTES``) and each block's CRC-32 is checked. The
small state follows the elements: per-param step counts (equal across the
pieces of one param, or refused), group step state, remainder exceptions
(their indices remapped), the moments of resident fp32 params. Storage
formats must match the live store's: elementwise segments (fp32 and bf16
moments, fp32 and remainder mains) are copied byte for byte; blockwise 8-bit
moments are decoded from the saved blocks a range touches and quantized again
in the new entry's blocks (exact where the blocks coincide).

Like the same-sharding load, it is a transaction: everything is read and
checked before the live state changes (disk tier: into the spare slots; host
tier: a first pass reads and verifies, a second writes).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from miles_plugins.optimizers.checkpoint.manifest import (
    MANIFEST_NAME,
    RESIDENT_FILE,
    Manifest,
    crc_mismatch,
    differences,
)
from miles_plugins.optimizers.checkpoint.reshard_plan import Copy, Piece, RemapError, plan
from miles_plugins.optimizers.errors import CheckpointMismatchError
from miles_plugins.optimizers.formats import quant8, remainder
from miles_plugins.optimizers.formats.layout import MAIN_DTYPE, BucketLayout, layout_bucket
from miles_plugins.optimizers.homes.dir_replace import saved_dirs
from miles_plugins.optimizers.homes.file_io import BlockCrc, pread_full
from miles_plugins.optimizers.homes.fs import check_plain_dir, open_file


def chain_position(name: str) -> str:
    """``opt<i>`` of a store named ``rank<k>.opt<i>`` (the optimizer it belongs to)."""
    return name.rsplit(".", 1)[-1]


def can_reshard_from(saved: dict, live: dict) -> bool:
    """Whether ``saved`` (a manifest's data) differs from ``live`` (a store's
    description) only in its sharding, and records what a remap needs."""
    peers = (live.get("topology") or {}).get("shard_peers")
    return (
        peers is not None
        and (saved.get("topology") or {}).get("shard_peers") == peers
        and saved.get("pieces") is not None
        and not differences(saved, live, sharding=False)
    )


@dataclass
class Peer:
    """One saved store this rank's state is rebuilt from."""

    directory: str
    manifest: Manifest

    @property
    def data(self) -> dict:
        return self.manifest.data


def find_peers(base_dir: str, name: str, live: dict) -> list[Peer]:
    """Every saved store under ``base_dir`` of this store's optimizer and shard
    peers; [] when there is none. Raises when this optimizer's saves exist but
    none can serve, saying why: written before checkpoints recorded param ranges,
    another TP/PP/EP size, or another storage format or optimizer."""
    ours = (live.get("topology") or {}).get("shard_peers")
    if ours is None:
        return []  # a store that records no peers (no data parallelism) is never resharded
    try:
        stores = sorted(saved_dirs(base_dir).items())  # a cut-off replace's previous save included
    except FileNotFoundError:
        return []
    peers, unfit, older, other_sizes = [], [], [], set()
    for other, path in stores:
        if chain_position(other) != chain_position(name):
            continue
        check_plain_dir(path)  # as a load of its own save refuses a symlink
        if not os.path.lexists(os.path.join(path, MANIFEST_NAME)):
            continue
        manifest = Manifest.read(path)
        theirs = (manifest.data.get("topology") or {}).get("shard_peers")
        if theirs is None or manifest.data.get("pieces") is None:
            older.append(other)
        elif theirs == ours:
            (peers if can_reshard_from(manifest.data, live) else unfit).append(Peer(path, manifest))
        elif _sizes(theirs) != _sizes(ours):
            other_sizes.add(", ".join(f"{k} {theirs.get(k)} -> {ours.get(k)}" for k in sorted(_sizes(ours))))
        # else: another TP/PP/EP coordinate of the same sizes, whose params are not this rank's
    if unfit:
        raise CheckpointMismatchError(
            f"cannot reshard the streamed optimizer state from {', '.join(p.directory for p in unfit)}: "
            + "; ".join(differences(unfit[0].data, live, sharding=False))
        )
    if not peers and older:
        raise CheckpointMismatchError(
            f"{base_dir} holds streamed optimizer state ({', '.join(older[:4])}{' ...' if len(older) > 4 else ''}) "
            "saved before checkpoints recorded each entry's param range, or at another sharding than this run's: it "
            "loads only at the data-parallel size it was saved at. Resume at that size, or start the optimizer "
            "fresh from the checkpoint's params (Megatron: --no-load-optim)"
        )
    if not peers and other_sizes:
        raise CheckpointMismatchError(
            f"the streamed optimizer state in {base_dir} was saved with other parallel sizes ({'; '.join(other_sizes)}"
            "): only the data-parallel size may change. Resume with the saved TP, PP and EP sizes, or start the "
            "optimizer fresh from the checkpoint's params (Megatron: --no-load-optim)"
        )
    return peers


def _sizes(shard_peers: dict) -> dict:
    return {k: v for k, v in shard_peers.items() if k.endswith("_size")}


class VerifiedFile:
    """Reads of any byte range of a saved file, each covering whole checksum blocks
    whose CRC-32s are checked (the last block read is kept for the next read)."""

    def __init__(self, path: str, manifest: Manifest, name: str) -> None:
        self.path, self.size = path, manifest.files[name]["size"]
        self.block_bytes, self.crcs = manifest.block_bytes, manifest.crcs(name)
        self.fd = open_file(path, os.O_RDONLY)
        self._last: tuple[int, bytearray] | None = None

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes from ``offset``, every block they touch verified."""
        n, b = len(out), self.block_bytes
        if offset < 0 or offset + n > self.size:
            raise CheckpointMismatchError(f"{self.path}: bytes {offset}-{offset + n - 1} are past its end")
        done = 0
        while done < n:
            index, within = divmod(offset + done, b)
            block = self._block(index)
            take = min(n - done, len(block) - within)
            out[done : done + take] = block[within : within + take]
            done += take

    def _block(self, index: int) -> bytearray:
        if self._last is None or self._last[0] != index:
            data = bytearray(min(self.block_bytes, self.size - index * self.block_bytes))
            pread_full(self.fd, self.path, index * self.block_bytes, memoryview(data))
            crc = BlockCrc(None)
            crc.update(data)
            mismatch = crc_mismatch(crc.blocks, [self.crcs[index]], None)
            if mismatch:
                raise CheckpointMismatchError(f"{self.path}: block {index}: {mismatch}: the checkpoint is corrupt")
            self._last = (index, data)
        return self._last[1]

    def close(self) -> None:
        os.close(self.fd)


def _param_slots(groups: Sequence[int]) -> list[tuple[int, int]]:
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


class ReshardedLoad:
    """Rebuild one store's state from its peers' saves (see the module docstring).

    ``persistence`` is the live store's
    :class:`~miles_plugins.optimizers.checkpoint.persistence.Persistence`: its description
    (``pieces``: per bucket, per entry [param name, start, group]), buckets,
    backing, staging buffer and resident mains. Construction plans every copy
    and checks the peers' files (presence, sizes, layouts) without reading them.
    """

    def __init__(self, persistence, peers: list[Peer]) -> None:
        self.p, self.peers = persistence, peers
        live = persistence.description
        self.live_pieces = [
            [Piece(n, s, numel) for (n, s, _), numel in zip(pieces, b.numels, strict=True)]
            for pieces, b in zip(live["pieces"], persistence.buckets, strict=True)
        ]
        self.live_groups = [[g for _, _, g in pieces] for pieces in live["pieces"]]
        resident_numels = [m.numel() for m in persistence.resident_mains]
        self.live_resident = [
            Piece(n, s, numel) for (n, s, _), numel in zip(live["resident_pieces"], resident_numels, strict=True)
        ]
        self.live_resident_groups = [g for _, _, g in live["resident_pieces"]]
        # Per peer: each saved bucket's layout and optimizer slots, the resident slots and file offsets.
        self.source_layouts: list[list[BucketLayout]] = []
        self.source_slots: list[list[list[tuple[int, int]]]] = []
        self.resident_slots: list[list[tuple[int, int]]] = []
        self.resident_offsets: list[list[int]] = []
        self._plan()

    # ---- the plan and the small state ------------------------------------------

    def _plan(self) -> None:
        sources, resident_sources, problems = [], [], []
        for s, peer in enumerate(self.peers):
            data = peer.data
            problems += peer.manifest.file_problems(peer.directory).values()
            layouts = [self._source_layout(b, bucket, data["main_dtype"]) for b, bucket in enumerate(data["layout"])]
            problems += [
                f"{peer.directory}: {bucket['file']} is laid out for {bucket['size']} bytes, this version lays "
                f"it out in {layout.file_size} (written by a version with another file layout)"
                for bucket, layout in zip(data["layout"], layouts, strict=True)
                if layout is not None and (layout.file_size != bucket["size"] or layout.file_name != bucket["file"])
            ]
            self.source_layouts.append(layouts)
            self.source_slots.append([_param_slots([g for _, _, g in pieces]) for pieces in data["pieces"]])
            store = os.path.basename(peer.directory)
            for b, (bucket, pieces) in enumerate(zip(data["layout"], data["pieces"], strict=True)):
                for k, (name, start, _) in enumerate(pieces):
                    where = _Location(f"{store} bucket {b} entry {k}", s, b, k)
                    sources.append((where, Piece(name, start, bucket["numels"][k])))
            slots = _param_slots([g for _, _, g in data["resident_pieces"]])
            self.resident_slots.append(slots)
            offsets, offset = [], 0
            for (gi, j), numel in zip(slots, data["resident_numels"], strict=True):
                offsets.append(offset)
                offset += 2 * 4 * numel if data["resident_state"]["params"][gi][j] is not None else 0
            self.resident_offsets.append(offsets)
            if data["resident_pieces"] and data["files"].get(RESIDENT_FILE, {}).get("size") != offset:
                problems.append(f"{peer.directory}: {RESIDENT_FILE} does not hold the moments its state describes")
            for k, ((name, start, _), numel) in enumerate(
                zip(data["resident_pieces"], data["resident_numels"], strict=True)
            ):
                resident_sources.append((_Location(f"{store} resident entry {k}", s, k), Piece(name, start, numel)))
        steps = {peer.data.get("steps_taken") for peer in self.peers}
        if len(steps) != 1:
            problems.append(f"the saved stores hold the state after different steps: {sorted(steps)}")
        try:
            self.copies = [plan(pieces, sources) for pieces in self.live_pieces]
            self.resident_copies = plan(self.live_resident, resident_sources)
        except RemapError as exc:
            problems.append(str(exc))
        if problems:
            raise CheckpointMismatchError(
                f"cannot reshard the streamed optimizer state from {len(self.peers)} saved stores "
                f"({self._names()}):\n  - " + "\n  - ".join(problems)
            )
        self.steps = steps.pop()

    def _names(self) -> str:
        names = [os.path.basename(p.directory) for p in self.peers]
        return ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")

    def _source_layout(self, index: int, bucket: dict, main_dtype: str) -> BucketLayout | None:
        """A saved bucket's file layout, from its entry sizes and the saved main storage
        (the moments' format equals the live one: :func:`can_reshard_from`); checked
        against the saved file size by :meth:`_plan`."""
        if not self.p.buckets:
            return None
        main = MAIN_DTYPE if main_dtype == "fp32" else remainder.STORAGE_DTYPE
        moment = self.p.buckets[0].segments["exp_avg"]
        numels = bucket["numels"]
        with_main = bucket.get("main", True)
        return layout_bucket(index, range(len(numels)), numels, moment.dtype, main, moment.blockwise, with_main)

    def bucket_states(self) -> list[dict]:
        """Each live bucket optimizer's saved state, assembled from its pieces' sources."""
        return [
            self._state(groups, copies, self._bucket_param_state)
            for groups, copies in zip(self.live_groups, self.copies, strict=True)
        ]

    def resident_state(self) -> dict:
        return self._state(self.live_resident_groups, self.resident_copies, self._resident_param_state)

    def _state(self, groups: Sequence[int], copies: Sequence[Sequence[Copy]], source_state: Callable) -> dict:
        """An ``export_state`` dict for entries of master ``groups`` from their copies'
        sources (``source_state(copy)`` -> (group state, param state)): every source
        of one param must agree, and every source of one group."""
        out_groups: dict[int, dict] = {}
        out_params: list[list] = [[] for _ in range(len(set(groups)))]
        for (gi, _), entry_copies in zip(_param_slots(groups), copies, strict=True):
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
        s, b, k = copy.source
        gi, j = self.source_slots[s][b][k]
        saved = self.peers[s].data["bucket_state"][b]
        return saved["groups"][gi], saved["params"][gi][j]

    def _resident_param_state(self, copy: Copy) -> tuple[dict, object]:
        s, k = copy.source
        gi, j = self.resident_slots[s][k]
        saved = self.peers[s].data["resident_state"]
        return saved["groups"][gi], saved["params"][gi][j]

    def exceptions(self) -> list:
        """The remainder exceptions of every live entry, remapped from its sources'."""
        out = []
        for copies_of_bucket in self.copies:
            bucket_out = []
            for entry_copies in copies_of_bucket:
                index, high = [], []
                for c in entry_copies:
                    s, b, k = c.source
                    src_index, src_high = self.peers[s].data["main_exceptions"][b][k]
                    for i, h in zip(src_index, src_high, strict=True):
                        if c.source_offset <= i < c.source_offset + c.count:
                            index.append(i - c.source_offset + c.target_offset)
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
            b = bucket.index
            files: dict[tuple[int, int], VerifiedFile] = {}
            handle = self.p.backing.open(bucket) if write else None
            try:
                for name, segment in bucket.segments.items():
                    for k, entry_copies in enumerate(self.copies[b]):
                        if segment.blockwise:
                            out = self._requantized(name, bucket.numels[k], entry_copies, files)
                        else:
                            out = self._copied(name, segment.dtype.itemsize, bucket.numels[k], entry_copies, files)
                        if handle is not None:
                            self._write(handle, segment.entry_offsets[k], out)
            finally:
                if handle is not None:
                    handle.close()
                for f in files.values():
                    f.close()

    def _source(self, copy: Copy, files: dict) -> tuple[BucketLayout, VerifiedFile]:
        """The saved bucket a copy reads from, and its file (opened once per live bucket)."""
        s, sb, _ = copy.source
        layout = self.source_layouts[s][sb]
        if (s, sb) not in files:
            peer = self.peers[s]
            files[(s, sb)] = VerifiedFile(
                os.path.join(peer.directory, layout.file_name), peer.manifest, layout.file_name
            )
        return layout, files[(s, sb)]

    def _copied(self, name: str, size: int, numel: int, copies: Sequence[Copy], files: dict) -> memoryview:
        """An elementwise segment's stored bytes for one entry: its copies' bytes."""
        out = memoryview(bytearray(numel * size))
        for c in copies:
            layout, file = self._source(c, files)
            offset = layout.segments[name].entry_offsets[c.source[2]] + c.source_offset * size
            file.read_into(offset, out[c.target_offset * size : (c.target_offset + c.count) * size])
        return out

    def _requantized(self, name: str, numel: int, copies: Sequence[Copy], files: dict) -> memoryview:
        """A blockwise 8-bit segment's stored form for one entry: its copies' values
        decoded from their saved blocks (or fp32, for saved entries too small to
        quantize), then quantized in this entry's own blocks. Exact where the
        blocks are the same; elsewhere one more rounding, as a step's store adds."""
        signed, sqrt = quant8.MOMENT_FORMATS[name]
        values = torch.empty(numel, dtype=torch.float32)
        for c in copies:
            layout, file = self._source(c, files)
            sk = c.source[2]
            offset, saved = layout.segments[name].entry_offsets[sk], layout.numels[sk]
            target = values[c.target_offset : c.target_offset + c.count]
            if not quant8.quantizes(saved):
                file.read_into(offset + c.source_offset * 4, _bytes_of(target))
                continue
            first, last = c.source_offset // quant8.BLOCK, (c.source_offset + c.count - 1) // quant8.BLOCK
            start, end = first * quant8.BLOCK, min((last + 1) * quant8.BLOCK, saved)
            codes = torch.empty(end - start, dtype=torch.uint8)
            scales = torch.empty(last - first + 1, dtype=torch.float32)
            file.read_into(offset + start, _bytes_of(codes))
            file.read_into(offset + saved + first * 4, _bytes_of(scales))
            decoded = quant8.dequantize_chunk(codes, scales, signed)
            if sqrt:
                decoded.square_()
            target.copy_(decoded[c.source_offset - start : c.source_offset - start + c.count])
        quant8.narrow_in_place(values, signed, sqrt)
        return _bytes_of(values)[: quant8.stored_nbytes(numel)]

    def _write(self, handle, offset: int, data: memoryview) -> None:
        staging = self.p.buffer()
        step = len(staging.view)
        view = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        for at in range(0, len(data), step):
            handle.write(offset + at, view[at : at + step], staging)

    def resident_bytes(self, state: dict) -> bytes:
        """The live resident moments (exp_avg then exp_avg_sq of each param with
        state, :meth:`resident_state`'s), gathered from the peers' resident files."""
        out = bytearray()
        files: dict[int, VerifiedFile] = {}
        try:
            slots = _param_slots(self.live_resident_groups)
            for (gi, j), entry_copies, piece in zip(slots, self.resident_copies, self.live_resident, strict=True):
                if state["params"][gi][j] is None:
                    continue
                for moment in range(2):
                    part = memoryview(bytearray(piece.numel * 4))
                    for c in entry_copies:
                        s, k = c.source
                        if s not in files:
                            peer = self.peers[s]
                            files[s] = VerifiedFile(
                                os.path.join(peer.directory, RESIDENT_FILE), peer.manifest, RESIDENT_FILE
                            )
                        numel = self.peers[s].data["resident_numels"][k]
                        offset = self.resident_offsets[s][k] + (moment * numel + c.source_offset) * 4
                        files[s].read_into(offset, part[c.target_offset * 4 : (c.target_offset + c.count) * 4])
                    out += part
        finally:
            for f in files.values():
                f.close()
        return bytes(out)


class _Location(tuple):
    """Where a saved piece lives: (peer, bucket, entry) or (peer, resident entry),
    named for messages by its store directory."""

    def __new__(cls, label: str, *index: int) -> _Location:
        location = super().__new__(cls, index)
        location.label = label
        return location

    def __str__(self) -> str:
        return self.label


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")
