"""The store's walks over its buckets: the optimizer step, and the rewrite of the mains.

A step walks every bucket through the pipeline: its grads are attached, its
optimizer (the master's class, ``step/adam.py``) updates it, its mains go to the
model, and it is written back; the fp32-native params whose moments stay resident
are updated last, in place. A step that fails part way is rolled back where it can
be (``step/rollback.py``); where it cannot, the store is left damaged, saying why.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from miles_plugins.optimizers.step.entries import CopyFn, Entry, EntryFn, GradFn, StepStats
from miles_plugins.optimizers.step.flight import BucketInFlight
from miles_plugins.optimizers.step.pipeline import DeferredWriteError
from miles_plugins.optimizers.step.rollback import StepRollback
from miles_plugins.optimizers.store.between_steps import BetweenSteps
from miles_plugins.optimizers.store.health import StoreHealth
from miles_plugins.optimizers.store.parts import StoreParts


class StepRunner:
    """Runs one store's steps and rewrites of its mains.

    Args:
        entries: the store's entries.
        parts: the store's parts (``parts.py``).
        grad_fn, copy_to_model: the store's (``StreamingStore``'s arguments).
        remainder_mains: whether the mains are stored as remainders (no failed step
            can then be rolled back).
        health: the store's; a failure that cannot be undone damages it.
        between_steps: the store's, whose deferred writes a failed step lands or drops.
    """

    def __init__(
        self,
        *,
        entries: Sequence[Entry],
        parts: StoreParts,
        grad_fn: GradFn,
        copy_to_model: EntryFn,
        remainder_mains: bool,
        health: StoreHealth,
        between_steps: BetweenSteps,
    ) -> None:
        self.entries, self.grad_fn, self.copy_to_model = entries, grad_fn, copy_to_model
        self._parts, self._remainder_mains = parts, remainder_mains
        self._pipeline, self._resident_optimizer = parts.pipeline, parts.plan.resident_optimizer
        self._health, self._between_steps = health, between_steps

    def run(self, step_number: int) -> StepStats:
        """Step ``step_number`` over all state; returns what it moved. See ``StreamingStore.step``."""
        start = time.perf_counter()
        stats = StepStats()
        rollback = StepRollback(
            step_number=step_number,
            pipeline=self._pipeline,
            placed=self._parts.placed,
            copy_to_model=self.copy_to_model,
            remainder_mains=self._remainder_mains,
        )

        def update(flight: BucketInFlight) -> None:
            rollback.record(flight)
            self.update(flight)

        walked = False
        graphs = self._pipeline.codec.graphs
        replays, eager = graphs.replays, graphs.eager
        graphs.take_eager_slots()  # those of conversions outside steps (a checkpoint's reads, say)
        try:
            self._pipeline.walk(update, stats, defer=self._parts.window.deferred())
            # Added, not set: the walk's stats (the prefetched buckets' included) count none.
            stats.conversions_replayed += graphs.replays - replays
            stats.conversions_eager += graphs.eager - eager
            stats.eager_slots = tuple(graphs.take_eager_slots())
            walked = True
            # Last: fp32-native params are updated in place, with no copy to roll back to.
            if self._resident_optimizer is not None:
                self.attach_grads(self._parts.plan.resident_entries)
                rollback.resident_started()
                self._resident_optimizer.step()
        except DeferredWriteError as exc:
            # The previous step's deferred write, waited for by this walk: the stored state
            # is lost, so nothing is rolled back to it.
            raise self._health.late_failure(exc, step_number - 1) from exc.__cause__
        except BaseException as exc:
            # Damaged until undone: an interrupt inside the undo must not leave a half-stepped store usable.
            self._health.damaged = f"step {step_number} failed and its roll-back was interrupted"
            self._roll_back(exc, rollback, walked)
            raise
        # With deferred writes still landing too: no roll-back is left to need the previous
        # slot (a late failure leaves the store refusing), and their buckets are read only
        # once they have landed.
        self._parts.backing.commit()
        self._parts.window.note_carried()
        stats.seconds = time.perf_counter() - start
        return stats

    def _roll_back(self, exc: BaseException, rollback: StepRollback, walked: bool) -> None:
        """After a step failed with ``exc``: undo it, or leave the store damaged saying why not."""
        if walked:
            self._pipeline.drop_deferred_writes()  # this step's deferred writes must not land
        elif not self._pipeline.hung:
            # The previous step's must: they are the stored state, and one that failed
            # is reported (naming its step) instead of rolling back onto lost state.
            # Not after a hang: the roll-back refuses then, and waiting again would
            # double the time a hung drive takes to fail.
            self._between_steps.advance_deferred_writes(block=True)
        self._health.damaged = rollback.undo(exc)

    def update(self, flight: BucketInFlight) -> None:
        """The Adam update of one materialized bucket; its mains then go to the model."""
        optimizer = flight.optimizer
        self.attach_grads(flight.bucket.entry_indices)
        fresh = [e for e in flight.entries if optimizer.moments(e.main) is None]
        optimizer.step()
        for entry in fresh:
            # Moments the optimizer created in this step (an entry's first update).
            for moment in optimizer.moments(entry.main) or ():
                self._pipeline.accounting.adopt(moment)
        for entry in flight.entries:
            if flight.bucket.streams_main:
                entry.main.grad = None  # the fp32 grad is not state; drop it now (an fp32 param's is the model's)
            self.copy_to_model(entry)

    def attach_grads(self, entry_indices: Sequence[int]) -> None:
        """Give the entries' mains their fp32 grads for this step (``grad_fn``)."""
        for i in entry_indices:
            entry = self.entries[i]
            grad = self.grad_fn(entry)
            if grad is not entry.main.grad:
                entry.main.grad = grad

    @torch.no_grad()
    def write_mains(self, fill: CopyFn | None) -> None:
        """Write every bucket's mains (moments untouched), ``buckets_in_flight`` at a
        time: filled from the params by ``fill``, or as they are when it is None.
        In place: a failure part way leaves the mains mixed, and the store refuses
        to step (after construction: the caller's refresh can then not be trusted)."""

        def fill_mains(flight: BucketInFlight) -> None:
            if fill is not None:
                for entry in flight.entries:
                    fill(entry.param, entry.main)

        try:
            self._pipeline.walk(fill_mains, StepStats(), mains_only=True)
        except BaseException as exc:
            self._health.mark_damaged(f"rewriting the mains failed part way ({exc})")
            raise
