"""Finishing the streamed state's background saves inside Megatron's ``--async-save``.

The save hook adds a :class:`FinishStreamedSaves` to the checkpoint's
``AsyncRequest``, ahead of the finalize function with which rank 0 writes the
tracker that marks the iteration complete. Megatron runs a request's finalize
functions in order, on every rank, once its own (small) part is written everywhere:
from the training loop's ``maybe_finalize_async_save(blocking=False)`` each
iteration, or blocking (before the next save, at the end, miles' ``save_model``).

The streamed state (the large part) may still be writing then. Blocking there would
stop training until it is written, so the finalize takes the functions after it out
of the list Megatron is running and keeps them (*deferred*); they run, on the
training thread as Megatron would run them, at once where the saves are complete
everywhere, else before the first optimizer step once they are, at the next save,
or at exit. A blocking caller (``AsyncRequest.execute_sync`` too) waits for them; one
whose running list cannot be found waits before it runs them.

Every rank reaches these points together (Megatron finalizes a request on all ranks
at once, and every rank of a job that streams steps and saves, also one whose chain
holds no params), so the ranks agree there with a collective: each gives its state
(saving, saved, failed) and all see every rank's, so all defer, all finish, or all
raise :class:`StreamedSaveError` at the same point. A blocking wait is a series of
short collectives, one a second, so no rank sits in one for as long as a save takes;
once some rank's saves ended, the others get :data:`STRAGGLER_WAIT_S`, counted in
those collectives so that every rank gives up at the same one. No collective runs at
exit (a rank may be exiting on an error while the others still train): each rank
writes a marker into the state directory once its saves end, ``.rank<r>.save<n>.saved``
or ``.failed`` (``n``: the save's number, alike on every rank), and at exit every rank waits, at most :data:`STRAGGLER_WAIT_S`,
for every rank's ``.saved`` before it runs its deferred functions; otherwise it logs
why the checkpoint stays unmarked.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from megatron_hooks.contract import PendingSave

logger = logging.getLogger(__name__)

# A rank's state of one checkpoint's streamed saves, as the ranks exchange it.
SAVING, SAVED, FAILED = 0, 1, 2
# What a rank whose chain holds no params (no store) gives: complete, yet no save that ended.
NOTHING = 3
# How often the ranks (or each rank, at exit) look again while they wait, and how often
# rank 0 says whom it waits for.
_POLL_S = 1.0
_LOG_EVERY_S = 60.0
# How long the ranks whose saves ended wait for the others' (Megatron's default
# distributed timeout: as long as its own wait for its ranks' async part would).
STRAGGLER_WAIT_S = 600.0
# Set on an optimizer whose ``step`` finishes deferred checkpoints first.
_CHECKED_ATTR = "_miles_finishes_deferred_saves"
# This process's asynchronous saves so far (next_save_number).
_saves = 0


class StreamedSaveError(RuntimeError):
    """A rank's background save of the streamed state failed: the checkpoint is not marked complete."""


def clear_markers(directory: str, rank: int) -> None:
    """Remove this rank's markers of earlier saves into ``directory`` (the same iteration
    saved again, by this run or one before it), before the save hook starts a new one.
    A marker of this run's previous save written later is harmless: markers name their
    save (:func:`next_save_number`)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(_marker_prefix(rank)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def next_save_number() -> int:
    """The number of the asynchronous save the hook starts now: every rank counts its
    saves alike (each rank's hook runs for every save), so it names one save on all."""
    global _saves
    _saves += 1
    return _saves


class FinishStreamedSaves:
    """The finalize function of one asynchronous checkpoint's streamed state (see the module docstring)."""

    def __init__(self, pending: Sequence[PendingSave], directory: str, rank: int, world_size: int, number: int) -> None:
        self.pending = list(pending)
        self.directory = directory
        self.number = number
        self.rank = rank
        self.world_size = world_size
        self._state = SAVING
        self._failure: BaseException | None = None
        self._marked = False

    def __call__(self) -> None:
        found = _running_finalize_fns(self)
        if found is None:
            self.complete(block=True)
            return
        running, blocking = found
        at = next(i for i, fn in enumerate(running) if fn is self)
        # Kept before they leave Megatron's list (which it popped already): an interrupt
        # from here on leaves them deferred, never run early, never lost.
        _deferred.append((self, running[at + 1 :]))
        del running[at + 1 :]
        finish_deferred(block=blocking)
        if _deferred:
            logger.info(
                "the streamed optimizer state of %s is still being written: the checkpoint's remaining finalize "
                "functions (rank 0's marks it complete) wait for it, training goes on",
                self.directory,
            )

    def complete(self, block: bool) -> bool:
        """Whether every rank's saves of this checkpoint are complete; with ``block``,
        wait until they are. A collective: every rank calls it at the same point. Raises
        :class:`StreamedSaveError` on every rank where any rank's save failed, or, with
        ``block``, where a rank is still saving ``STRAGGLER_WAIT_S`` after another ended."""
        logged, straggling = time.monotonic(), 0
        while True:
            own = self._own_state()
            states = _exchange(NOTHING if not self.pending else own, self.rank, self.world_size)
            failed = [r for r, state in enumerate(states) if state == FAILED]
            if failed:
                raise self._error(failed)
            saving = [r for r, state in enumerate(states) if state == SAVING]
            if not saving:
                return True
            if not block:
                return False
            # Counted in polls, which every rank makes alike, so that all give up at the same one.
            straggling += SAVED in states
            if straggling * _POLL_S > STRAGGLER_WAIT_S:
                raise StreamedSaveError(
                    f"rank(s) {_ranks(saving)} still saving the streamed optimizer state of {self.directory} "
                    f"{STRAGGLER_WAIT_S:.0f} s after another rank's save ended: the checkpoint is not marked "
                    "complete, and the previous one stays the latest"
                )
            if self.rank == 0 and time.monotonic() - logged >= _LOG_EVERY_S:
                logged = time.monotonic()
                logger.info(
                    "waiting for rank(s) %s to finish saving the streamed state of %s", _ranks(saving), self.directory
                )
            time.sleep(_POLL_S)

    def complete_at_exit(self) -> None:
        """At exit, without collectives: wait for this rank's saves and leave its marker,
        then for every rank's. Raises :class:`StreamedSaveError` where this rank cannot
        tell that every rank's save is complete."""
        state = self._own_state(block=True)
        if not self._marked:
            self._mark()
        if state == FAILED:
            raise self._error([self.rank])
        _await_markers(self.directory, self.world_size, self.number, STRAGGLER_WAIT_S)

    def _own_state(self, block: bool = False) -> int:
        """This rank's state; once its saves ended (or, with ``block``, after waiting),
        final, and its marker written for the exit's agreement."""
        if self._state == SAVING and (block or all(save.done() for save in self.pending)):
            for save in self.pending:
                try:
                    save.wait()
                except Exception as exc:  # noqa: BLE001 - exchanged with the ranks, raised on all
                    self._failure = self._failure or exc
            self._state = FAILED if self._failure is not None else SAVED
            try:
                self._mark()
            except StreamedSaveError as exc:  # needed only at exit, which tries again
                logger.warning("%s", exc)
        return self._state

    def _mark(self) -> None:
        """Write this rank's marker of its ended saves (raises :class:`StreamedSaveError`)."""
        _write_marker(self.directory, self.rank, self.number, "saved" if self._state == SAVED else "failed")
        self._marked = True

    def _error(self, failed: list[int]) -> StreamedSaveError:
        own = f"rank {self.rank}: {self._failure}" if self._failure is not None else f"rank(s) {_ranks(failed)}"
        error = StreamedSaveError(
            f"the streamed optimizer state of {self.directory} was not saved ({own}): the checkpoint is not "
            "marked complete, and the previous one stays the latest"
        )
        error.__cause__ = self._failure
        return error


# Finalize functions waiting for their checkpoint's streamed state. The save hook finishes
# those of the previous checkpoint before it saves, so at most one checkpoint's wait.
_deferred: list[tuple[FinishStreamedSaves, list[Callable[[], Any]]]] = []


def finish_deferred(block: bool) -> None:
    """Run the deferred finalize functions of every checkpoint whose streamed state is
    complete on every rank, oldest first; with ``block``, wait for all. A collective, as
    :meth:`FinishStreamedSaves.complete`. A failed checkpoint's are dropped (its tracker
    is not written) and its error raised; on any other error they stay deferred."""
    while _deferred:
        finish, later = _deferred[0]
        try:
            if not finish.complete(block):
                return
        except StreamedSaveError:
            _deferred.pop(0)
            raise
        _run_in_turn(later)
        _deferred.pop(0)


def finish_before_steps(optimizer: Any) -> None:
    """Make ``optimizer.step`` (once per optimizer) first finish the deferred checkpoints
    whose streamed state is complete on every rank (a collective while any are deferred:
    every rank steps)."""
    if getattr(optimizer, _CHECKED_ATTR, False):
        return
    step = optimizer.step

    @functools.wraps(step)
    def step_after_deferred_saves(*args: Any, **kwargs: Any) -> Any:
        if _deferred:
            finish_deferred(block=False)
        return step(*args, **kwargs)

    optimizer.step = step_after_deferred_saves
    setattr(optimizer, _CHECKED_ATTR, True)


@atexit.register
def _finish_at_exit() -> None:
    """A run that ends with a checkpoint deferred (Megatron's last blocking finalize finds
    no request left) completes it here, through marker files: the background save
    threads were joined already. A failure is logged; the process's exit status stays
    its own (an exit handler cannot set one without cutting the other handlers short)."""
    if not _deferred:
        return
    for finish, later in list(_deferred):
        try:
            finish.complete_at_exit()
        except StreamedSaveError as exc:
            logger.error("at exit: %s", exc)
            _deferred.clear()  # nothing is marked past a checkpoint that could not be
            return
        _run_in_turn(later)
        _deferred.pop(0)


def _run_in_turn(fns: list[Callable[[], Any]]) -> None:
    """Run ``fns`` in order, each taken off the list only once it ran: an interrupt leaves
    the rest (and at worst the one it cut short, run again: the tracker's write is) for later."""
    while fns:
        fns[0]()
        del fns[0]


def _exchange(state: int, rank: int, world_size: int) -> list[int]:
    """Every rank's state, each rank giving its own: one all-reduce over the default group."""
    import torch  # noqa: PLC0415 - only here: the rest of this package stays torch-free

    if world_size == 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [state]
    # NCCL's where the group has it ("nccl", "cuda:nccl", "cpu:gloo,cuda:nccl"), else the CPU's.
    device = torch.cuda.current_device() if "nccl" in torch.distributed.get_backend() else "cpu"
    states = torch.zeros(world_size, dtype=torch.int32, device=device)
    states[rank] = state
    torch.distributed.all_reduce(states)
    return states.tolist()


def _running_finalize_fns(fn: FinishStreamedSaves) -> tuple[list, bool] | None:
    """The finalize-function list a caller is running ``fn`` from, found in the frame
    iterating it (megatron-core's ``AsyncCallsQueue.maybe_finalize_async_calls`` and
    NVRx's: ``for finalize_fn in async_request.finalize_fns``), and whether that caller
    blocks; None for any other caller."""
    frame = sys._getframe(2)
    while frame is not None:
        names = frame.f_locals
        if names.get("finalize_fn") is fn:
            for value in names.values():
                fns = getattr(value, "finalize_fns", None)
                if isinstance(fns, list) and any(f is fn for f in fns):
                    return fns, names.get("blocking") is not False
            return None
        frame = frame.f_back
    return None


def _marker_prefix(rank: int) -> str:
    return f".rank{rank:05d}."


def _marker(directory: str, rank: int, number: int, what: str) -> str:
    return os.path.join(directory, f"{_marker_prefix(rank)}save{number}.{what}")


def _write_marker(directory: str, rank: int, number: int, what: str) -> None:
    path = _marker(directory, rank, number, what)
    try:
        os.makedirs(directory, exist_ok=True)  # a rank whose chain holds no params saved nothing there
        with open(path, "w") as f:
            f.write(f"pid {os.getpid()}\n")
    except OSError as exc:
        raise StreamedSaveError(
            f"cannot write {path} ({exc.strerror}): the other ranks cannot learn at exit that rank {rank}'s "
            "streamed optimizer state is saved, and do not mark the checkpoint complete"
        ) from exc


def _await_markers(directory: str, world_size: int, number: int, timeout_s: float) -> None:
    """Wait until every rank's ``.saved`` marker is in ``directory`` (one listing per
    look), at most ``timeout_s``; raise where one rank's ``.failed`` is, or on timeout."""
    start = logged = time.monotonic()
    while True:
        try:
            names = set(os.listdir(directory))
        except OSError as exc:
            raise StreamedSaveError(
                f"cannot list {directory} ({exc.strerror}): the checkpoint is not marked complete"
            ) from exc
        failed = [r for r in range(world_size) if os.path.basename(_marker(directory, r, number, "failed")) in names]
        if failed:
            raise StreamedSaveError(
                f"the streamed optimizer state of {directory} was not saved on rank(s) {_ranks(failed)}: the "
                "checkpoint is not marked complete, and the previous one stays the latest"
            )
        missing = [
            r for r in range(world_size) if os.path.basename(_marker(directory, r, number, "saved")) not in names
        ]
        if not missing:
            return
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise StreamedSaveError(
                f"rank(s) {_ranks(missing)} did not say within {timeout_s:.0f} s that the streamed optimizer state "
                f"of {directory} is saved: the checkpoint is not marked complete, and the previous one stays the latest"
            )
        if time.monotonic() - logged >= _LOG_EVERY_S:
            logged = time.monotonic()
            logger.info(
                "at exit: waiting for rank(s) %s to finish saving the streamed state of %s", _ranks(missing), directory
            )
        time.sleep(_POLL_S)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
