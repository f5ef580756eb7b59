"""What a failed step can undo, and the undoing.

A step writes each disk bucket's update to its spare slot and commits only after
the last write (``io.FileBacking.commit``), so a failure part way leaves the
committed state whole: rolling back is restoring the bucket optimizers' step
counts and rewriting the model params the step had changed from the committed
mains. Four kinds of update cannot be undone that way:

- a bucket at home in host or device memory, updated in place;
- a disk bucket kept in one slot (its drive had no room for two), updated in place;
- a bucket of fp32-native params, which are their own mains, updated in place;
- anything at all with remainder mains, which need the params the step overwrote.

The first three come last in the walk (``placement.py`` orders them, and the
pipeline drains every disk write before the first of them, ``drain_before``), so
a failure before them still rolls back. After one of them was updated, or with
remainder mains, or while transfers hang, the store refuses to step again.

An overlap window's deferred writes (``step/overlap.py``) run after the step returned:
a failure of one cannot roll anything back either, and the store refuses too.
A step that fails after its walk drops its own deferred writes before rolling back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.placement import Placement
from miles_plugins.optimizers.step.entries import EntryFn
from miles_plugins.optimizers.step.flight import BucketInFlight
from miles_plugins.optimizers.step.pipeline import Pipeline

logger = logging.getLogger(__name__)


def written_in_place(bucket: BucketLayout, placed: Placement) -> str | None:
    """Why an update of ``bucket`` cannot be undone, or None (its mains stream to a
    disk bucket with two slots, where a step writes the spare one)."""
    if not bucket.streams_main:
        return "the fp32-native params are updated in place"
    if placed.homes[bucket.index] != "disk":
        return "buckets at home in host or device memory are written in place"
    if bucket.index in placed.one_slot:
        return "disk buckets kept in one slot (the drive had no room for two) are written in place"
    return None


def first_written_in_place(buckets: Sequence[BucketLayout], placed: Placement) -> int | None:
    """The first bucket whose update cannot be undone: the walk drains disk writes before it."""
    return next((b.index for b in buckets if written_in_place(b, placed)), None)


class StepRollback:
    """One step's record of the buckets it updated, and their undoing if it fails.

    Call :meth:`record` before each bucket's update and :meth:`resident_started`
    before the fp32-native params' in-place update; after a failure,
    :meth:`undo` restores the pre-step state or says why it cannot.
    """

    def __init__(
        self,
        *,
        step_number: int,
        pipeline: Pipeline,
        placed: Placement,
        copy_to_model: EntryFn,
        remainder_mains: bool,
    ) -> None:
        self._step_number = step_number
        self._pipeline = pipeline
        self._placed = placed
        self._copy_to_model = copy_to_model
        # Why no failed step can be rolled back, whatever it updated.
        self._blocker = "remainder mains need the params the step overwrote" if remainder_mains else None
        self._updated: list[
            tuple[BucketInFlight, object]
        ] = []  # buckets whose params this step changed, their prior state
        self._resident_started = False

    def record(self, flight: BucketInFlight) -> None:
        """Keep the pre-update state of ``flight``'s bucket (not taken where no roll-back is possible)."""
        self._updated.append((flight, flight.optimizer.snapshot() if self._blocker is None else None))

    def resident_started(self) -> None:
        self._resident_started = True

    def undo(self, exc: BaseException) -> str | None:
        """After the step failed with ``exc``: restore the pre-step state and return None,
        or return why the store holds no consistent state (it must refuse to step)."""
        failed = f"step {self._step_number} failed ({str(exc) or type(exc).__name__})"
        if not isinstance(exc, Exception) and isinstance(exc.__context__, Exception):
            failed += f" while handling: {exc.__context__}"  # an interrupt during a failure's clean-up
        if self._pipeline.hung:
            return f"{failed}; {self._pipeline.hang_cause or 'transfers still hang'}, their memory cannot be reused"
        if self._resident_started:
            return f"{failed} while updating the fp32-native params, which are updated in place"
        if not self._updated:
            return None  # no bucket was updated: nothing changed
        blocker = self._blocker or next(
            (
                f"{why} (bucket {f.bucket.index} was updated)"
                for f, _ in self._updated
                if (why := written_in_place(f.bucket, self._placed))
            ),
            None,
        )
        if blocker is not None:
            return f"{failed} after updating {len(self._updated)} buckets, and {blocker}"
        try:
            for flight, prior in self._updated:
                flight.optimizer.restore(prior)
            self._restore_params([flight.bucket for flight, _ in self._updated])
        except BaseException as again:
            return f"{failed}, and rolling back its {len(self._updated)} updated buckets failed too ({again})"
        logger.warning(
            "%s; the optimizer state and the params of the %d buckets it had updated are back at step %d: "
            "only this step is lost",
            failed,
            len(self._updated),
            self._step_number - 1,
        )
        return None

    def _restore_params(self, buckets: Sequence[BucketLayout]) -> None:
        """Rewrite the model params of ``buckets`` from their committed fp32 mains."""
        for bucket in buckets:
            with self._pipeline.read_one(bucket.index, moments=False) as flight:
                for entry in flight.entries:
                    self._copy_to_model(entry)
