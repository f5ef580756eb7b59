"""One bucket's optimizer: the master's own class over the bucket's fp32 mains, and the
small state it keeps beside the moment bytes (step counts and other scalars).

The moment bytes are the store's (materialized, read and written bucket by
bucket); the small state stays here, in the optimizer. A step's roll-back takes
it back to a :meth:`BucketOptimizer.snapshot`; a checkpoint saves it as JSON
(:meth:`~BucketOptimizer.export_state`), and a load checks the saved form
against this optimizer before anything changes (:meth:`~BucketOptimizer.check_state`),
then imports it (:meth:`~BucketOptimizer.import_state`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from miles_plugins.optimizers.errors import StreamConfigError


class Backend(Protocol):
    """What a bucket optimizer asks of the backend that built it (``adam.AdamBackend``)."""

    group_state_keys: frozenset[str]

    def valid_param_state(self, scalars: object) -> bool: ...

    def sync_options(self, bucket: BucketOptimizer) -> None: ...


class BucketOptimizer:
    """One bucket's optimizer and the master groups its groups mirror."""

    def __init__(self, backend: Backend, optimizer: torch.optim.Optimizer, group_indices: list[int]) -> None:
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

    # ---- the small state beside the moment bytes: step counts --------------------

    def snapshot(self) -> _Snapshot:
        """The state a failed step must go back to (step counts and other small
        per-param and per-group state; the moment bytes are in the committed
        slot). Device-side scalars (fused or capturable torch Adam keep the step
        count on the device) are cloned there: no host synchronization."""
        groups = [{k: _clone(group[k]) for k in self.backend.group_state_keys if k in group} for group in self._groups]
        params = [
            [
                None
                if not (state := self.optimizer.state.get(p))
                else _scalars(state, lambda key, value: _clone(value))
                for p in group["params"]
            ]
            for group in self._groups
        ]
        return _Snapshot(groups, params)

    def restore(self, snapshot: _Snapshot) -> None:
        """Go back to :meth:`snapshot`'s state. Moments keep their tensors (their
        storage released; their bytes are re-read from storage); moments an entry
        got since the snapshot (its first update) are dropped with its state."""
        for group, saved_group, saved_params in zip(self._groups, snapshot.groups, snapshot.params, strict=True):
            self._set_group_state(group, {k: _unclone(v) for k, v in saved_group.items()})
            for p, scalars in zip(group["params"], saved_params, strict=True):
                if scalars is None:
                    self.optimizer.state.pop(p, None)
                else:
                    self.optimizer.state[p].update({k: _unclone(v) for k, v in scalars.items()})

    def export_state(self) -> dict:
        """:meth:`snapshot` as JSON, for a checkpoint's manifest: per group its step
        state, per param None (no update yet) or its scalars (torch's ``step``)."""
        return {
            "groups": [
                {k: group[k] for k in sorted(self.backend.group_state_keys) if k in group} for group in self._groups
            ],
            "params": [
                [
                    None if not (state := self.optimizer.state.get(p)) else _scalars(state, _to_json)
                    for p in group["params"]
                ]
                for group in self._groups
            ],
        }

    def check_state(self, saved: object) -> list[str]:
        """What keeps :meth:`export_state`'s output ``saved`` from fitting this
        optimizer: group and param counts, and every value exactly what this
        backend keeps (step counts: whole numbers >= 1, as a tensor of a float
        dtype where torch keeps one). Empty when it fits; changes nothing, so a
        state that passes imports without error."""
        if not isinstance(saved, dict) or not isinstance(saved.get("groups"), list):
            return ["its optimizer state is not an object with 'groups' and 'params'"]
        groups, params = saved["groups"], saved.get("params")
        if len(groups) != len(self._groups) or not isinstance(params, list) or len(params) != len(self._groups):
            return [f"{len(groups)} saved param groups, {len(self._groups)} live"]
        problems = []
        for index, (group, saved_group, saved_params) in enumerate(zip(self._groups, groups, params, strict=True)):
            if (
                not isinstance(saved_group, dict)
                or not set(saved_group) <= self.backend.group_state_keys
                or not all(type(v) is int and _is_step_count(v) for v in saved_group.values())
            ):
                problems.append(f"group {index}: group state {_short(saved_group)} is not a step count")
            if not isinstance(saved_params, list) or len(saved_params) != len(group["params"]):
                count = len(saved_params) if isinstance(saved_params, list) else saved_params
                problems.append(f"group {index}: {count} saved params in a group of {len(group['params'])}")
                continue
            for k, scalars in enumerate(saved_params):
                if scalars is not None and not self.backend.valid_param_state(scalars):
                    problems.append(
                        f"group {index}, param {k}: state {_short(scalars)} is not what this optimizer keeps"
                    )
        return problems

    def import_state(self, saved: dict, materialize: bool) -> None:
        """Restore :meth:`export_state`'s output (checked by :meth:`check_state`).
        Moments are recreated as fp32 tensors of each main's shape, zero-filled
        when ``materialize`` (the caller then reads their bytes), with their
        storage released otherwise."""
        for group, saved_group, saved_params in zip(self._groups, saved["groups"], saved["params"], strict=True):
            self._set_group_state(group, saved_group)
            for p, scalars in zip(group["params"], saved_params, strict=True):
                if scalars is None:
                    self.optimizer.state.pop(p, None)
                    continue
                state = {k: _from_json(v, p, group) for k, v in scalars.items()}
                for name in ("exp_avg", "exp_avg_sq"):
                    moment = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                    if not materialize:
                        moment.untyped_storage().resize_(0)
                    state[name] = moment
                self.optimizer.state[p] = state

    @property
    def _groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def _set_group_state(self, group: dict, saved: dict) -> None:
        """The group's step state becomes ``saved``: keys it lacks are removed (a
        fused Adam group that had not stepped has no ``step`` at all)."""
        for key in self.backend.group_state_keys:
            if key in saved:
                group[key] = saved[key]
            else:
                group.pop(key, None)


@dataclass
class _Snapshot:
    groups: list[dict]
    params: list[list[dict | None]]


_MOMENT_KEYS = frozenset({"exp_avg", "exp_avg_sq"})


def _scalars(state: dict, convert) -> dict:
    """Every entry of a param's state but its moments, through ``convert``."""
    return {key: convert(key, value) for key, value in state.items() if key not in _MOMENT_KEYS}


@dataclass(frozen=True)
class _HostScalar:
    """A host (CPU) scalar tensor's value, kept as a number: cloning it would scatter
    tiny allocations between the buckets' large ones (host-memory fragmentation)."""

    value: int | float | bool
    dtype: torch.dtype


def _clone(value):
    """A copy of one piece of small state that never synchronizes with the device:
    a device tensor is cloned on the device; a host scalar is read (no device involved)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.device.type == "cpu" and value.numel() == 1:
        return _HostScalar(value.item(), value.dtype)
    return value.clone()


def _unclone(value):
    return torch.tensor(value.value, dtype=value.dtype) if isinstance(value, _HostScalar) else value


def _to_json(key: str, value):
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise StreamConfigError(f"optimizer state {key!r} is a tensor of {value.numel()} elements, not a scalar")
        # Where it was kept is recorded; a load places it as the live group needs
        # (see _from_json). Checkpoints only: a step's rollback never reads it.
        return {"value": value.item(), "dtype": str(value.dtype), "on_param_device": value.device.type != "cpu"}
    if isinstance(value, (int, float, bool)):
        return value
    raise StreamConfigError(f"optimizer state {key!r} of type {type(value).__name__} cannot be checkpointed")


def _from_json(value, param: torch.Tensor, group: dict):
    """A saved scalar as the live group needs it. A step tensor is placed as
    ``torch.optim.Optimizer.load_state_dict`` places it: fp32 on the param's
    device for a fused or capturable group, where the update reads it, and on
    the host otherwise; so a state saved under one setting loads under another."""
    if not isinstance(value, dict):
        return value
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(value["value"], dtype=torch.float32, device=param.device)
    return torch.tensor(value["value"], dtype=getattr(torch, value["dtype"].removeprefix("torch.")))


# Step counts are stored as JSON numbers; beyond 2**53 a float loses whole numbers.
_MAX_STEP_COUNT = 2**53
# The dtypes torch keeps a step count tensor in (float32, or the default dtype).
_STEP_TENSOR_DTYPES = frozenset({"torch.float32", "torch.float64"})


def _is_step_count(value) -> bool:
    """A whole number of steps, at least one (state exists only after a step)."""
    return (
        type(value) in (int, float)
        and math.isfinite(value)
        and 1 <= value < _MAX_STEP_COUNT
        and float(value).is_integer()
    )


def is_step_tensor(value: object) -> bool:
    """:func:`_to_json`'s form of a step count kept as a tensor."""
    return (
        isinstance(value, dict)
        and set(value) == {"value", "dtype", "on_param_device"}
        and _is_step_count(value["value"])
        and value["dtype"] in _STEP_TENSOR_DTYPES
        and type(value["on_param_device"]) is bool
    )


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."
