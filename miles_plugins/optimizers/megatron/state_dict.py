"""What a streamed ``DistributedOptimizer``'s state dicts hold: the param-group options,
the grad scaler and a marker with the step count, never the evicted mains or moments
(those bytes travel through the store's ``save_to`` / ``load_from``, called by the
checkpoint hooks in the patched ``megatron/training/checkpointing.py``)."""

from __future__ import annotations

from typing import Any

from miles_plugins.optimizers.errors import CheckpointMismatchError

# Marks a state dict written by a streamed optimizer: it holds param-group options
# and the grad scaler only; the param state is in the store's files.
STREAMED_STATE_KEY = "streamed_optimizer_state"
# The marker's format, under its "hook_abi_version" key (the hooks' ABI when it was
# made; it stays 1 while the marker means what it does, whatever the hooks' ABI).
MARKER_VERSION = 1


def streamed_state_dict(dist_opt: Any, steps_taken: int) -> dict:
    """The optimizer's state dict: its group options, grad scaler and the marker."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in dist_opt.optimizer.param_groups]
    # The marker sits inside "optimizer", the one object upstream's state dicts
    # also carry: loading a checkpoint written without streaming then reaches
    # load_streamed_state_dict's refusal instead of a missing-key error from the loader.
    state = {
        "optimizer": {
            "param_groups": groups,
            STREAMED_STATE_KEY: {"hook_abi_version": MARKER_VERSION, "steps_taken": steps_taken},
        }
    }
    if dist_opt.grad_scaler:
        state["grad_scaler"] = dist_opt.grad_scaler.state_dict()
    return state


def load_streamed_state_dict(dist_opt: Any, state_dict: dict) -> dict:
    """Restore the group options and grad scaler of :func:`streamed_state_dict`'s
    output; returns its marker (the step count the streamed state must have). A
    checkpoint written without streaming, or by another hook ABI, is refused."""
    marker = (state_dict.get("optimizer") or {}).get(STREAMED_STATE_KEY)
    if marker is None:
        raise CheckpointMismatchError(
            "this checkpoint's optimizer state was written without optimizer-state streaming: loading it "
            "here would restart Adam from zero behind your back. Resume it without streaming, or load "
            "with --no-load-optim to start the optimizer fresh from the loaded params"
        )
    if marker.get("hook_abi_version") != MARKER_VERSION:
        raise CheckpointMismatchError(
            f"this checkpoint's streamed optimizer state was written with hook ABI "
            f"{marker.get('hook_abi_version')}, this version reads {MARKER_VERSION}"
        )
    groups = dist_opt.optimizer.param_groups
    saved_groups = state_dict["optimizer"]["param_groups"]
    if len(saved_groups) != len(groups):
        raise CheckpointMismatchError(
            f"the checkpoint has {len(saved_groups)} optimizer param groups, this optimizer {len(groups)}"
        )
    for group, saved in zip(groups, saved_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    if dist_opt.grad_scaler and "grad_scaler" in state_dict:
        dist_opt.grad_scaler.load_state_dict(state_dict["grad_scaler"])
    return dict(marker)


def streamed_sharded_state_dict(dist_opt: Any, steps_taken: int) -> dict:
    """:func:`streamed_state_dict` as Megatron's distributed checkpoints take it."""
    # The same wrapping upstream gives its non-reshardable formats' common state
    # (DistributedOptimizer.sharded_state_dict at core_v0.19.0): one object per
    # data-parallel group, replicated over this instance's DP ranks.
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {
        k: ShardedObject(
            f"optimizer.distributed.dp_group_idx_{dist_opt.data_parallel_group_idx}.{k}",
            v,
            (1,),
            (0,),
            replica_id=(dist_opt.distributed_optimizer_instance_id, 0, dist_opt.data_parallel_group.rank()),
        )
        for k, v in streamed_state_dict(dist_opt, steps_taken).items()
    }
