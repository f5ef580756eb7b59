"""The per-bucket Adam step: exactly the master optimizer's math on a subset of its params.

The store never steps the master optimizer. For every bucket it builds a
*bucket optimizer*: the master's own class, constructed with the master's
options, over that bucket's fp32 mains, with one param group per master group
the bucket touches. Before each step the bucket optimizer's groups take the
master groups' current options (learning rate and weight decay as a scheduler
left them, betas, eps, ...). Each bucket optimizer steps exactly once per
optimizer step, so whatever step counter the class keeps (per param for
torch, per group for the fused Adams) advances once per optimizer step.

Backends differ in where that counter lives and how the class is constructed;
:func:`backend_for` picks one by the master's exact type.
``megatron.core.optimizer.Adam`` is Transformer Engine's FusedAdam, apex's
FusedAdam or ``torch.optim.AdamW``, depending on what is installed: all three
have a backend here.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from miles_plugins.optimizers.config import StreamConfigError


class BucketOptimizer:
    """One bucket's optimizer and the master groups its groups mirror."""

    def __init__(self, backend: AdamBackend, optimizer: torch.optim.Optimizer, group_indices: list[int]) -> None:
        self.backend = backend
        self.optimizer = optimizer
        self.group_indices = group_indices

    def step(self) -> None:
        self.backend.sync_options(self)
        self.optimizer.step()

    def moments(self, main: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (exp_avg, exp_avg_sq) of ``main``, or None before its first update."""
        state = self.optimizer.state.get(main)
        if not state:
            return None
        return state["exp_avg"], state["exp_avg_sq"]

    # ---- the small state a checkpoint carries beside the moment bytes ----------

    def export_state(self) -> dict:
        """Everything but the moment bytes, as JSON: the per-group step state and,
        per param, None (no update yet) or its scalar entries (torch's ``step``)."""
        groups, params = [], []
        for group in self.optimizer.param_groups:
            groups.append({k: group[k] for k in sorted(self.backend.group_state_keys) if k in group})
            params.append([_export_param_state(self.optimizer.state.get(p), p) for p in group["params"]])
        return {"groups": groups, "params": params}

    def import_state(self, saved: dict, materialize: bool) -> None:
        """Restore :meth:`export_state`'s output. Moments are recreated as fp32
        tensors of each main's shape, zero-filled when ``materialize`` (the caller
        then reads their bytes), with their storage released otherwise."""
        if len(saved["groups"]) != len(self.optimizer.param_groups):
            raise ValueError(f"{len(saved['groups'])} saved param groups, {len(self.optimizer.param_groups)} live")
        for group, saved_group, saved_params in zip(
            self.optimizer.param_groups, saved["groups"], saved["params"], strict=True
        ):
            if len(saved_params) != len(group["params"]):
                raise ValueError(f"{len(saved_params)} saved params in a group of {len(group['params'])}")
            group.update(saved_group)
            for p, scalars in zip(group["params"], saved_params, strict=True):
                if scalars is None:
                    self.optimizer.state.pop(p, None)
                    continue
                state = {k: _import_scalar(v, p) for k, v in scalars.items()}
                for name in ("exp_avg", "exp_avg_sq"):
                    moment = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                    if not materialize:
                        moment.untyped_storage().resize_(0)
                    state[name] = moment
                self.optimizer.state[p] = state


_MOMENT_KEYS = frozenset({"exp_avg", "exp_avg_sq"})


def _export_param_state(state: dict | None, param: torch.Tensor) -> dict | None:
    if not state:
        return None
    out = {}
    for key, value in state.items():
        if key in _MOMENT_KEYS:
            continue
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise StreamConfigError(
                    f"optimizer state {key!r} is a tensor of {value.numel()} elements, not a scalar"
                )
            # Where torch keeps the step (CPU, or the param's device for fused and
            # capturable steps) is part of the state: restored exactly as it was.
            on_param_device = value.device == param.device and value.device.type != "cpu"
            out[key] = {"value": value.item(), "dtype": str(value.dtype), "on_param_device": on_param_device}
        elif isinstance(value, (int, float, bool)):
            out[key] = value
        else:
            raise StreamConfigError(f"optimizer state {key!r} of type {type(value).__name__} cannot be checkpointed")
    return out


def _import_scalar(value, param: torch.Tensor):
    if not isinstance(value, dict):
        return value
    dtype = getattr(torch, value["dtype"].removeprefix("torch."))
    device = param.device if value["on_param_device"] else "cpu"
    return torch.tensor(value["value"], dtype=dtype, device=device)


class AdamBackend:
    """Builds bucket optimizers that reproduce one master optimizer's update.

    Subclasses name the master types they serve and the group keys that are
    per-bucket state rather than options (never copied from the master).
    """

    master_types: tuple[type, ...] = ()
    group_state_keys: frozenset[str] = frozenset()

    def __init__(self, master: torch.optim.Optimizer) -> None:
        self.master = master
        self._constructor_kwargs = self._options_for_constructor(master)

    @classmethod
    def serves(cls, master: torch.optim.Optimizer) -> bool:
        return type(master) in cls.master_types

    @classmethod
    def describe(cls) -> list[str]:
        return [f"{t.__module__}.{t.__qualname__}" for t in cls.master_types]

    def _options_for_constructor(self, master: torch.optim.Optimizer) -> dict:
        accepted = inspect.signature(type(master).__init__).parameters
        return {k: v for k, v in master.defaults.items() if k in accepted and k != "params"}

    def build(self, groups: Sequence[tuple[int, list[torch.Tensor]]]) -> BucketOptimizer:
        """A bucket optimizer over ``groups``: (master group index, mains) pairs."""
        param_groups = [{"params": mains} for _, mains in groups]
        optimizer = type(self.master)(param_groups, **self._constructor_kwargs)
        bucket = BucketOptimizer(self, optimizer, [index for index, _ in groups])
        self.sync_options(bucket)
        return bucket

    def sync_options(self, bucket: BucketOptimizer) -> None:
        """Give the bucket's groups the master groups' current options."""
        for group, index in zip(bucket.optimizer.param_groups, bucket.group_indices, strict=True):
            for key, value in self.master.param_groups[index].items():
                if key != "params" and key not in self.group_state_keys:
                    group[key] = value


class TorchAdamBackend(AdamBackend):
    """``torch.optim.Adam`` and ``torch.optim.AdamW``: the step count is per param state."""

    master_types = (torch.optim.Adam, torch.optim.AdamW)

    def __init__(self, master: torch.optim.Optimizer) -> None:
        for index, group in enumerate(master.param_groups):
            if group.get("amsgrad"):
                raise StreamConfigError(
                    f"param group {index} uses amsgrad: streaming stores two moments per "
                    "param, amsgrad needs a third (max_exp_avg_sq); turn amsgrad off"
                )
        super().__init__(master)


# FusedAdam classes, named by (module, qualname) so that matching a master never
# imports Transformer Engine or apex (importing either can fail or take seconds).
FUSED_ADAM_CLASSES = frozenset(
    {
        ("transformer_engine.pytorch.optimizers.fused_adam", "FusedAdam"),
        ("apex.optimizers.fused_adam", "FusedAdam"),
    }
)

# FusedAdam attributes that change what the state is (fp32 master weights held by
# the optimizer, decoupled grads, narrow or remainder-coded state) or where the
# step counter lives (capturable): Megatron sets them only for the precision-aware
# optimizer or CUDA-graphed steps, neither of which can be streamed.
_FUSED_ADAM_REFUSED = (
    ("capturable", "a capturable (CUDA-graphed) step keeps lr and the step count as device tensors"),
    ("master_weights", "the optimizer holds its own fp32 master weights (precision-aware optimizer)"),
    ("use_master", "the optimizer holds its own fp32 master weights"),
    ("use_decoupled_grad", "grads come from .decoupled_grad (precision-aware optimizer)"),
    ("store_param_remainders", "the optimizer stores master-weight remainders itself"),
)


class FusedAdamBackend(AdamBackend):
    """Transformer Engine's and apex's ``FusedAdam``.

    Both keep the step count per param *group* (``group["step"]``, advanced once
    per ``step()`` for every non-empty group), so it is bucket state, never copied
    from the master. AdamW vs Adam is the ``adam_w_mode`` constructor argument,
    which the class keeps as an attribute (not in ``defaults``): it is passed on.
    """

    group_state_keys = frozenset({"step"})

    @classmethod
    def serves(cls, master: torch.optim.Optimizer) -> bool:
        return (type(master).__module__, type(master).__qualname__) in FUSED_ADAM_CLASSES

    @classmethod
    def describe(cls) -> list[str]:
        return [f"{module}.{name}" for module, name in sorted(FUSED_ADAM_CLASSES)]

    def __init__(self, master: torch.optim.Optimizer) -> None:
        name = f"{type(master).__module__}.{type(master).__qualname__}"
        for attr, why in _FUSED_ADAM_REFUSED:
            if getattr(master, attr, False):
                raise StreamConfigError(f"{name} has {attr} set: {why}; streaming needs plain fp32 Adam state")
        for attr in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            dtype = getattr(master, attr, torch.float32)
            if dtype != torch.float32:
                raise StreamConfigError(
                    f"{name} keeps {attr}={dtype}: streaming stores the state in its own format "
                    "(--stream-optimizer-state-moment-dtype); build the optimizer with fp32 state"
                )
        super().__init__(master)

    def _options_for_constructor(self, master: torch.optim.Optimizer) -> dict:
        return {**super()._options_for_constructor(master), "adam_w_mode": bool(master.adam_w_mode)}


BACKENDS: tuple[type[AdamBackend], ...] = (TorchAdamBackend, FusedAdamBackend)


def backend_for(master: torch.optim.Optimizer) -> AdamBackend:
    """The backend for ``master``'s exact type; refuses any other optimizer."""
    for backend in BACKENDS:
        if backend.serves(master):
            return backend(master)
    supported = ", ".join(name for b in BACKENDS for name in b.describe())
    raise StreamConfigError(
        f"cannot stream the state of {type(master).__module__}.{type(master).__qualname__}: "
        f"the per-bucket step must reproduce its exact math, which is known for {supported}"
    )
