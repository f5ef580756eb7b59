"""What a checkpoint of one store records about the store itself: its description.

A save writes the description into its manifest beside the state; a load compares
it with the live store's (``manifest.COMPARED_FIELDS``, ``manifest.differences``)
before anything else, and a load at another data-parallel size reads which
elements of which param each saved entry holds from it (``reshard_load.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_plugins.optimizers.config import StreamConfig
from miles_plugins.optimizers.formats import quant8
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.step.entries import Entry


def describe_store(
    config: StreamConfig,
    entries: Sequence[Entry],
    buckets: Sequence[BucketLayout],
    resident_entries: Sequence[int],
    master: torch.optim.Optimizer,
    topology: dict | None,
    param_layout: dict | None,
    param_facts: dict | None = None,
) -> dict:
    """What a checkpoint of this store records and a load must match (``manifest.COMPARED_FIELDS``);
    beside it, not compared: which elements of which param each entry holds (``pieces``),
    what an offline reshard needs (the bucket cap, ``param_layout``) and where each param
    sits in Megatron's global tensors (``param_facts``: for a reshard to other TP, PP or EP sizes)."""

    def pieces(indices: Sequence[int]) -> list:
        return [[entries[i].name, entries[i].start, entries[i].group_index] for i in indices]

    return {
        "store": config.name,
        "main_dtype": "fp32" if config.main_storage == "fp32" else "fp32 as bf16 param + int16 remainder",
        "moment_dtype": config.moment_dtype,
        "moment_format": quant8.FORMAT_ID if config.blockwise_moments else None,
        "fp32_param_moments": config.fp32_param_moments,
        "topology": dict(topology or {}),
        # "main": false marks a bucket of fp32 params' moments (their mains are the params).
        "layout": [b.description() for b in buckets],
        "resident_numels": [entries[i].main.numel() for i in resident_entries],
        "pieces": [pieces(b.entry_indices) for b in buckets],
        "resident_pieces": pieces(resident_entries),
        "optimizer_class": f"{type(master).__module__}.{type(master).__qualname__}",
        "bucket_cap_elements": config.bucket_cap_elements,
        "param_layout": param_layout,
        "param_facts": param_facts,
    }
