"""What a store's entries become before anything is opened: checked, cut into
buckets with an optimizer each (:func:`plan_buckets`).

Entries whose model param is fp32 are their own mains: their moments stream in
buckets of their own, last (``fp32_param_moments="streamed"``), or stay resident
with them under one small optimizer of the master's class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles_plugins.optimizers.config import StreamConfig
from miles_plugins.optimizers.errors import StreamConfigError
from miles_plugins.optimizers.formats import remainder
from miles_plugins.optimizers.formats.layout import MAIN_DTYPE, BucketLayout, layout_store
from miles_plugins.optimizers.step.adam import AdamBackend
from miles_plugins.optimizers.step.bucket_optimizer import BucketOptimizer
from miles_plugins.optimizers.step.entries import Entry
from miles_plugins.optimizers.store.log import warn_about_residency

# Param dtypes whose Adam state is fp32 (mains, moments): what the store keeps exactly.
STREAMABLE_PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True, kw_only=True, eq=False)
class BucketPlan:
    """What a store's entries become before anything is opened.

    Args:
        device: where the buckets are materialized (the streamed mains' device).
        buckets, bucket_optimizers: the layout and each bucket's optimizer.
        resident_entries, resident_optimizer: the fp32 params whose moments stay
            resident, and the one small optimizer that steps them ([] and None: none).
    """

    device: torch.device
    buckets: list[BucketLayout]
    bucket_optimizers: list[BucketOptimizer]
    resident_entries: list[int]
    resident_optimizer: BucketOptimizer | None


def plan_buckets(entries: list[Entry], backend: AdamBackend, config: StreamConfig) -> BucketPlan:
    """Check every entry can be streamed, cut the streamed ones into buckets with an
    optimizer each, and give the fp32 params that keep their moments resident theirs."""
    streamed = _streamed_entries(entries, config)
    buckets = _layout(entries, streamed, config)
    bucket_optimizers = [backend.build(_groups_of(entries, b.entry_indices)) for b in buckets]
    resident_entries, resident_optimizer = _resident(entries, backend, config)
    warn_about_residency(config, buckets, sum(entries[i].main.numel() for i in resident_entries))
    return BucketPlan(
        device=entries[streamed[0]].main.device if streamed else torch.device("cpu"),
        buckets=buckets,
        bucket_optimizers=bucket_optimizers,
        resident_entries=resident_entries,
        resident_optimizer=resident_optimizer,
    )


def _streamed_entries(entries: Sequence[Entry], config: StreamConfig) -> list[int]:
    """Indices of the entries to stream, after checking each can be."""
    for i, entry in enumerate(entries):
        if entry.param.dtype not in STREAMABLE_PARAM_DTYPES:
            raise StreamConfigError(
                f"param {entry.name or i!r} is {entry.param.dtype}: the streamed state is fp32 (mains and moments), "
                f"so it would train differently from resident Adam in its own dtype; stream only bf16, fp16 and "
                "fp32 params (keep the others in an optimizer of their own)"
            )
    with_mains = [i for i, e in enumerate(entries) if not e.resident]
    if config.main_storage == "remainder" and entries and not with_mains:
        raise StreamConfigError(
            "main_storage='remainder' stores the low half of fp32 mains beside bf16 params, and every param "
            "here is fp32 (its own main, which stays in the model): nothing to store that way; use "
            "main_storage='fp32'"
        )
    moments_only = [i for i, e in enumerate(entries) if e.resident and config.fp32_param_moments == "streamed"]
    streamed = with_mains + moments_only
    for i in streamed:
        main = entries[i].main
        if main.dtype != torch.float32 or not main.is_contiguous():
            raise ValueError(f"entry {i}: a streamed main must be a contiguous fp32 tensor, got {main.dtype}")
        if config.main_storage == "remainder" and i in with_mains and entries[i].param.dtype != torch.bfloat16:
            raise StreamConfigError(
                f"remainder mains need bf16 params (the main's high half), entry {i} is "
                f"{entries[i].param.dtype}; use main_storage='fp32'"
            )
    return streamed


def _layout(entries: Sequence[Entry], streamed: Sequence[int], config: StreamConfig) -> list[BucketLayout]:
    return layout_store(
        [(i, entries[i].main.numel(), entries[i].bucket_key, entries[i].resident) for i in streamed],
        config.bucket_cap_elements,
        config.moment_torch_dtype,
        remainder.STORAGE_DTYPE if config.main_storage == "remainder" else MAIN_DTYPE,
        config.blockwise_moments,
    )


def _resident(entries: Sequence[Entry], backend: AdamBackend, config: StreamConfig) -> tuple[list[int], object]:
    """The entries whose fp32 params keep their moments resident, and the one small
    optimizer (of the master's class) that steps them; ([], None) when there are none."""
    indices = [i for i, e in enumerate(entries) if e.resident and config.fp32_param_moments == "resident"]
    return indices, (backend.build(_groups_of(entries, indices)) if indices else None)


def _groups_of(entries: Sequence[Entry], indices: Sequence[int]) -> list[tuple[int, list[torch.Tensor]]]:
    """(master group index, mains) for the entries at ``indices``, in order of first appearance."""
    groups: dict[int, list[torch.Tensor]] = {}
    for i in indices:
        groups.setdefault(entries[i].group_index, []).append(entries[i].main)
    return list(groups.items())
