"""A bucket in flight (:class:`Flight`, from its fetch to its release) and the store's
count of the optimizer-state bytes such buckets hold on the device
(:class:`StateAccounting`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from miles_plugins.optimizers.formats.layout import MOMENT_SEGMENTS, BucketLayout
from miles_plugins.optimizers.homes.protocols import PendingTransfers, Transfer
from miles_plugins.optimizers.step.bucket_optimizer import BucketOptimizer
from miles_plugins.optimizers.step.entries import Entry

if TYPE_CHECKING:
    from miles_plugins.optimizers.homes.protocols import Handle


@dataclass
class StateAccounting:
    """The store's own count of optimizer-state bytes materialized on the device
    (mains and moments of the buckets in flight; not those that share their home's
    bytes, which take no memory of their own: ``Flight.shared``). Accounting, not a
    measurement:
    the allocator's figure (``torch.cuda.max_memory_allocated``) also holds
    Adam's temporaries and conversion scratch. Each tensor counts once until
    released, however often it is materialized."""

    current: int = 0
    peak: int = 0
    # id(tensor) -> (bytes counted, address of the storage they were counted in)
    _counted: dict[int, tuple[int, int]] = field(default_factory=dict)

    def materialize(self, t: torch.Tensor) -> None:
        """Give ``t`` its storage (a no-op for one that already has it) and count it."""
        nbytes = t.numel() * t.element_size()
        if t.storage_offset() or t.untyped_storage().nbytes() > nbytes:
            # A view into more (a home's bytes it still shares): resizing would resize those.
            raise RuntimeError(f"not materializing a tensor that shares a larger storage ({t.shape}, {t.dtype})")
        if t.untyped_storage().nbytes() != nbytes:
            t.untyped_storage().resize_(nbytes)
        self.adopt(t)

    def adopt(self, t: torch.Tensor) -> None:
        """Count a tensor that already has its storage (e.g. moments the optimizer created)."""
        if id(t) in self._counted:
            return
        storage = t.untyped_storage()
        self._counted[id(t)] = (storage.nbytes(), storage.data_ptr())
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)

    def release(self, t: torch.Tensor) -> None:
        """Free ``t``'s storage, only where it is the one counted here: never another's
        bytes ``t`` views (a home's, which a cut-off release left it sharing)."""
        counted = self._counted.pop(id(t), None)
        if counted is None:
            return
        nbytes, address = counted
        self.current -= nbytes
        if not t.storage_offset() and t.untyped_storage().data_ptr() == address:
            t.untyped_storage().resize_(0)


@dataclass
class BucketInFlight:
    """One bucket between its fetch and its retirement.

    ``converts`` are (segment name, entry, tensor) a read fills in their stored
    format, to be decoded once it is done. ``shared`` are the tensors that share
    their home's bytes for the visit instead of a copy (the gpu home's fp32-stored
    ones: ``BufferHandle.view_of``), each with a detached alias of the (empty)
    storage it had, which it gets back when the flight is released. ``holds_memory``:
    False for a bucket whose every tensor shares its home's bytes (``BucketMover.lends_all``):
    it takes no room among the ``max_in_flight`` buckets in flight.
    """

    bucket: BucketLayout
    optimizer: BucketOptimizer
    entries: list[Entry]
    handle: Handle | None = None
    reads: PendingTransfers | None = None
    writes: PendingTransfers | None = None
    # A deferred write (walk's ``defer``): its transfers and the event after its
    # encoding, until ``advance_deferred_writes()`` submits them.
    held: tuple[list[Transfer], torch.cuda.Event | None] | None = None
    converts: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)
    shared: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    holds_memory: bool = True

    def tensors(self, k: int, moments: bool = True) -> list[tuple[str, torch.Tensor]]:
        """(segment name, fp32 tensor) of entry ``k``: its main (unless the bucket's
        mains are fp32 params, which stay in the model), then its moments if it has any."""
        main = self.entries[k].main
        state = self.optimizer.moments(main) if moments else None
        mains = [("main", main)] if self.bucket.streams_main else []
        return [*mains, *(zip(MOMENT_SEGMENTS, state, strict=True) if state is not None else ())]
