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

from miles_plugins.optimizers import quant8
from miles_plugins.optimizers.errors import CheckpointMismatchError
from miles_plugins.optimizers.fs import open_file
from miles_plugins.optimizers.io import BlockCrc, pread_full
from miles_plugins.optimizers.layout import BucketLayout, layout_bucket
from miles_plugins.optimizers.manifest import MANIFEST_NAME, RESIDENT_FILE, Manifest, crc_mismatch
from miles_plugins.optimizers.reshard import Copy, Piece, RemapError, plan

# The manifest fields a resharded load may find different from the live store's.
SHARDING_FIELDS = {"topology", "layout", "resident_numels"}


def chain_position(name: str) -> str:
    """``opt<i>`` of a store named ``rank<k>.opt<i>`` (the optimizer it belongs to)."""
    return name.rsplit(".", 1)[-1]


def can_reshard_from(saved: dict, live: dict) -> bool:
    """Whether ``saved`` (a manifest's data) differs from ``live`` (a store's
    description) only in its sharding, and records what a remap needs."""
    differing = {
        key for key in set(saved) | set(live) if key in live and key != "pieces" and saved.get(key) != live.get(key)
    }
    differing -= {"resident_pieces", "store"}
    peers = (live.get("topology") or {}).get("shard_peers")
    return (
        peers is not None
        and (saved.get("topology") or {}).get("shard_peers") == peers
        and saved.get("pieces") is not None
        and differing <= SHARDING_FIELDS
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
    """Every saved store under ``base_dir`` of this store's optimizer whose
    manifest it can be resharded from; [] when there is none. A peer of this
    optimizer that cannot serve (another format, TP/PP/EP, no pieces) is refused,
    naming what differs."""
    if (live.get("topology") or {}).get("shard_peers") is None:
        return []  # a store that records no peers (no data parallelism) is never resharded
    try:
        names = sorted(os.listdir(base_dir))
    except FileNotFoundError:
        return []
    peers, refused = [], []
    for other in names:
        path = os.path.join(base_dir, other)
        if other.startswith(".") or chain_position(other) != chain_position(name) or not os.path.isdir(path):
            continue
        if not os.path.lexists(os.path.join(path, MANIFEST_NAME)):
            continue
        manifest = Manifest.read(path)
        saved_peers = (manifest.data.get("topology") or {}).get("shard_peers")
        if saved_peers != (live.get("topology") or {}).get("shard_peers"):
            continue  # another TP/PP/EP coordinate: its params are not this rank's
        if can_reshard_from(manifest.data, live):
            peers.append(Peer(path, manifest))
        else:
            refused.append(path)
    if refused:
        raise CheckpointMismatchError(
            f"cannot reshard the streamed optimizer state from {', '.join(refused)}: they differ from this run in "
            "more than the data-parallel sharding (storage formats, optimizer, TP/PP/EP sizes), or were written "
            "before checkpoints recorded param ranges (format 3)"
        )
    return peers


class VerifiedFile:
    """Reads of any byte range of a saved file, each covering whole checksum blocks
    whose CRC-32s are checked (the last two blocks are kept for neighbouring reads)."""

    def __init__(self, path: str, manifest: Manifest, name: str) -> None:
        self.path, self.size = path, manifest.files[name]["size"]
        self.block_bytes, self.crcs = manifest.block_bytes, manifest.crcs(name)
        self.fd = open_file(path, os.O_RDONLY)
        self._cache: dict[int, bytes] = {}

    def read(self, offset: int, n: int) -> bytes:
        if n == 0:
            return b""
        if offset < 0 or offset + n > self.size:
            raise CheckpointMismatchError(f"{self.path}: bytes {offset}-{offset + n - 1} are past its end")
        b = self.block_bytes
        parts = [self._block(i) for i in range(offset // b, (offset + n - 1) // b + 1)]
        start = offset - (offset // b) * b
        return b"".join(parts)[start : start + n]

    def _block(self, index: int) -> bytes:
        if index not in self._cache:
            length = min(self.block_bytes, self.size - index * self.block_bytes)
            data = bytearray(length)
            pread_full(self.fd, self.path, index * self.block_bytes, memoryview(data))
            crc = BlockCrc(None)
            crc.update(data)
            mismatch = crc_mismatch(crc.blocks, [self.crcs[index]], None)
            if mismatch:
                raise CheckpointMismatchError(f"{self.path}: block {index}: {mismatch}: the checkpoint is corrupt")
            if len(self._cache) >= 2:
                self._cache.pop(next(iter(self._cache)))
            self._cache[index] = bytes(data)
        return self._cache[index]

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

    ``live`` is the store's description (with ``pieces``: per bucket, per entry
    [param name, start, group]); the other arguments are the parts of
    :class:`~miles_plugins.optimizers.persistence.Persistence`.
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
        self.problems: list[str] = []
        self._plan()

    # ---- the plan and the small state ------------------------------------------

    def _plan(self) -> None:
        sources, resident_sources = [], []
        self.source_layouts: list[list[BucketLayout]] = []
        for s, peer in enumerate(self.peers):
            data = peer.data
            layouts = []
            for b, (bucket, pieces) in enumerate(zip(data["layout"], data["pieces"], strict=True)):
                layouts.append(self._source_layout(b, bucket))
                for k, (name, start, _) in enumerate(pieces):
                    sources.append(((s, b, k), Piece(name, start, bucket["numels"][k])))
            self.source_layouts.append(layouts)
            for k, ((name, start, _), numel) in enumerate(
                zip(data["resident_pieces"], data["resident_numels"], strict=True)
            ):
                resident_sources.append(((s, k), Piece(name, start, numel)))
        try:
            self.copies = [plan(pieces, sources) for pieces in self.live_pieces]
            self.resident_copies = plan(self.live_resident, resident_sources)
        except RemapError as exc:
            raise CheckpointMismatchError(
                f"cannot reshard the streamed optimizer state from {len(self.peers)} saved stores: {exc}"
            ) from None
        steps = {peer.data.get("steps_taken") for peer in self.peers}
        if len(steps) != 1:
            raise CheckpointMismatchError(f"the saved stores hold the state after different steps: {sorted(steps)}")
        self.steps = steps.pop()

    def _source_layout(self, index: int, bucket: dict) -> BucketLayout | None:
        """A saved bucket's file layout, from its entry sizes in the live storage formats
        (equal to the saved ones: :func:`can_reshard_from`)."""
        if not self.p.buckets:
            return None
        main, moment = self.p.buckets[0].segments["main"], self.p.buckets[0].segments["exp_avg"]
        numels = bucket["numels"]
        return layout_bucket(index, range(len(numels)), numels, moment.dtype, main.dtype, moment.blockwise)

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
        slots = _param_slots(groups)
        out_groups: dict[int, dict] = {}
        out_params: list[list] = [[] for _ in range(len(set(groups)))]
        for (gi, _), entry_copies in zip(slots, copies, strict=True):
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
        data = self.peers[s].data
        gi, j = _param_slots([g for _, _, g in data["pieces"][b]])[k]
        saved = data["bucket_state"][b]
        return saved["groups"][gi], saved["params"][gi][j]

    def _resident_param_state(self, copy: Copy) -> tuple[dict, object]:
        s, k = copy.source
        data = self.peers[s].data
        gi, j = _param_slots([g for _, _, g in data["resident_pieces"]])[k]
        saved = data["resident_state"]
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

    def write_buckets(self, write: bool) -> None:
        """Assemble every live bucket's segments from the peers' files, verifying
        each block read; with ``write``, into the backing (its spare slot on disk)."""
        files: dict[tuple[int, str], VerifiedFile] = {}
        try:
            for b, bucket in enumerate(self.p.buckets):
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
        finally:
            for f in files.values():
                f.close()

    def _source(self, copy: Copy, files: dict) -> tuple[BucketLayout, VerifiedFile]:
        """The saved bucket a copy reads from, and its file (opened once per load)."""
        s, sb, _ = copy.source
        layout = self.source_layouts[s][sb]
        if (s, sb) not in files:
            peer = self.peers[s]
            path = os.path.join(peer.directory, layout.file_name)
            files[(s, sb)] = VerifiedFile(path, peer.manifest, layout.file_name)
        return layout, files[(s, sb)]

    def _copied(self, name: str, size: int, numel: int, copies: Sequence[Copy], files: dict) -> bytearray:
        """An elementwise segment's stored bytes for one entry: its copies' bytes."""
        out = bytearray(numel * size)
        for c in copies:
            layout, file = self._source(c, files)
            offset = layout.segments[name].entry_offsets[c.source[2]] + c.source_offset * size
            out[c.target_offset * size : (c.target_offset + c.count) * size] = file.read(offset, c.count * size)
        return out

    def _requantized(self, name: str, numel: int, copies: Sequence[Copy], files: dict) -> bytearray:
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
                target.copy_(_floats(file.read(offset + c.source_offset * 4, c.count * 4)))
                continue
            first, last = c.source_offset // quant8.BLOCK, (c.source_offset + c.count - 1) // quant8.BLOCK
            start, end = first * quant8.BLOCK, min((last + 1) * quant8.BLOCK, saved)
            codes = torch.frombuffer(bytearray(file.read(offset + start, end - start)), dtype=torch.uint8)
            scales = _floats(file.read(offset + saved + first * 4, (last - first + 1) * 4))
            decoded = quant8.dequantize_chunk(codes, scales, signed)
            if sqrt:
                decoded.square_()
            target.copy_(decoded[c.source_offset - start : c.source_offset - start + c.count])
        quant8.narrow_in_place(values, signed, sqrt)
        return bytearray(values.view(torch.uint8)[: quant8.stored_nbytes(numel)].numpy().tobytes())

    def _write(self, handle, offset: int, data: bytearray) -> None:
        staging = self.p.buffer()
        step = len(staging.view)
        view = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
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
                    part = bytearray(piece.numel * 4)
                    for c in entry_copies:
                        s, k = c.source
                        if s not in files:
                            peer = self.peers[s]
                            path = os.path.join(peer.directory, RESIDENT_FILE)
                            files[s] = VerifiedFile(path, peer.manifest, RESIDENT_FILE)
                        numel = self.peers[s].data["resident_numels"][k]
                        offset = self._resident_offset(s, k) + (moment * numel + c.source_offset) * 4
                        part[c.target_offset * 4 : (c.target_offset + c.count) * 4] = files[s].read(offset, c.count * 4)
                    out += part
        finally:
            for f in files.values():
                f.close()
        return bytes(out)

    def _resident_offset(self, s: int, k: int) -> int:
        """Where source resident entry ``k``'s moments start in peer ``s``'s file."""
        data = self.peers[s].data
        slots = _param_slots([g for _, _, g in data["resident_pieces"]])
        offset = 0
        for i in range(k):
            gi, j = slots[i]
            if data["resident_state"]["params"][gi][j] is not None:
                offset += 2 * 4 * data["resident_numels"][i]
        return offset


def _floats(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32)
