"""Whether a store may go on: open with a consistent state, damaged, or closed."""

from __future__ import annotations

from collections.abc import Callable

from miles_plugins.optimizers.errors import StoreUnusableError
from miles_plugins.optimizers.step.pipeline import DeferredWriteError, Pipeline


class StoreHealth:
    """The state machine every use of a store's state checks first.

    A store is *closed* once :meth:`mark_closed` (its state is deleted) and
    *damaged* once a failure left it with no consistent state: ``damaged`` then
    says why, in one line (a step that could not be rolled back, a load that failed
    after the live state began to change, a deferred write that failed, transfers
    that hang). Either way :meth:`check_open` refuses with
    :class:`StoreUnusableError` naming the store (``location()``); a damaged
    store's state can only come back from a checkpoint, in a fresh process.
    Transfers the pipeline abandoned count as damage as soon as they are found
    (:meth:`note_hang`).
    """

    def __init__(self, pipeline: Pipeline, location: Callable[[], str]) -> None:
        self._pipeline, self._location = pipeline, location
        self.closed = False
        # Why the stored state is not consistent, or None. A failed step sets it while
        # it rolls back, so that an interrupt inside the undo leaves the store refusing.
        self.damaged: str | None = None

    @property
    def usable(self) -> bool:
        return not self.closed and not self.damaged

    def mark_closed(self) -> None:
        self.closed = True

    def mark_damaged(self, reason: str) -> None:
        self.damaged = reason

    def note_hang(self) -> None:
        """Take transfers the pipeline abandoned, or a release it could not finish, as
        this store's damage, as soon as it is found."""
        if self._pipeline.hung and not self.damaged:
            cause = self._pipeline.hang_cause or "transfers hang (a stalled drive?)"
            self.damaged = f"{cause}; their memory cannot be reused"

    def check_open(self) -> None:
        """Refuse (:class:`StoreUnusableError`) a closed or damaged store."""
        if self.closed:
            raise StoreUnusableError(f"the optimizer-state store at {self._location()} was closed; its state is gone")
        self.note_hang()
        if self.damaged:
            raise StoreUnusableError(
                f"the optimizer-state store at {self._location()} holds no consistent state: {self.damaged}. "
                "Load a good checkpoint into a fresh process"
            )

    def late_failure(self, exc: DeferredWriteError, step: int) -> StoreUnusableError:
        """Mark the store damaged by a failed deferred write of step ``step``; the error to raise."""
        self.damaged = (
            f"writes of step {step}, deferred past its end by the overlap window, failed "
            f"({exc.__cause__}); the model's params are not the stored state's"
        )
        return StoreUnusableError(
            f"the optimizer-state store at {self._location()}: {self.damaged}. Load a good checkpoint into a "
            "fresh process"
        )
