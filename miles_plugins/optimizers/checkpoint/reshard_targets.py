"""The new ranks' stores of an offline reshard: what each holds and how it is laid out.

Computed from what the saves recorded (``param_layout``: every param's place
in its DDP bucket, the padding rule) as Megatron's ``DistributedOptimizer``
computes its sharding: each bucket padded to a multiple of ``lcm(dp, 128)``
(``lcm(dp, 128, 2**16)`` with padding for NCCL bus bandwidth) and cut into
``dp`` equal ranges (:func:`megatron_pieces`). A rank's entries follow the
master's param groups, each group in bucket order, bf16 params before fp32
ones; its streaming buckets follow the saved bucket cap (:func:`new_store`).
At other TP, PP or EP sizes the DDP layout itself is Megatron's at those sizes,
computed from the model the saves record (:func:`layout_stores`); every store
then also records its params' keys and boxes, as a run there would.
Nothing here reads or writes files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from miles_plugins.optimizers.checkpoint.manifest import description_of
from miles_plugins.optimizers.checkpoint.reshard_layout import Sizes, coordinates, ddp_layout, rank_params
from miles_plugins.optimizers.checkpoint.reshard_layout import topology as layout_topology
from miles_plugins.optimizers.checkpoint.reshard_model import saved_model
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
    return store_of(
        name,
        first,
        _Params(first["param_layout"], groups, fp32),
        (dp, rank),
        {"topology": _topology(first["topology"], dp, rank)},
    )


@dataclass(frozen=True)
class _Params:
    """An optimizer's params at a layout: its DDP buckets (``param_layout``), each
    param's master group, and the names of its fp32 params."""

    param_layout: dict
    groups: dict[str, int]
    fp32: set[str]


def store_of(name: str, saved: dict, params: _Params, dp_rank: tuple[int, int], recorded: dict) -> NewStore:
    """The store ``name`` of DP rank ``dp_rank[1]`` of ``dp_rank[0]`` over ``params``,
    in the formats of ``saved`` (a saved store's description) and with the fields
    ``recorded`` (its topology; at another layout its DDP buckets and param facts).
    Its entries follow the master's param groups, each group in bucket order, bf16
    params before fp32 ones (the binding's order); the fp32 params' moments in
    buckets of their own after the others, as the store lays them out."""
    ranges = megatron_pieces(params.param_layout, *dp_rank)
    if lost := sorted({p.key for _, p in ranges if p.key not in params.groups}):
        raise CheckpointMismatchError(
            f"cannot reshard into {name}: param(s) {lost[:4]} of the saved DDP layout are in no saved store "
            "(a store of the checkpoint is missing)"
        )
    owned = sorted((_OwnedRange(p, params.groups[p.key], key) for key, p in ranges), key=lambda e: e.group)
    fp32 = params.fp32
    moments_streamed = saved.get("fp32_param_moments", "resident") == "streamed"
    resident = [] if moments_streamed else [e for e in owned if e.piece.key in fp32]
    streamed = [e for e in owned if moments_streamed or e.piece.key not in fp32]
    buckets = layout_store(
        [(j, e.piece.numel, e.ddp_bucket, e.piece.key in fp32) for j, e in enumerate(streamed)],
        saved["bucket_cap_elements"],
        MOMENT_DTYPES[saved["moment_dtype"]],
        MAIN_DTYPE if saved["main_dtype"] == "fp32" else remainder.STORAGE_DTYPE,
        saved["moment_dtype"] in BLOCKWISE_MOMENT_DTYPES,
    )
    description = {
        # Every field of the saved description (formats, optimizer, the recorded layout; fields
        # added later included), then this rank's in place of the saved ones.
        **description_of(saved),
        **recorded,
        "store": name,
        "layout": [b.description() for b in buckets],
        "resident_numels": [e.piece.numel for e in resident],
        "pieces": [
            [[streamed[j].piece.key, streamed[j].piece.start, streamed[j].group] for j in b.entry_indices]
            for b in buckets
        ],
        "resident_pieces": [[e.piece.key, e.piece.start, e.group] for e in resident],
    }
    return NewStore(description, buckets, [e.piece.numel for e in resident])


def layout_stores(peers: Sequence[Peer], sizes: Sizes) -> list[NewStore]:
    """Every store of every rank of another TP, PP, EP (and DP) layout, from all the
    saves of a checkpoint (``reshard_model``, ``reshard_layout``)."""
    model = saved_model(peers)
    if problems := sizes.problems(model):
        raise CheckpointMismatchError(f"cannot lay the model out at {_sizes(sizes)}: " + "; ".join(problems[:4]))
    dense = next(p.data for p in peers if "tp_size" in p.data["topology"]["shard_peers"])
    expert = next((p.data for p in peers if "expert_tp_size" in p.data["topology"]["shard_peers"]), dense)
    bucket_size, pad = dense["param_layout"]["ddp_bucket_size"], dense["param_layout"]["pad_for_high_nccl_busbw"]
    stores = []
    for rank in range(sizes.world):
        at = coordinates(sizes, rank)
        held = rank_params(model, sizes, at)
        for chain in sorted({p.chain for p in held}):
            mine = [p for p in held if p.chain == chain]
            params = _Params(
                ddp_layout(mine, bucket_size if at.pp_rank == 0 else None, pad),
                {p.name: p.group for p in mine},
                {p.name for p in mine if p.fp32},
            )
            is_expert = chain == 1
            recorded = {
                "topology": layout_topology(sizes, at, is_expert),
                "param_layout": params.param_layout,
                "param_facts": {**dense["param_facts"], "params": {p.name: p.facts for p in mine}},
            }
            dp_rank = (sizes.expert_dp, at.expert_dp_rank) if is_expert else (sizes.dp, at.dp_rank)
            stores.append(store_of(f"rank{rank}.opt{chain}", expert if is_expert else dense, params, dp_rank, recorded))
    return stores


def _sizes(sizes: Sizes) -> str:
    return f"TP {sizes.tp}, PP {sizes.pp}, EP {sizes.ep}, DP {sizes.dp}"


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
