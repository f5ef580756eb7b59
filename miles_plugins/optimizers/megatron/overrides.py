"""The methods the binding puts on one ``DistributedOptimizer`` instance (never its class:
two optimizers in one process may differ). Each is bound to the optimizer, finds its
:class:`~miles_plugins.optimizers.megatron.binding.MegatronBinding` under
``megatron_hooks.contract.STORE_ATTR``, and calls upstream's own method where it
still runs (kept in ``binding.upstream``). What each one does and why: the module
docstring of ``binding.py``.
"""

from __future__ import annotations

import types
from typing import Any

from megatron_hooks.contract import STORE_ATTR
from miles_plugins.optimizers.megatron.chain import type_name
from miles_plugins.optimizers.megatron.state_dict import (
    load_streamed_state_dict,
    streamed_sharded_state_dict,
    streamed_state_dict,
)

# Upstream methods the overrides below call.
WRAPPED = ("prepare_grads", "zero_grad", "step_with_ready_grads")


def _binding(opt: Any):
    return getattr(opt, STORE_ATTR)


def prepare_grads(opt: Any) -> bool:
    found_inf = _binding(opt).upstream["prepare_grads"]()
    # Unless the step is about to be skipped (inf/nan grads), start reading its
    # first buckets: the reads overlap the grad-norm reduction and clipping.
    if not found_inf:
        _binding(opt).store.prefetch()
    return found_inf


def zero_grad(opt: Any, *args, **kwargs) -> None:
    # A new iteration: reads prefetched for a step that never ran (another
    # optimizer in the chain found inf/nan) must not stay on the device.
    _binding(opt).store.drop_prefetch()
    return _binding(opt).upstream["zero_grad"](*args, **kwargs)


def step_with_ready_grads(opt: Any) -> bool:
    store = _binding(opt).store
    before = store.steps_taken
    # Upstream's method: the inner step (now the streamed step, which also
    # copies mains into the param buffer), then the param all-gather tail.
    result = _binding(opt).upstream["step_with_ready_grads"]()
    if store.steps_taken != before + 1:
        raise RuntimeError(
            f"{type_name(opt)}.step_with_ready_grads ran the streamed step "
            f"{store.steps_taken - before} times instead of once: upstream's step no longer "
            "calls self.optimizer.step() exactly once; recheck the binding against this Megatron"
        )
    return result


def copy_main_params_to_model_params(opt: Any) -> None:
    # Each bucket's mains were copied into the param buffer as the bucket
    # finished its streamed step; outside a step the buffer already holds them.
    return None


def reload_model_params(opt: Any, state_dict: dict | None = None) -> None:
    _binding(opt).reload_mains(state_dict)


def state_dict(opt: Any) -> dict:
    return streamed_state_dict(opt, _binding(opt).store.steps_taken)


def load_state_dict(opt: Any, state_dict: dict) -> None:
    _binding(opt).arm_load(load_streamed_state_dict(opt, state_dict))


def sharded_state_dict(opt: Any, *args, **kwargs) -> dict:
    # Same dict whether saving or loading (upstream's signature varies by commit).
    return streamed_sharded_state_dict(opt, _binding(opt).store.steps_taken)


def parameter_state_file(opt: Any, filename: str, **kwargs) -> None:
    # The legacy format's per-rank state file would read evicted storage; the
    # streamed state is saved and loaded by the checkpoint hooks instead.
    return None


def offload_to_cpu(opt: Any) -> None:
    # Upstream moves every main and moment off the GPU (RL phases); the streamed
    # state is there already and its mains have no storage, except the buckets
    # kept on the GPU by its budget.
    _binding(opt).store.offload_device_home()


def restore_from_cpu(opt: Any) -> None:
    _binding(opt).store.restore_device_home()


OVERRIDES = {
    "prepare_grads": prepare_grads,
    "zero_grad": zero_grad,
    "step_with_ready_grads": step_with_ready_grads,
    "_copy_main_params_to_model_params": copy_main_params_to_model_params,
    "reload_model_params": reload_model_params,
    "state_dict": state_dict,
    "load_state_dict": load_state_dict,
    "sharded_state_dict": sharded_state_dict,
    "save_parameter_state": parameter_state_file,
    "load_parameter_state": parameter_state_file,
    "offload_to_cpu": offload_to_cpu,
    "restore_from_cpu": restore_from_cpu,
}


def install(opt: Any, binding) -> dict:
    """Put every override on ``opt`` (this instance only) and ``binding`` under
    ``STORE_ATTR``; returns upstream's methods the overrides call."""
    upstream = {name: getattr(opt, name) for name in WRAPPED}
    for name, fn in OVERRIDES.items():
        setattr(opt, name, types.MethodType(fn, opt))
    setattr(opt, STORE_ATTR, binding)
    return upstream
