"""Where each param of a rank's model sits in the tensors Megatron checkpoints, at any layout.

Megatron's ``sharded_state_dict`` names every param by a key that no TP, PP or EP
size changes (no local layer or expert index) and places it in that key's global
tensor: a box of ``local_shape`` at ``global_offset`` in ``global_shape``, after
``prepend_axis_num`` axes of size one (layers, experts); ``replica_id`` says
which copy is the primary one. A gated fc1 (SwiGLU) is a factory of two such
boxes, each a contiguous half of the param. :func:`param_facts` records those
facts per param (``name`` as the binding names it), with each part's element
offset inside the local param, the axis the tensor-parallel group splits (also
at TP 1, from the param's own attributes), and the param's position in its
chunk: what a load at another TP, PP or EP size needs to find the saved
elements each of its ranges holds (``checkpoint/reshard_boxes.py``), and an
offline reshard to rebuild another layout's params.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The sharded_state_dict metadata the facts are taken with: Megatron's training defaults
# (megatron.training.checkpointing._build_sharded_state_dict_metadata), recorded with them.
METADATA_FLAGS = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


class NoFacts(Exception):
    """A param of the model has no place in Megatron's sharded state dict."""


def param_facts(model_chunks: list, names: dict[torch.nn.Parameter, str]) -> dict | None:
    """``{"metadata": METADATA_FLAGS, "params": {name: facts}}`` for every param of
    ``names``; None, with a warning, where Megatron's sharded state dict does not
    place every one of them (such a save still loads at its own TP, PP and EP sizes).
    ``facts``: ``{"parts": [part], "tp_axis": axis of the global shape or None,
    "position": index in its chunk's named_parameters(), "expert": bool,
    "shared_embedding": bool}`` (:func:`_roles`), a part holding key,
    start (element offset in the local param), local_shape, global_shape,
    global_offset, prepend_axis_num, replica_id and allow_shape_mismatch."""
    try:
        by_param = _sharded_tensors(model_chunks)
        positions = {p: k for chunk in model_chunks for k, (_, p) in enumerate(chunk.named_parameters())}
        experts = _expert_params(model_chunks)
        return {
            "metadata": dict(METADATA_FLAGS),
            "params": {
                name: {**_facts(p, name, by_param, positions[p]), **_roles(p, experts)} for p, name in names.items()
            },
        }
    except Exception as exc:  # the facts are for resharding only: streaming goes on without them
        why = (
            str(exc)
            if isinstance(exc, NoFacts)
            else f"the model's sharded_state_dict failed ({type(exc).__name__}: {exc})"
        )
        logger.warning(
            "this run's streamed optimizer state will load only at its own TP, PP and EP sizes (any DP size): %s",
            why.splitlines()[0] if why else type(exc).__name__,
        )
        return None


def _expert_params(model_chunks: list) -> set[int]:
    """``id`` of every param of a MoE layer's experts (expert parallel at EP > 1)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return {
        id(p)
        for chunk in model_chunks
        for module in chunk.modules()
        if isinstance(module, MoELayer) and module.experts is not None
        for p in module.experts.parameters()
    }


def _roles(param: torch.nn.Parameter, experts: set[int]) -> dict:
    """What an offline reshard needs to place ``param`` at another layout: whether it
    is an expert's (its optimizer at EP > 1 is the expert one), and whether Megatron
    shares it between the first and last pipeline stage (its DDP bucket is its own)."""
    return {"expert": id(param) in experts, "shared_embedding": bool(getattr(param, "shared_embedding", False))}


def _sharded_tensors(model_chunks: list) -> dict[int, Any]:
    """The model's ShardedTensor or ShardedTensorFactory of each param, by ``id`` of the param."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.utils import unwrap_model

    metadata = {**METADATA_FLAGS, "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
    by_param = {}
    for chunk in model_chunks:
        for sharded in nested_values(unwrap_model(chunk).sharded_state_dict(metadata=metadata)):
            if isinstance(sharded, (ShardedTensor, ShardedTensorFactory)):
                by_param[id(sharded.data)] = sharded
    return by_param


def _facts(param: torch.nn.Parameter, name: str, by_param: dict[int, Any], position: int) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    sharded = by_param.get(id(param))
    if sharded is None:
        raise NoFacts(f"{name} is in no ShardedTensor of the model's sharded_state_dict")
    parts = list(nested_values(sharded.build())) if isinstance(sharded, ShardedTensorFactory) else [sharded]
    described = [_part(part, param, name) for part in parts]
    return {"parts": described, "tp_axis": _tp_axis(param, described[0]), "position": position}


def _part(part: Any, param: torch.nn.Parameter, name: str) -> dict:
    """One ShardedTensor of ``param`` as JSON; its data must be a contiguous range of the param."""
    start = part.data.storage_offset() - param.storage_offset()
    numel = part.data.numel()
    if getattr(part, "flattened_range", None) is not None or not part.data.is_contiguous():
        raise NoFacts(f"a part of {name} ({part.key}) is not a contiguous view of the param")
    if start < 0 or start + numel > param.numel() or numel != _volume(part.local_shape):
        raise NoFacts(f"a part of {name} ({part.key}) lies outside the param")
    return {
        "key": part.key,
        "start": start,
        "local_shape": list(part.local_shape),
        "global_shape": list(part.global_shape),
        "global_offset": list(part.global_offset),
        "prepend_axis_num": part.prepend_axis_num,
        "replica_id": list(part.replica_id) if isinstance(part.replica_id, tuple) else [part.replica_id],
        "allow_shape_mismatch": bool(part.allow_shape_mismatch),
    }


def _tp_axis(param: torch.nn.Parameter, part: dict) -> int | None:
    """The axis of the global shape the tensor-parallel group splits: the param's
    ``partition_dim`` (set at any TP size) past the prepended axes; None when
    every TP rank holds all of it."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return int(param.partition_dim) + part["prepend_axis_num"]


def _volume(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
