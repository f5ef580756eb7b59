"""The parallel layout a ``DistributedOptimizer``'s state belongs to, as a checkpoint records it."""

from __future__ import annotations

from typing import Any

import torch


def topology(dist_opt: Any) -> dict:
    """Parallel sizes and this rank's coordinates: a checkpoint loads only into the
    same, except where ``shard_peers`` names the saves a load at another
    data-parallel size may read (``checkpoint/reshard_load.py``)."""
    from megatron.core import parallel_state as mpu

    # The expert optimizer's params are split by expert-TP and EP rank; the dense
    # ones are replicated across EP ranks (they shard over the whole DP group).
    expert = any(
        not getattr(p, "allreduce", True)
        for group in dist_opt.model_float16_groups + dist_opt.model_fp32_groups
        for p in group
    )
    if expert:
        peers = {
            "expert_tp_size": mpu.get_expert_tensor_parallel_world_size(),
            "expert_tp_rank": mpu.get_expert_tensor_parallel_rank(),
            "ep_size": mpu.get_expert_model_parallel_world_size(),
            "ep_rank": mpu.get_expert_model_parallel_rank(),
        }
    else:
        peers = {
            "tp_size": mpu.get_tensor_model_parallel_world_size(),
            "tp_rank": mpu.get_tensor_model_parallel_rank(),
            "ep_size": mpu.get_expert_model_parallel_world_size(),
        }
    peers.update(
        pp_size=mpu.get_pipeline_model_parallel_world_size(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        # Each distributed-optimizer instance holds a whole copy of the state.
        optimizer_instance=dist_opt.distributed_optimizer_instance_id,
    )
    return {
        "shard_peers": peers,
        "world_size": torch.distributed.get_world_size(),
        "tp_size": mpu.get_tensor_model_parallel_world_size(),
        "tp_rank": mpu.get_tensor_model_parallel_rank(),
        "pp_size": mpu.get_pipeline_model_parallel_world_size(),
        "pp_rank": mpu.get_pipeline_model_parallel_rank(),
        "ep_size": mpu.get_expert_model_parallel_world_size(),
        "ep_rank": mpu.get_expert_model_parallel_rank(),
        "dp_size": dist_opt.data_parallel_group.size(),
        "dp_rank": dist_opt.data_parallel_group.rank(),
        "optimizer_instance": dist_opt.distributed_optimizer_instance_id,
    }
