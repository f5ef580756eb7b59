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
:func:`backend_for` picks one by the master's type. The TE and apex FusedAdam
backends plug in beside :class:`TorchAdamBackend` with the Megatron binding.
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

    @staticmethod
    def _options_for_constructor(master: torch.optim.Optimizer) -> dict:
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


BACKENDS: tuple[type[AdamBackend], ...] = (TorchAdamBackend,)


def backend_for(master: torch.optim.Optimizer) -> AdamBackend:
    """The backend for ``master``'s exact type; refuses any other optimizer."""
    for backend in BACKENDS:
        if type(master) in backend.master_types:
            return backend(master)
    supported = ", ".join(f"{t.__module__}.{t.__qualname__}" for b in BACKENDS for t in b.master_types)
    raise StreamConfigError(
        f"cannot stream the state of {type(master).__module__}.{type(master).__qualname__}: "
        f"the per-bucket step must reproduce its exact math, which is known for {supported}"
    )
