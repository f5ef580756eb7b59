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

The bucket optimizer and the small state it keeps live in ``bucket_optimizer.py``;
:func:`bind_master` routes the master's own entry points to the streamed state.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence

import torch

from miles_plugins.optimizers.errors import StreamConfigError
from miles_plugins.optimizers.step.bucket_optimizer import BucketOptimizer, is_step_tensor


class AdamBackend:
    """Builds bucket optimizers that reproduce one master optimizer's update.

    Subclasses name the master types they serve and the group keys that are
    per-bucket state rather than options (never copied from the master).
    """

    master_types: tuple[type, ...] = ()
    group_state_keys: frozenset[str] = frozenset()

    @staticmethod
    def valid_param_state(scalars: object) -> bool:
        """Whether ``scalars`` (a param's saved state but its moments) is what the
        master's class keeps per param."""
        return scalars == {}

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

    @staticmethod
    def valid_param_state(scalars: object) -> bool:
        return isinstance(scalars, dict) and set(scalars) == {"step"} and is_step_tensor(scalars["step"])

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


_STREAMED_MARK = "_miles_streamed"


def is_streamed(master: torch.optim.Optimizer) -> bool:
    """Whether :func:`bind_master` already routed ``master`` to a streamed state."""
    return getattr(master, _STREAMED_MARK, False)


def bind_master(master: torch.optim.Optimizer, step: Callable[[], object], *, checkpoint_with: str) -> None:
    """Route ``master``'s own entry points to the streamed state, on this instance only.

    The master optimizer holds no state once its state streams: its ``step``
    becomes ``step()`` (the streamed step), and ``state_dict`` /
    ``load_state_dict`` refuse (they would claim a state without moments or
    mains). ``checkpoint_with`` tells the caller how to checkpoint instead.
    """

    def streamed_step(self: torch.optim.Optimizer, closure: None = None):
        if closure is not None:
            raise StreamConfigError("a streamed optimizer step takes no closure: compute the loss before step()")
        return step()

    def refuse_state_dict(self: torch.optim.Optimizer, *args, **kwargs):
        raise StreamConfigError(
            "this optimizer's state is streamed: its state_dict would hold none of the moments "
            f"or fp32 mains; checkpoint it with {checkpoint_with}"
        )

    # Bound as methods of the instance (not of the class): LR schedulers re-wrap
    # `step` through its __func__, which must take the optimizer as first argument.
    master.step = types.MethodType(streamed_step, master)
    setattr(master, _STREAMED_MARK, True)
    master.state_dict = types.MethodType(refuse_state_dict, master)
    master.load_state_dict = types.MethodType(refuse_state_dict, master)
