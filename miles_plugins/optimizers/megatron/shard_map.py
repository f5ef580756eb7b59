"""Where each fp32 main shard of a ``DistributedOptimizer`` sits in Megatron's buffers.

:class:`ShardMap` reads Megatron's range maps (pinned in ``pins.py``: the tripwire
refuses a Megatron whose functions drifted) and gives the store its entries, and
the binding the place in the DDP param buffer each updated main is copied into.
:func:`param_layout` records the DDP buckets' contents for offline resharding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from miles_plugins.optimizers.errors import StreamConfigError
from miles_plugins.optimizers.step.entries import Entry


@dataclasses.dataclass
class MegatronEntry(Entry):
    """An :class:`Entry` that also knows its (unsharded) model param, the key of
    every Megatron range map."""

    model_param: torch.nn.Parameter | None = None


class ShardMap:
    """The fp32 main shards of ``dist_opt`` and their places in its buffers.

    ``names``: each model param's identity across DP sizes (its model chunk and
    name: the same at any DP size for the same TP, PP and EP).
    """

    def __init__(self, dist_opt: Any, names: dict[torch.nn.Parameter, str]) -> None:
        self.dist_opt, self.names = dist_opt, names

    def entries(self) -> list[MegatronEntry]:
        """One entry per main shard: the bf16/fp16 params' mains, then the fp32 params' own shards."""
        opt = self.dist_opt
        entries = []
        for group_index, (model_group, main_group) in enumerate(
            zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True)
        ):
            for model_param, main in zip(model_group, main_group, strict=True):
                entries.append(self._entry(model_param, self.model_shard(model_param), main, group_index))
        for group_index, (model_group, shard_group) in enumerate(
            zip(opt.model_fp32_groups, opt.shard_fp32_groups, strict=True)
        ):
            for model_param, shard in zip(model_group, shard_group, strict=True):
                # An fp32 param is its own main: the shard the optimizer updates must
                # alias the param buffer, or upstream's copy into the buffer (which
                # this binding skips for resident entries) would not be a no-op.
                if shard.data_ptr() != self.param_buffer_shard(model_param, shard.numel()).data_ptr():
                    raise StreamConfigError(
                        f"an fp32 param's main shard does not alias the DDP param buffer "
                        f"(shape {tuple(model_param.shape)}): this Megatron lays params out differently "
                        "than the binding was validated on"
                    )
                entries.append(self._entry(model_param, shard, shard, group_index))
        return entries

    def _entry(self, model_param, param: torch.Tensor, main: torch.Tensor, group_index: int) -> MegatronEntry:
        return MegatronEntry(
            param=param,
            main=main,
            group_index=group_index,
            bucket_key=self.ddp_bucket(model_param),
            name=self.names.get(model_param),
            start=self.param_range(model_param).start,
            model_param=model_param,
        )

    def ddp_bucket(self, model_param: torch.nn.Parameter) -> tuple[int, int]:
        """(param buffer index, bucket index) of ``model_param``."""
        gbuf_index, _, bucket_index = self.dist_opt.model_param_gbuf_map[model_param]
        return gbuf_index, bucket_index

    def param_range(self, model_param: torch.nn.Parameter):
        """The elements of ``model_param`` this rank's shard holds (Megatron's ``Range``)."""
        return self.dist_opt._get_model_param_range_map(model_param)["param"]

    def model_shard(self, model_param: torch.nn.Parameter, source: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shard of ``model_param`` (or of ``source``, a tensor of its shape)."""
        param_range = self.param_range(model_param)
        base = model_param if source is None else source
        return base.detach().view(-1)[param_range.start : param_range.end]

    def param_buffer_shard(self, model_param: torch.nn.Parameter, main_numel: int) -> torch.Tensor:
        """Where a main shard of ``main_numel`` elements goes in the DDP param buffer."""
        # Reproduces, from DistributedOptimizer._copy_main_params_to_model_params at
        # core_v0.19.0 (copy_group_params, non-fp8 branch), how a main shard finds
        # its place in the DDP param buffer. Recheck on drift: the range map keys
        # ("gbuf_world_in_bucket"), model_param_gbuf_map's tuple order, and
        # buffers[i].buckets[j].param_data.
        opt = self.dist_opt
        world_range = opt._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
        if world_range.size != main_numel:
            raise RuntimeError(
                f"a main shard has {main_numel} elements but its world range in the param buffer has "
                f"{world_range.size}: the DistributedOptimizer range maps are not what the binding expects"
            )
        gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
        model_param_buffer = opt.buffers[gbuf_index].buckets[bucket_id].param_data
        return model_param_buffer.view(-1)[world_range.start : world_range.end]

    def copy_main_to_param_buffer(self, entry: MegatronEntry) -> None:
        """After its update: an entry's main into the param buffer (an fp32 param's main is its place already)."""
        if not entry.resident:
            self.param_buffer_shard(entry.model_param, entry.main.numel()).copy_(entry.main)


def buffered_params(dist_opt: Any) -> list[torch.nn.Parameter]:
    """Every param ``dist_opt`` shards: those of its DDP buffers (of every DP rank's
    shard), or where the buffers do not list them, those it holds a range of."""
    if all(hasattr(buffer, "param_index_map") for buffer in dist_opt.buffers):
        return [p for buffer in dist_opt.buffers for p in buffer.param_index_map]
    return [p for group in dist_opt.model_float16_groups + dist_opt.model_fp32_groups for p in group]


def param_layout(dist_opt: Any, names: dict) -> dict | None:
    """Every param of each DDP bucket ``dist_opt`` shards, in the order the range maps
    list them ([name, start in the bucket, numel]), with the bucket's unpadded size
    and the padding rule: from it, ``ckpt reshard`` computes Megatron's sharding at
    another DP size (each bucket padded to a multiple of lcm(dp, 128[, 2**16]), cut
    into dp equal ranges). None where the buffers do not expose ``param_index_map``."""
    buckets = []
    for gbuf_index, buffer in enumerate(dist_opt.buffers):
        index_map = getattr(buffer, "param_index_map", None)
        if index_map is None:
            return None
        for bucket_index, bucket in enumerate(buffer.buckets):
            params = [
                [names.get(p), start - bucket.offset, end - start]
                for p, (start, end, b) in index_map.items()
                if b == bucket_index
            ]
            size = max((start + numel for _, start, numel in params), default=0)
            buckets.append({"key": [gbuf_index, bucket_index], "params": params, "size": size})
    ddp_config = getattr(dist_opt, "ddp_config", None)
    return {
        "buckets": buckets,
        "pad_for_high_nccl_busbw": bool(getattr(ddp_config, "pad_buckets_for_high_nccl_busbw", False)),
        # Megatron's default grows with DP above 40 (max(4e7, 1e6 * dp)): then another DP buckets differently.
        "ddp_bucket_size": getattr(ddp_config, "bucket_size", None),
    }
