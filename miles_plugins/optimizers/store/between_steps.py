"""What a store moves between its steps, and how it finishes those transfers before its stored state
is touched outside a step.

Between steps the pipeline may hold buckets read ahead for the next step
(``prefetch``) and, with an overlap window, the last step's deferred writes still
landing (``progress`` moves both along); a background save may be copying the
state as a snapshot left it (``checkpoint/background.py``), each step waiting,
bucket by bucket, for the bytes it would overwrite. Saves, loads, refreshes, the
gpu home's moves, reading the state back and closing first *finish the transfers*: the
background save ended, every deferred write landed, every prefetched read
dropped, the store still usable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from miles_plugins.optimizers.checkpoint.background import BackgroundSave
from miles_plugins.optimizers.config import StreamConfig
from miles_plugins.optimizers.step.pipeline import DeferredWriteError
from miles_plugins.optimizers.store.health import StoreHealth
from miles_plugins.optimizers.store.parts import StoreParts


class BetweenSteps:
    """The transfers of one store between its steps.

    Args:
        parts: the store's (its pipeline and overlap window).
        health: the store's; a failure or a hang found here damages it.
        config: the store's (``pipelined``, ``overlap_bytes``).
        steps_taken: the store's step count, which a failed deferred write names.
    """

    def __init__(
        self,
        *,
        parts: StoreParts,
        health: StoreHealth,
        config: StreamConfig,
        steps_taken: Callable[[], int],
    ) -> None:
        self._pipeline, self._window, self._health = parts.pipeline, parts.window, health
        self._config, self._steps_taken = config, steps_taken
        self._background: BackgroundSave | None = None

    def start_background(self, save: BackgroundSave) -> None:
        """Run ``save`` beside the steps that follow (its transfers finished): each of their
        fetches waits for the bytes it would overwrite (``BackgroundSave.before_overwrite``)."""
        # The guard first: a save running without it would copy bytes later steps changed.
        self._background = save
        self._pipeline.before_fetch = save.before_overwrite
        try:
            save.start()
        except BaseException:
            if save.done():  # it never ran (an interrupt once it runs leaves it running, guarded)
                self._background = None
                self._pipeline.before_fetch = None
            raise

    def end_background(self) -> None:
        """Wait until a background save has ended (its error is its owner's to see: it
        was logged when it happened, and ``BackgroundSave.wait`` raises it). The guard
        goes only then: an interrupt during the wait leaves both as they were."""
        save = self._background
        if save is None:
            return
        try:
            save.wait()
        except Exception:  # noqa: BLE001 - reported by the save and its handle
            pass
        self._background = None
        self._pipeline.before_fetch = None

    def advance_deferred_writes(self, block: bool = False) -> None:
        """Move the deferred writes along (``Pipeline.advance_deferred_writes``); a failure leaves the store refusing."""
        if not self._pipeline.deferred_writes:
            return
        try:
            self._pipeline.advance_deferred_writes(block)
        except DeferredWriteError as exc:
            raise self._health.late_failure(exc, self._steps_taken()) from exc.__cause__

    def prefetch(self) -> None:
        """``StreamingStore.prefetch``."""
        self._health.check_open()
        if self._config.pipelined:
            self.advance_deferred_writes()  # reads stop before a bucket still landing; the step waits for it
            try:
                self._pipeline.prefetch(self._config.overlap_bytes)
            finally:
                self._health.note_hang()

    def progress(self) -> None:
        """``StreamingStore.progress``."""
        # Nothing while a CUDA graph is captured; a damaged store was reported when found,
        # and step and save refuse it: forward passes (evaluation too) go on meanwhile.
        if not self._config.overlap_bytes or not self._health.usable or _capturing():
            return
        self._health.check_open()
        self.advance_deferred_writes()
        if self._background is not None and not self._background.done():
            return  # its guard could make a read ahead wait, and progress never waits
        try:
            self._window.read_ahead()
        finally:
            self._health.note_hang()

    def drop_prefetch(self) -> None:
        """``StreamingStore.drop_prefetch``."""
        if not self._health.closed:
            try:
                self._pipeline.drop_prefetch()
            finally:
                self._health.note_hang()

    def finish_transfers(self) -> None:
        """Before touching the stored state outside a step: wait for a background save,
        forget prefetched reads (they may hang: the store then refuses), and check the
        store may go on."""
        self._health.check_open()
        self.end_background()
        self.advance_deferred_writes(block=True)
        self.drop_prefetch()
        self._health.check_open()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
