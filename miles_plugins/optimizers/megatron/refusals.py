"""What streaming cannot work with, and why: the one table.

``REFUSALS`` is checked on a launcher's parsed flags (:func:`refusals_of_args`,
called by ``args.validate_args`` and the launcher) and again on a built
``DistributedOptimizer`` (:func:`refusals_of_optimizer`, called by
``chain.check_supported``) for callers that never parsed flags. Fields a given
Megatron or miles lacks read as off, so the same table serves every version.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_hooks.contract import STORE_ATTR


@dataclass(frozen=True)
class Refusal:
    """One thing streaming cannot work with, and why.

    Checked on a launcher's parsed flags (``on_args``, named by ``flag``) and on a
    built ``DistributedOptimizer`` (``on_optimizer``, named by ``setting``),
    whichever of the two can see it. ``why`` is the same for both; the names may
    hold ``{optimizer!r}``-style fields (see ``_fields``).
    """

    why: str
    flag: str | None = None
    on_args: Callable[[argparse.Namespace], bool] | None = None
    setting: str | None = None
    on_optimizer: Callable[[Any], bool] | None = None


def _get(args: argparse.Namespace, name: str, default=None):
    return getattr(args, name, default)


def _flag(name: str) -> Callable[[argparse.Namespace], bool]:
    return lambda a: bool(_get(a, name, False))


def _setting(name: str, *where: str) -> Callable[[Any], bool]:
    """A predicate over a DistributedOptimizer: ``name`` is set in any of its
    ``where`` configs (fields some Megatron commits lack read as off)."""
    return lambda o: any(getattr(getattr(o, w), name, False) for w in where)


def _switch(name: str, why: str, *where: str, setting: str | None = None) -> Refusal:
    """A boolean setting streaming refuses: the flag ``--<name>`` on the flags, and
    ``name`` in the optimizer's ``where`` configs (none: seen on the flags only)."""
    return Refusal(
        why,
        flag=f"--{name.replace('_', '-')} is on",
        on_args=_flag(name),
        setting=(setting or f"{name} is on") if where else None,
        on_optimizer=_setting(name, *where) if where else None,
    )


def _is_not_adam(name: str | None) -> bool:
    return (name or "adam") != "adam"


_READS_EVICTED = "it reads optimizer tensors whose storage is evicted"

REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "streaming binds to Megatron's DistributedOptimizer, whose fp32 main shards it streams",
        flag="--use-distributed-optimizer is off",
        on_args=lambda a: not _get(a, "use_distributed_optimizer", False),
    ),
    Refusal(
        "the per-bucket step reproduces Adam's math only",
        flag="--optimizer is {optimizer!r}",
        on_args=lambda a: _is_not_adam(_get(a, "optimizer", "adam")),
        setting="the optimizer is {optimizer!r}",
        on_optimizer=lambda o: _is_not_adam(getattr(o.config, "optimizer", "adam")),
    ),
    _switch(
        "use_precision_aware_optimizer",
        "the optimizer then holds the mains itself; Megatron holds no fp32 mains to stream",
        "config",
    ),
    _switch(
        "optimizer_cpu_offload",
        "HybridDeviceOptimizer already keeps the state on the host, so it would be offloaded twice; "
        "use one or the other",
        "config",
    ),
    _switch(
        "offload_optimizer_states",
        "it moves the same state between phases, which streaming already keeps off the GPU",
        "config",
        "ddp_config",
    ),
    _switch("chunked_optimizer_state_offload", "it moves the same state; use one or the other", "config", "ddp_config"),
    _switch(
        "use_megatron_fsdp",
        "it owns the main weights and the optimizer state itself",
        "ddp_config",
        setting="Megatron FSDP is on",
    ),
    Refusal(
        "their mains are quantized into the param buffer by a separate path this binding does not reproduce",
        flag="fp8/fp4 params are on (--fp8-param-gather / --fp4-param-gather)",
        on_args=lambda a: _get(a, "fp8_param_gather", False) or _get(a, "fp4_param_gather", False),
        setting="fp8/fp4 params are on (fp8_param_gather / fp4_param_gather)",
        on_optimizer=lambda o: (
            _setting("fp8_param_gather", "ddp_config")(o) or _setting("fp4_param_gather", "ddp_config")(o)
        ),
    ),
    _switch(
        "reuse_grad_buf_for_mxfp8_param_ag",
        "mains are copied into the grad buffer outside the step, reading every main at once",
        "config",
    ),
    Refusal(
        "set streaming up once per optimizer: a second store would take the first one's released mains "
        "for its initial state",
        setting="this optimizer streams already",
        on_optimizer=lambda o: STORE_ATTR in vars(o),
    ),
    Refusal(
        "set streaming up right after get_megatron_optimizer(), or its resident moments stay allocated "
        "beside the stream",
        setting="the optimizer already holds state (it has stepped)",
        on_optimizer=lambda o: any(o.optimizer.state.values()),
    ),
    Refusal(
        "its checkpoint path bypasses the hooks that save the streamed state",
        flag="LoRA / multi-LoRA is on",
        on_args=lambda a: (
            (_get(a, "lora_rank", 0) or 0) > 0 or _get(a, "lora_adapter_path") or _get(a, "multi_lora", False)
        ),
    ),
    _switch(
        "reset_optimizer_states",
        "it resets the (evicted) in-memory state and would silently do nothing to the streamed state",
    ),
    _switch("save_local_weight_checksum", _READS_EVICTED),
    _switch("enable_witness", _READS_EVICTED),
    _switch(
        "log_params_norm", "it reads every param's fp32 main (param.main_param) at once, whose storage streaming evicts"
    ),
    Refusal(
        "local checkpoints bypass the directory the hooks save the streamed state into; use 'global'",
        flag="--non-persistent-ckpt-type is 'local'",
        on_args=lambda a: _get(a, "non_persistent_ckpt_type") == "local",
    ),
    _switch(
        "indep_dp",
        "rank numbering restarts per cell, so streaming directories of different processes would collide",
    ),
    Refusal(
        "the remainder rebuilds an fp32 main from its bf16 param; use fp32 main storage",
        flag="--stream-optimizer-state-main-storage is 'remainder' without --bf16",
        on_args=lambda a: _get(a, "stream_optimizer_state_main_storage") == "remainder" and not _get(a, "bf16", False),
    ),
    Refusal(
        "miles' training-actor disk offload takes it as one path; give one directory, or leave --offload-train off",
        flag="--offload-train-disk-dir names several directories with --offload-train on",
        on_args=lambda a: _get(a, "offload_train", False) and "," in (_get(a, "offload_train_disk_dir") or ""),
    ),
    Refusal(
        "with streaming, training offload must target disk (--offload-train-target disk)",
        flag="--offload-train targets {offload_train_target!r}",
        on_args=lambda a: _get(a, "offload_train", False) and _get(a, "offload_train_target") != "disk",
    ),
)


def _fields(source: Any, on_args: bool) -> dict[str, Any]:
    """The values refusal names may show."""
    if on_args:
        return {"optimizer": _get(source, "optimizer"), "offload_train_target": _get(source, "offload_train_target")}
    return {"optimizer": getattr(source.config, "optimizer", None), "offload_train_target": None}


def refusals_of_args(args: argparse.Namespace) -> list[str]:
    """Every refusal that applies to a launcher's flags, described."""
    fields = _fields(args, on_args=True)
    return [f"{r.flag.format(**fields)}: {r.why}" for r in REFUSALS if r.on_args is not None and r.on_args(args)]


def refusals_of_optimizer(dist_opt: Any) -> list[str]:
    """Every refusal that applies to a built DistributedOptimizer, described."""
    fields = _fields(dist_opt, on_args=False)
    return [
        f"{r.setting.format(**fields)}: {r.why}"
        for r in REFUSALS
        if r.on_optimizer is not None and r.on_optimizer(dist_opt)
    ]
