"""The store's overlap window (``StreamConfig.overlap_bytes``; docs/placement.md): the
state it holds on the device across the step boundary, so that its transfers run
during forward and backward instead of inside the step.

A step leaves the writes of :meth:`OverlapWindow.deferred` buckets to the pipeline's
``advance_deferred_writes()``; between steps :meth:`OverlapWindow.read_ahead` reads the next step's
first buckets into the room the landed ones left (``Pipeline.prefetch`` keeps the
order: never a bucket still landing). The store owns the failures (``store/between_steps.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.placement import Placement
from miles_plugins.optimizers.step.pipeline import Pipeline, leading_fit


class OverlapWindow:
    """The overlap window of one store: ``window_bytes`` of materialized state (0: none)."""

    def __init__(
        self, *, window_bytes: int, buckets: Sequence[BucketLayout], placed: Placement, pipeline: Pipeline
    ) -> None:
        self.window_bytes = window_bytes
        self._buckets, self._placed, self._pipeline = buckets, placed, pipeline
        self.carried_peak_bytes = 0  # the most state bytes seen held between steps (accounting)

    @property
    def bound(self) -> int:
        """The most materialized state the window holds on the device between steps
        (during forward and backward): the buckets whose writes the step defers and
        those read ahead for the next one (no bucket is both at once), which fit the
        window together (``Pipeline.prefetch``); 0 without a window."""
        if not self.window_bytes:
            return 0
        held = {b.index for b in leading_fit(self._buckets, self.window_bytes)} | self.deferred()
        return min(self.window_bytes, sum(self._buckets[i].materialized_bytes for i in held))

    def deferred(self) -> frozenset[int]:
        """The step's last buckets outside the gpu home (whose writes are device copies,
        nothing to hide) that fit the window: their writes run after the step, so a
        failure of one is found after it returned, with no roll-back."""
        homes = self._placed.homes
        candidates = [b for b in reversed(self._buckets) if homes[b.index] != "gpu"]
        return frozenset(b.index for b in leading_fit(candidates, self.window_bytes))

    def read_ahead(self) -> None:
        """Read the next step's first buckets into the room the landed writes left."""
        self._pipeline.prefetch(self.window_bytes, window_only=True)
        self.note_carried()

    def note_carried(self) -> None:
        self.carried_peak_bytes = max(self.carried_peak_bytes, self._pipeline.accounting.current)
