"""The new ranks' stores of an offline reshard: what each holds and how it is laid out.

Computed from what the saves recorded (``param_layout``: every param's place
in its DDP bucket, the padding rule) as Megatron's ``DistributedOptimizer``
computes its sharding: each bucket padded to a multiple of ``lcm(dp, 128)``
(``lcm(dp, 128, 2**16)`` with padding for NCCL bus bandwidth) and cut into
``dp`` equal ranges (:func:`megatron_pieces`). A rank's entries follow the
master's param groups, each group in bucket order, bf16 params before fp32
ones; its streaming buckets follow the saved bucket cap (:func:`new_store`).
Nothing here reads or writes files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from miles_plugins.optimizers.checkpoint.manifest import description_of
from miles_plugins.optimizers.checkpoint.reshard_peers import Peer
from miles_plugins.optimizers.checkpoint.reshard_plan import Piece
from miles_plugins.optimizers.config import BLOCKWISE_MOMENT_DTYPES, MOMENT_DTYPES
from miles_plugins.optimizers.errors import CheckpointMismatchError
from miles_plugins.optimizers.formats import remainder
from miles_plugins.optimizers.formats.layout import MAIN_DTYPE, BucketLayout, layout_store


def megatron_pieces(param_layout: dict, dp: int, rank: int) -> list[tuple[tuple[int, int], Piece]]:
    """(DDP bucket key, piece) of every param range DP rank ``rank`` of ``dp`` owns,
    in the order Megatron's range maps list them."""
    extra = 2**16 if param_layout.get("pad_for_high_nccl_busbw") else 1
    divisor = math.lcm(dp, 128, extra)
    out = []
    for bucket in param_layout["buckets"]:
        shard = -(-bucket["size"] // divisor) * divisor // dp
        lo, hi = rank * shard, (rank + 1) * shard
        for name, start, numel in bucket["params"]:
            first, last = max(lo, start), min(hi, start + numel)
            if last > first:
                out.append((tuple(bucket["key"]), Piece(name, first - start, last - first)))
    return out


def default_ddp_bucket_size(dp: int | None) -> int | None:
    """Megatron's DDP bucket size when --ddp-bucket-size is not given (DistributedDataParallel)."""
    return None if dp is None else max(40_000_000, 1_000_000 * dp)


@dataclass(frozen=True)
class NewStore:
    """One new rank's store: its manifest description (the saved one with this
    rank's sharding), its bucket layouts, and its resident entries' sizes."""

    description: dict
    buckets: list[BucketLayout]
    resident_numels: list[int]

    @property
    def name(self) -> str:
        return self.description["store"]


@dataclass(frozen=True)
class _OwnedRange:
    """A param range a new rank owns, with its master param group and DDP bucket."""

    piece: Piece
    group: int
    ddp_bucket: tuple[int, int]


def new_store(name: str, peers: Sequence[Peer], dp: int, rank: int) -> NewStore:
    """The store ``name`` of DP rank ``rank`` of ``dp``, from one optimizer's saves
    ``peers``. Raises when a param of the saved DDP layout is in no saved store."""
    first = peers[0].data
    groups, fp32 = _saved_params(peers)
    ranges = megatron_pieces(first["param_layout"], dp, rank)
    if lost := sorted({p.key for _, p in ranges if p.key not in groups}):
        raise CheckpointMismatchError(
            f"cannot reshard into {name}: param(s) {lost[:4]} of the saved DDP layout are in no saved store "
            "(a store of the checkpoint is missing)"
        )
    owned = [_OwnedRange(p, groups[p.key], key) for key, p in ranges]
    # The master's groups in order, each in bucket order; bf16 params before fp32 ones (the binding's
    # order); the fp32 params' moments in buckets of their own after the others, as the store lays them out.
    by_group = sorted(owned, key=lambda e: e.group)
    moments_streamed = first.get("fp32_param_moments", "resident") == "streamed"
    resident = [] if moments_streamed else [e for e in by_group if e.piece.key in fp32]
    streamed = [e for e in by_group if moments_streamed or e.piece.key not in fp32]
    buckets = layout_store(
        [(j, e.piece.numel, e.ddp_bucket, e.piece.key in fp32) for j, e in enumerate(streamed)],
        first["bucket_cap_elements"],
        MOMENT_DTYPES[first["moment_dtype"]],
        MAIN_DTYPE if first["main_dtype"] == "fp32" else remainder.STORAGE_DTYPE,
        first["moment_dtype"] in BLOCKWISE_MOMENT_DTYPES,
    )
    description = {
        # Every field of the saved description (formats, optimizer, the recorded layout; fields
        # added later included), then this rank's sharding in place of the saved one.
        **description_of(first),
        "store": name,
        "topology": _topology(first["topology"], dp, rank),
        "layout": [b.description() for b in buckets],
        "resident_numels": [e.piece.numel for e in resident],
        "pieces": [
            [[streamed[j].piece.key, streamed[j].piece.start, streamed[j].group] for j in b.entry_indices]
            for b in buckets
        ],
        "resident_pieces": [[e.piece.key, e.piece.start, e.group] for e in resident],
    }
    return NewStore(description, buckets, [e.piece.numel for e in resident])


def _saved_params(peers: Sequence[Peer]) -> tuple[dict[str, int], set[str]]:
    """Every saved param's master group, and the names of the fp32 params (their
    moments resident, or in buckets without mains)."""
    groups, fp32 = {}, set()
    for peer in peers:
        for bucket, pieces in zip(peer.data["layout"], peer.data["pieces"], strict=True):
            groups.update({n: g for n, _, g in pieces})
            if bucket.get("main") is False:  # a bucket of fp32 params' moments
                fp32.update(n for n, _, _ in pieces)
        groups.update({n: g for n, _, g in peer.data["resident_pieces"]})
        fp32.update(n for n, _, _ in peer.data["resident_pieces"])
    return groups, fp32


def _topology(saved: dict, dp: int, rank: int) -> dict:
    """The saved topology at DP rank ``rank`` of ``dp``. Data parallelism alone (the
    offline reshard refuses anything else): the world is the DP group, the global
    rank the DP rank."""
    topology = {**saved, "dp_size": dp, "dp_rank": rank}
    if "world_size" in topology:
        topology["world_size"] = dp
    return topology
