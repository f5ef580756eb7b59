"""The types every layer of the store shares: what is streamed (:class:`Entry`), what
a step moved (:class:`StepStats`) and the callables a front end hands the store.

They sit below the pipeline, the persistence layer and the store, which all
import them and none of which imports another's types.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    """One param's share of the optimizer state.

    ``main`` is the fp32 main the optimizer updates. For a param whose model dtype
    is fp32, ``main`` is the param itself (or a view of it): such entries stream
    their moments only, or stay resident (``StreamConfig.fp32_param_moments``). ``group_index`` names the master param group; ``bucket_key`` keeps
    entries of different keys (e.g. DDP buckets) in different streaming buckets.
    ``name`` and ``start`` say which elements of which param the entry holds
    (``main`` is elements ``[start, start + numel)`` of the param named ``name``):
    checkpoints record them so a load under another sharding can find its
    elements (``checkpoint/reshard_plan.py``).
    """

    param: torch.Tensor
    main: torch.Tensor
    group_index: int
    bucket_key: Hashable = None
    name: str | None = None
    start: int = 0

    @property
    def resident(self) -> bool:
        return self.param.dtype == torch.float32


@dataclass
class StepStats:
    """What one step (or all steps, summed) moved and how long it took. The bytes are
    the stored state the step read and wrote, whatever each bucket's home: a drive's
    traffic is the disk buckets' share (``StreamingStore.home_bytes``), and the gpu
    home's fp32 state, updated in the home's own bytes, is counted though no copy moves it.
    ``conversions_replayed`` and ``conversions_eager``: a bucket's decodes and encodes
    on CUDA with the fused kernels, replayed from the codec's CUDA graphs (a graph's
    capture and first replay included) or run eagerly (``step/graphs.py``: eager
    where the bucket's tensors moved since its last conversion); 0 and 0 where
    nothing is converted or the kernels do not serve. ``eager_slots``: which ran
    eagerly, as ("decode" or "encode", bucket index), each once (one step's: ``add``
    leaves it out of a sum)."""

    buckets: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    conversions_replayed: int = 0
    conversions_eager: int = 0
    eager_slots: tuple = ()

    def add(self, other: StepStats) -> None:
        self.buckets += other.buckets
        self.bytes_read += other.bytes_read
        self.bytes_written += other.bytes_written
        self.seconds += other.seconds
        self.conversions_replayed += other.conversions_replayed
        self.conversions_eager += other.conversions_eager


# The fp32 grad of an entry's main for this step, or None (no grad: not updated).
GradFn = Callable[[Entry], torch.Tensor | None]
# Writes an entry's updated main back into its model param.
EntryFn = Callable[[Entry], None]
# ``fn(param, main)``: fills a main from its model param.
CopyFn = Callable[[torch.Tensor, torch.Tensor], None]
