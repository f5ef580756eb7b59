"""The model a checkpoint was saved from, rebuilt from its stores' param facts.

An offline reshard to other TP, PP or EP sizes must name the params each new
rank holds, in the order its model lists them, before any new rank exists. The
saves record, per param of each saved rank, its name, its chunk position and
its boxes (``megatron/param_facts.py``); :func:`saved_model` turns them into
the layout-independent list of :class:`ModelParam`: one per key and cell (global
layer, global expert) and pipeline copy, in the model's ``named_parameters()``
order (the stages' orders one after another, each MoE layer's experts in global
order), with the master param group and storage its saved entries had.

Rebuilt for Megatron's GPT layout: one model chunk per rank (no virtual
pipeline), layers on a prepended axis split evenly over the pipeline stages,
experts on a second prepended axis named ``local_experts.<j>`` or
``weight<j>`` / ``bias<j>`` (grouped GEMM). Anything else is refused with what
to do instead (resume at the new layout directly: the load reshards).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from miles_plugins.optimizers.checkpoint.reshard_peers import Peer
from miles_plugins.optimizers.errors import CheckpointMismatchError

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_EXPERT = (re.compile(r"\.local_experts\.(\d+)\."), re.compile(r"(?:weight|bias)(\d+)$"))
_DIRECTLY = "resume at the new layout directly (the load reshards)"


@dataclass(frozen=True)
class ModelParam:
    """One param of the model, at any layout: its saved name (with the saving rank's
    local layer and expert indices), facts and place."""

    name: str
    facts: dict
    layer: int | None  # its global layer; None outside the decoder layers
    expert: int | None  # its global expert; None for a param of no expert
    fp32: bool
    group: int

    @property
    def parts(self) -> list[dict]:
        return self.facts["parts"]

    @property
    def pipeline_copy(self) -> int:
        """1 for the copy the last stage keeps of a tied embedding, else 0."""
        return (self.parts[0].get("replica_id") or [0])[0]

    def renamed(self, layer: int | None, expert: int | None) -> str:
        """Its name with ``layer`` and ``expert`` as the local indices."""
        name = self.name
        if layer is not None:
            name = _LAYER.sub(f".layers.{layer}.", name, count=1)
        if expert is not None:
            pattern = next(p for p in _EXPERT if p.search(name))
            name = pattern.sub(lambda m: m.group(0).replace(m.group(1), str(expert)), name, count=1)
        return name


@dataclass(frozen=True)
class SavedModel:
    """The model's params in ``named_parameters()`` order; its layer and expert counts."""

    params: list[ModelParam]
    layers: int
    experts: int


def saved_model(peers: Sequence[Peer]) -> SavedModel:
    """The model ``peers`` (every saved store of one checkpoint) were saved from."""
    topology = peers[0].data["topology"]
    pp, ep = topology["pp_size"], topology["ep_size"]
    by_rank: dict[tuple[int, int], dict[str, dict]] = {}  # (pp rank, ep rank) -> name -> facts
    roles: dict[tuple[int, int, str], tuple[bool, int]] = {}  # (pp, ep, name) -> (fp32, group)
    for peer in peers:
        t = peer.data["topology"]
        where = (t["pp_rank"], t["ep_rank"])
        if t.get("tp_rank") == 0 and (t["shard_peers"].get("expert_tp_rank", 0) == 0):
            by_rank.setdefault(where, {}).update(peer.data["param_facts"]["params"])
        roles.update({(*where, name): role for name, role in _roles(peer.data).items()})
    missing = [(s, e) for s in range(pp) for e in range(ep) if (s, e) not in by_rank]
    if missing:
        raise CheckpointMismatchError(
            f"no saved store of TP rank 0 at (PP rank, EP rank) {missing[:4]}: a store is missing"
        )
    layers, experts = _counts(by_rank)
    ordered = []
    for stage in range(pp):
        columns = [sorted(by_rank[stage, e].items(), key=lambda item: item[1]["position"]) for e in range(ep)]
        for e, name, facts in _stage_order(columns):
            # A param of no expert is the same at every EP rank: its entries may be in any of them.
            held = [
                roles[stage, x, name] for x in ([e] if facts.get("expert") else range(ep)) if (stage, x, name) in roles
            ]
            if not held:
                raise CheckpointMismatchError(f"{name} is in no saved store's entries: a saved rank's store is missing")
            ordered.append(_param(name, facts, stage, e, pp, ep, layers, experts, *held[0]))
    return SavedModel(ordered, layers, experts)


def _roles(data: dict) -> dict[str, tuple[bool, int]]:
    """Per param a store holds entries of: whether it is an fp32 param (its moments
    resident, or in a bucket without mains), and its master param group."""
    out = {}
    for bucket, pieces in zip(data["layout"], data["pieces"], strict=True):
        out.update({name: (bucket.get("main") is False, group) for name, _, group in pieces})
    out.update({name: (True, group) for name, _, group in data.get("resident_pieces") or []})
    return out


def _counts(by_rank: dict) -> tuple[int, int]:
    """The decoder's layer count and the MoE layers' expert count (0 without experts)."""
    layers = experts = 0
    for params in by_rank.values():
        for facts in params.values():
            part = facts["parts"][0]
            if part["prepend_axis_num"] >= 1:
                layers = max(layers, part["global_shape"][0])
            if facts.get("expert") and part["prepend_axis_num"] == 2:
                experts = max(experts, part["global_shape"][1])
    return layers, experts


def _stage_order(columns: list[list[tuple[str, dict]]]) -> list[tuple[int, str, dict]]:
    """One stage's params in model order from each EP rank's list (same structure):
    a param of no expert once, each run of expert params once per EP rank, in turn."""
    out, i, first = [], 0, columns[0]
    if any(len(c) != len(first) for c in columns):
        raise CheckpointMismatchError(f"the EP ranks of one stage hold different numbers of params: {_DIRECTLY}")
    while i < len(first):
        if not first[i][1].get("expert"):
            out.append((0, *first[i]))
            i += 1
            continue
        j = i
        while j < len(first) and first[j][1].get("expert"):
            j += 1
        for e, column in enumerate(columns):
            out += [(e, name, facts) for name, facts in column[i:j]]
        i = j
    return out


def _param(
    name: str,
    facts: dict,
    stage: int,
    ep_rank: int,
    pp: int,
    ep: int,
    layers: int,
    experts: int,
    fp32: bool,
    group: int,
) -> ModelParam:
    """One saved param as a :class:`ModelParam`, its name checked against its cell."""
    if not name.startswith("0/"):
        raise CheckpointMismatchError(f"{name} is in a model chunk after the first (virtual pipeline): {_DIRECTLY}")
    part = facts["parts"][0]
    cell = part["global_offset"][: part["prepend_axis_num"]]
    layer = expert = None
    if cell:
        local = _LAYER.search(name)
        layer = cell[0]
        if local is None or layers % pp or layer - int(local.group(1)) != stage * (layers // pp):
            raise CheckpointMismatchError(
                f"{name} (global layer {layer}) is not in an even split of {layers} layers over {pp} stages: {_DIRECTLY}"
            )
    if facts.get("expert"):
        local = next((m for p in _EXPERT if (m := p.search(name))), None)
        expert = cell[1] if len(cell) == 2 else None
        if expert is None or local is None or experts % ep or expert - int(local.group(1)) != ep_rank * (experts // ep):
            raise CheckpointMismatchError(
                f"{name}: an expert param laid out as the offline reshard does not know: {_DIRECTLY}"
            )
    return ModelParam(name, facts, layer, expert, fp32, group)
