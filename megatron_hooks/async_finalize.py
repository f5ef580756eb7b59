"""Finishing the streamed state's background saves inside Megatron's ``--async-save``.

The save hook adds a :class:`FinishStreamedSaves` to the checkpoint's
``AsyncRequest``, ahead of the finalize function with which rank 0 writes the
tracker that marks the iteration complete. Megatron runs a request's finalize
functions in order, on every rank, once its own (small) part is written everywhere:
from the training loop's ``maybe_finalize_async_save(blocking=False)`` each
iteration, or blocking (before the next save, at the end, miles' ``save_model``).

The streamed state (the large part) may still be writing then. Blocking there would
stop training until it is written, so a non-blocking finalize *defers* instead: it
takes the finalize functions after it out of the list Megatron is running and keeps
them, and they run (on the training thread, as Megatron would run them) before the
first optimizer step once the saves are complete everywhere, at the next save, or
at exit. A blocking finalize, or one called where the running list cannot be found
(``AsyncRequest.execute_sync``, an unknown caller), waits instead.

Ranks agree through marker files, not collectives (a finalize may run at different
points on different ranks once deferred): each rank writes
``<state dir>/.rank<r>.saved`` once its saves are complete, or ``.rank<r>.failed``;
rank 0 lets the tracker be written only once every rank's ``.saved`` is there, and
raises where one failed. The iteration directory must be one every rank sees, as
Megatron's own checkpoints need.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from megatron_hooks.contract import OptimizerStateStore, PendingSave

logger = logging.getLogger(__name__)

# How often rank 0 looks for the other ranks' markers while it waits for them, and
# how often it says whom it waits for.
_POLL_S = 0.2
_LOG_EVERY_S = 60.0


class StreamedSaveError(RuntimeError):
    """A rank's background save of the streamed state failed: the checkpoint is not marked complete."""


def clear_markers(directory: str, rank: int) -> None:
    """Remove this rank's markers from an earlier save into ``directory`` (the same
    iteration saved again). Called by the save hook on every rank before any rank's
    finalize can run: Megatron finalizes only once every rank has scheduled."""
    for marker in _markers(directory, rank):
        try:
            os.unlink(marker)
        except FileNotFoundError:
            pass


class FinishStreamedSaves:
    """The finalize function of one asynchronous checkpoint's streamed state (see the module docstring)."""

    def __init__(
        self,
        pending: Sequence[PendingSave],
        stores: Sequence[OptimizerStateStore],
        directory: str,
        rank: int,
        world_size: int,
    ) -> None:
        self.pending = list(pending)
        self.stores = list(stores)
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self._marked = False

    def __call__(self) -> None:
        # Deferred work runs before a step: a store that cannot say when one comes waits here.
        steps_tell = hasattr(self.stores[0], "before_next_step")
        running = _running_finalize_fns(self) if steps_tell else None
        if running is None:
            self.complete(block=True)
            return
        if self.complete(block=False):
            return
        at = next(i for i, fn in enumerate(running) if fn is self)
        later = running[at + 1 :]
        del running[at + 1 :]  # Megatron's loop ends after this one; they run once the saves are complete
        _deferred.append((self, later))
        logger.info(
            "the streamed optimizer state of %s is still being written: %d finalize function(s) of the "
            "checkpoint (rank 0's marks it complete) wait for it, training goes on",
            self.directory,
            len(later),
        )
        _arm(self.stores)

    def complete(self, block: bool) -> bool:
        """Whether this checkpoint's streamed state is complete on every rank this rank
        must know of (rank 0: all; others: their own); with ``block``, wait until it is.
        Raises :class:`StreamedSaveError` where a save failed (rank 0: anywhere)."""
        if not self._marked:
            if not block and not all(save.done() for save in self.pending):
                return False
            self._finish_own()
        if self.rank != 0:
            return True
        return _all_saved(self.directory, self.world_size, block)

    def _finish_own(self) -> None:
        failure = None
        for save in self.pending:
            try:
                save.wait()
            except Exception as exc:  # noqa: BLE001 - marked for rank 0, raised here
                failure = failure or exc
        _write_marker(self.directory, self.rank, "failed" if failure else "saved")
        self._marked = True
        if failure is not None:
            raise StreamedSaveError(
                f"the streamed optimizer state of {self.directory} was not saved (rank {self.rank}: {failure}): "
                "the checkpoint is not marked complete, and the previous one stays the latest"
            ) from failure


# Finalize functions waiting for their checkpoint's streamed state, oldest first.
_deferred: list[tuple[FinishStreamedSaves, list[Callable[[], Any]]]] = []


def finish_deferred(block: bool) -> None:
    """Run the deferred finalize functions of every checkpoint whose streamed state is
    complete, oldest first (a later checkpoint's never before an earlier one's); with
    ``block``, wait for all. A failed checkpoint's are dropped (its tracker is not
    written) and its error raised."""
    while _deferred:
        finish, later = _deferred[0]
        try:
            if not finish.complete(block):
                return
        except BaseException:
            _deferred.pop(0)
            raise
        _deferred.pop(0)
        for fn in later:
            fn()


def _arm(stores: Sequence[OptimizerStateStore]) -> None:
    """Check for complete saves before each optimizer step while any are deferred."""

    def check() -> None:
        finish_deferred(block=False)
        if _deferred:
            stores[0].before_next_step(check)

    stores[0].before_next_step(check)


@atexit.register
def _finish_at_exit() -> None:
    """A run that ends with saves deferred (Megatron's last blocking finalize finds no
    request left) completes them here: the background threads were joined already."""
    if not _deferred:
        return
    try:
        finish_deferred(block=True)
    except Exception as exc:  # noqa: BLE001 - at exit: said, not raised
        logger.error("at exit: %s", exc)


def _running_finalize_fns(fn: FinishStreamedSaves) -> list | None:
    """The finalize-function list a non-blocking caller is running ``fn`` from, found in
    the frame iterating it (megatron-core's ``AsyncCallsQueue.maybe_finalize_async_calls``
    and NVRx's: ``for finalize_fn in async_request.finalize_fns``); None for any other
    caller, or one that blocks."""
    frame = sys._getframe(2)
    while frame is not None:
        names = frame.f_locals
        if names.get("finalize_fn") is fn:
            if names.get("blocking") is not False:
                return None
            for value in names.values():
                fns = getattr(value, "finalize_fns", None)
                if isinstance(fns, list) and any(f is fn for f in fns):
                    return fns
            return None
        frame = frame.f_back
    return None


def _markers(directory: str, rank: int) -> list[str]:
    return [os.path.join(directory, f".rank{rank:05d}.{what}") for what in ("saved", "failed")]


def _write_marker(directory: str, rank: int, what: str) -> None:
    path = os.path.join(directory, f".rank{rank:05d}.{what}")
    try:
        with open(path, "w") as f:
            f.write(f"pid {os.getpid()}\n")
    except OSError as exc:
        raise StreamedSaveError(
            f"cannot write {path} ({exc.strerror}): rank 0 cannot learn that rank {rank}'s streamed optimizer "
            "state is saved, and does not mark the checkpoint complete"
        ) from exc


def _all_saved(directory: str, world_size: int, block: bool) -> bool:
    """Whether every rank's ``.saved`` marker is in ``directory`` (one listing per look);
    raises where a rank's ``.failed`` is."""
    logged = time.monotonic()
    while True:
        names = set(os.listdir(directory))
        failed = [r for r in range(world_size) if f".rank{r:05d}.failed" in names]
        if failed:
            raise StreamedSaveError(
                f"the streamed optimizer state of {directory} was not saved on rank(s) {_ranks(failed)}: the "
                "checkpoint is not marked complete, and the previous one stays the latest"
            )
        missing = [r for r in range(world_size) if f".rank{r:05d}.saved" not in names]
        if not missing:
            return True
        if not block:
            return False
        if time.monotonic() - logged >= _LOG_EVERY_S:
            logged = time.monotonic()
            logger.info("waiting for rank(s) %s to finish saving the streamed state of %s", _ranks(missing), directory)
        time.sleep(_POLL_S)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
