"""Another layout's ranks as Megatron builds them: their params, boxes, DDP buckets and topology.

From the model a checkpoint was saved from (``reshard_model``) and new TP, PP,
EP and DP sizes, this computes what each new rank's optimizers hold, as
Megatron's own code would at those sizes (expert TP equal to TP, no context
parallelism, one optimizer instance):

- ranks in Megatron's default order ``tp-cp-ep-dp-pp`` (:func:`coordinates`);
- a rank's params: its stage's layers (evenly split), the first stage's
  embedding, the last stage's final norm and output layer (and, at PP > 1, the
  tied embedding's copy), its EP rank's experts; in model order, renamed with
  their new local layer and expert indices (:func:`rank_params`);
- their boxes at the new TP rank (:func:`_boxes`: a SwiGLU factory's halves
  interleaved as Megatron's factory places them);
- the optimizer chain: experts in an optimizer of their own at EP > 1;
- each optimizer's DDP buckets (:func:`ddp_layout`), as ``_ParamAndGradBuffer``
  lays them out: one buffer per param dtype, params in reverse order, each start
  padded to 64 elements, a tied embedding alone in its bucket at PP > 1, buckets
  cut at the saved bucket size on the first stage only.

Nothing here reads or writes files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from miles_plugins.optimizers.checkpoint.reshard_model import ModelParam, SavedModel


@dataclass(frozen=True)
class Sizes:
    """The new parallel sizes."""

    tp: int
    pp: int
    ep: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        return self.dp // self.ep

    def problems(self, model: SavedModel) -> list[str]:
        """Why Megatron could not build ``model`` at these sizes, if it could not."""
        found = []
        if model.layers and model.layers % self.pp:
            found.append(f"{model.layers} layers do not split evenly over {self.pp} pipeline stages")
        if self.dp % self.ep or (self.ep > 1 and (not model.experts or model.experts % self.ep)):
            found.append(f"EP {self.ep} must divide DP {self.dp} and the {model.experts} experts")
        for param in model.params:
            extent, axis = _split_extent(param)
            if extent is not None and extent % (len(param.parts) * self.tp):
                found.append(
                    f"{param.parts[0]['key']} has {extent} elements on its TP axis {axis}: not a multiple of TP {self.tp}"
                )
        return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Coordinates:
    """A new global rank's place in the dense and the expert grids."""

    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    ep_rank: int
    expert_dp_rank: int


def coordinates(sizes: Sizes, rank: int) -> Coordinates:
    """Global rank ``rank``'s coordinates in Megatron's default order (TP fastest, then
    DP, then PP; within a stage's expert grid: expert TP = TP, then EP, then expert DP)."""
    within = rank % (sizes.tp * sizes.dp)
    return Coordinates(
        rank,
        rank % sizes.tp,
        within // sizes.tp,
        rank // (sizes.tp * sizes.dp),
        (within // sizes.tp) % sizes.ep,
        within // (sizes.tp * sizes.ep),
    )


@dataclass(frozen=True)
class RankParam:
    """One param of a new rank: its name there, facts and master group, and which
    optimizer of the chain holds it."""

    name: str
    facts: dict
    fp32: bool
    group: int
    chain: int


def rank_params(model: SavedModel, sizes: Sizes, at: Coordinates) -> list[RankParam]:
    """The params of the new rank ``at``, in its model's order."""
    per_stage = model.layers // sizes.pp if model.layers else 0
    per_rank = model.experts // sizes.ep if model.experts else 0
    layered = [i for i, p in enumerate(model.params) if p.layer is not None]
    first, last = (layered[0], layered[-1]) if layered else (len(model.params), -1)
    out = []
    for index, param in enumerate(model.params):
        if param.layer is not None:
            held = param.layer // per_stage == at.pp_rank
        elif param.pipeline_copy:  # the tied embedding's copy on the last stage
            held = sizes.pp > 1 and at.pp_rank == sizes.pp - 1
        else:  # before the layers (embeddings): the first stage; after them: the last
            held = at.pp_rank == (sizes.pp - 1 if index > last else 0)
        if param.expert is not None:
            held = held and param.expert // per_rank == at.ep_rank
        if not held:
            continue
        local_layer = None if param.layer is None else param.layer - at.pp_rank * per_stage
        local_expert = None if param.expert is None else param.expert - at.ep_rank * per_rank
        facts = {
            **param.facts,
            "parts": _boxes(param, sizes, at),
            "position": len(out),
            "shared_embedding": bool(param.facts.get("shared_embedding")) and sizes.pp > 1,
        }
        chain = 1 if sizes.ep > 1 and param.expert is not None else 0
        out.append(RankParam(param.renamed(local_layer, local_expert), facts, param.fp32, param.group, chain))
    return out


def _split_extent(param: ModelParam) -> tuple[int | None, int | None]:
    """The extent of the axis TP (or a factory's halves) splits, and the axis; (None, None): none."""
    part = param.parts[0]
    axis = param.facts.get("tp_axis")
    if axis is None and len(param.parts) > 1:
        axis = part["prepend_axis_num"]
    return (None, None) if axis is None else (part["global_shape"][axis], axis)


def _boxes(param: ModelParam, sizes: Sizes, at: Coordinates) -> list[dict]:
    """``param``'s parts at TP rank ``at.tp_rank``: the split axis cut in ``parts x TP``
    equal slices, part ``j`` of rank ``t`` at slice ``j * TP + t``; other axes whole."""
    extent, axis = _split_extent(param)
    tp_split = param.facts.get("tp_axis") is not None
    dp_rank = at.expert_dp_rank if sizes.ep > 1 and param.expert is not None else at.dp_rank
    out, start = [], 0
    for j, saved in enumerate(param.parts):
        prepend, shape = saved["prepend_axis_num"], saved["global_shape"]
        local, offset = list(shape[prepend:]), [*saved["global_offset"][:prepend], *([0] * (len(shape) - prepend))]
        if axis is not None:
            width = extent // (len(param.parts) * (sizes.tp if tp_split else 1))
            local[axis - prepend] = width
            offset[axis] = (j * (sizes.tp if tp_split else 1) + (at.tp_rank if tp_split else 0)) * width
        replica = [param.pipeline_copy, 0 if tp_split else at.tp_rank, dp_rank]
        out.append({**saved, "start": start, "local_shape": local, "global_offset": offset, "replica_id": replica})
        start += math.prod(local)
    return out


def ddp_layout(params: list[RankParam], bucket_size: int | None, pad_for_high_nccl_busbw: bool) -> dict:
    """What the binding records of one optimizer's DDP buckets (``megatron.param_layout``)
    for ``params`` (its params, in model order); ``bucket_size``: None on a stage after
    the first, or without overlapped grad reduction."""
    buffers: dict[bool, list[RankParam]] = {}
    for param in params:  # one buffer per param dtype, in order of first appearance
        buffers.setdefault(param.fp32, []).append(param)
    buckets = []
    for gbuf, members in enumerate(buffers.values()):
        cut: list[list[list]] = [[]]
        start = 0
        for param in reversed(members):
            numel = sum(math.prod(p["local_shape"]) for p in param.facts["parts"])
            start = _pad(start, 64)
            shared = param.facts["shared_embedding"]
            if shared and cut[-1]:  # alone in its bucket
                cut.append([])
                start = 0
            cut[-1].append([param.name, start, numel])
            start += numel
            if (bucket_size is not None and start >= bucket_size) or shared:
                cut.append([])
                start = 0
        filled = [c for c in cut if c]
        buckets += [{"key": [gbuf, b], "params": c, "size": max(s + n for _, s, n in c)} for b, c in enumerate(filled)]
    return {"buckets": buckets, "pad_for_high_nccl_busbw": pad_for_high_nccl_busbw, "ddp_bucket_size": bucket_size}


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def topology(sizes: Sizes, at: Coordinates, expert: bool) -> dict:
    """The topology the binding records for the new rank's dense or expert optimizer."""
    if expert:
        peers = {"expert_tp_size": sizes.tp, "expert_tp_rank": at.tp_rank, "ep_size": sizes.ep, "ep_rank": at.ep_rank}
    else:
        peers = {"tp_size": sizes.tp, "tp_rank": at.tp_rank, "ep_size": sizes.ep}
    peers.update(pp_size=sizes.pp, pp_rank=at.pp_rank, optimizer_instance=0)
    return {
        "shard_peers": peers,
        "world_size": sizes.world,
        "tp_size": sizes.tp,
        "tp_rank": at.tp_rank,
        "pp_size": sizes.pp,
        "pp_rank": at.pp_rank,
        "ep_size": sizes.ep,
        "ep_rank": at.ep_rank,
        "dp_size": sizes.expert_dp if expert else sizes.dp,
        "dp_rank": at.expert_dp_rank if expert else at.dp_rank,
        "optimizer_instance": 0,
    }
