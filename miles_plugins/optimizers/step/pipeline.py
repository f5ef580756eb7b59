"""The bucket walker: takes every bucket through the mover, a few at a time.

:meth:`Pipeline.walk` takes every bucket through

    fetch    materialize its fp32 mains and moments and read them (``mover.py``);
    visit    the caller's work on the materialized bucket (the Adam update);
    store    encode in place and submit the writes;
    retire   wait for the writes, release the bucket's device memory.

Reads of the next buckets and writes of the previous ones overlap the current
bucket's visit. At most ``max_in_flight`` buckets are materialized at once (the
computing one, the ones read ahead, the ones still writing), so optimizer state
on the device is bounded by ``max_in_flight`` times the largest bucket; the sync engine
runs with ``max_in_flight`` 1. A bucket that materializes nothing (every tensor shares
its home's bytes: :meth:`~miles_plugins.optimizers.step.mover.BucketMover.lends_all`)
is not counted and waits for no room. The walk never waits for the newest write:
each bucket's update and write queue behind it, so the writes run back to back;
a read ahead starts at a bucket boundary, once every write but the newest has
finished (one that materializes nothing, at once).
``prefetch()`` starts the first reads before the walk.

Across the step boundary (the store's overlap window): ``walk(defer=...)`` leaves
the named buckets encoded on the device with their writes not yet submitted;
``advance_deferred_writes()`` submits them and retires those done, so they run during the caller's
next forward; ``prefetch(window_bytes)`` reads more than ``max_in_flight`` buckets ahead,
as the landed writes make room, never past a bucket still landing (a bucket is
read only after its last write). The next walk waits for each bucket's landing
just before reading it, so the writes still landing run beside its reads (on a
drive, waiting for all of them first would leave it writing alone, then reading
alone); a failed one raises :class:`DeferredWriteError`.

The walker knows nothing of Adam, rollback or checkpoints (the store's
concerns); on a failure it stops every transfer it started and re-raises.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from miles_plugins.optimizers.errors import StreamIOTimeout
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.step.bucket_optimizer import BucketOptimizer
from miles_plugins.optimizers.step.codec import Codec
from miles_plugins.optimizers.step.entries import Entry, StepStats
from miles_plugins.optimizers.step.flight import BucketInFlight
from miles_plugins.optimizers.step.mover import BucketMover

if TYPE_CHECKING:
    from miles_plugins.optimizers.homes.protocols import Backing, Engine


class DeferredWriteError(RuntimeError):
    """A deferred write failed (its cause is the transfer's error), found by
    :meth:`Pipeline.advance_deferred_writes` or by a walk waiting for it: that walk's state is not
    the stored one. The store reports it naming the step that wrote it."""


def leading_fit(buckets: Sequence[BucketLayout], nbytes: int) -> list[BucketLayout]:
    """The longest run of ``buckets``, from the first, whose materialized bytes fit ``nbytes``."""
    run, total = [], 0
    for bucket in buckets:
        total += bucket.materialized_bytes
        if total > nbytes:
            break
        run.append(bucket)
    return run


class Pipeline(BucketMover):
    """Walks ``buckets`` through the backing and the engine, ``max_in_flight`` at a time.

    Args:
        depth: the most buckets materialized at once.
        drain_before: the first bucket whose update cannot be undone (written in
            place); the walk waits for every write before it is visited, so a
            failure of those surfaces while the step can still be rolled back.
            None: no such bucket.
        entries, buckets, optimizers, backing, engine, codec, device, io_timeout_s:
            the mover's (:class:`~miles_plugins.optimizers.step.mover.BucketMover`).
    """

    def __init__(
        self,
        *,
        entries: Sequence[Entry],
        buckets: Sequence[BucketLayout],
        optimizers: Sequence[BucketOptimizer],
        backing: Backing,
        engine: Engine,
        codec: Codec,
        device: torch.device,
        io_timeout_s: float,
        max_in_flight: int,
        drain_before: int | None = None,
    ) -> None:
        super().__init__(
            entries=entries,
            buckets=buckets,
            optimizers=optimizers,
            backing=backing,
            engine=engine,
            codec=codec,
            device=device,
            io_timeout_s=io_timeout_s,
        )
        self.max_in_flight, self.drain_before = max_in_flight, drain_before
        # Buckets whose reads prefetch() started, and what those reads moved.
        self._prefetched: deque[BucketInFlight] = deque()
        self._prefetch_stats = StepStats()
        # Buckets a walk left with deferred writes, oldest first (see advance_deferred_writes()).
        self.deferred_writes: deque[BucketInFlight] = deque()
        # A wait the caller asks for before each bucket is fetched, given its index: a
        # background save that has yet to copy the bytes the bucket's writes would change.
        self.before_fetch: Callable[[int], None] | None = None

    # ---- the walk ------------------------------------------------------------------

    def walk(
        self,
        visit: Callable[[BucketInFlight], None],
        stats: StepStats,
        *,
        mains_only: bool = False,
        defer: frozenset[int] = frozenset(),
    ) -> None:
        """Take every bucket through fetch, ``visit``, store and retire (see the
        module docstring), adding what moved to ``stats``.

        ``mains_only``: nothing is read; each bucket's mains are materialized
        (or share their home's bytes: :meth:`_share`) for ``visit`` to fill, and
        written back to the slot they were read from (rewriting mains outside a
        step; the moments stay as they are).
        ``defer``: indices of buckets whose writes wait for :meth:`advance_deferred_writes` (they stay
        materialized, outside the ``max_in_flight`` count, in :attr:`deferred_writes` once the walk is done).
        The deferred writes of the walk before may still be landing: each is waited for
        just before its bucket is read (:meth:`fetch`).
        On a failure every flight of this walk is aborted (:meth:`abort`), those of
        ``defer`` too, and the error re-raised; the writes of the walk before stay in
        :attr:`deferred_writes`, theirs being the stored state (unless one of them failed:
        :class:`DeferredWriteError`, and :meth:`advance_deferred_writes` aborted them all).
        """
        if mains_only and self.deferred_writes:
            raise RuntimeError(
                f"a walk rewriting mains with {len(self.landing)} deferred writes still pending: its writes "
                "would race theirs (the store lands them first)"
            )
        ahead = deque() if mains_only else self._take_prefetched(stats)
        writing: deque[BucketInFlight] = deque()
        deferred: deque[BucketInFlight] = deque()
        current = None
        try:
            for index in range(len(self.buckets)):
                if mains_only:
                    self._make_room(ahead, writing)
                    current = self._open(index, in_place=True)
                    self._materialize_mains(current)
                else:
                    self._read_ahead_of(index, ahead, writing, stats)
                    current = ahead.popleft()
                    self.finish_fetch(current)
                    if index == self.drain_before:
                        while writing:
                            self._retire_oldest(writing)
                visit(current)
                held = index in defer
                self.store(current, stats, moments=not mains_only, submit=not held)
                (deferred if held else writing).append(current)
                current = None
            while writing:
                self._retire_oldest(writing)
        except BaseException as exc:
            self.abort([*ahead, *writing, *deferred, *([current] if current else [])], self._abort_wait(exc))
            raise
        # Every bucket was read, so the earlier deferred writes have all landed: the
        # oldest first holds all the same.
        self.deferred_writes.extend(deferred)

    def _abort_wait(self, exc: BaseException) -> float:
        """How long aborting a walk that failed with ``exc`` may wait: nothing after a
        timeout (a deferred write's too), whose deadline has passed (after a hang
        ``advance_deferred_writes()`` found, ``abort()`` waits for nothing either)."""
        timed_out = isinstance(exc, StreamIOTimeout) or isinstance(exc.__cause__, StreamIOTimeout)
        return 0.0 if timed_out else self.io_timeout_s

    def _materialize_mains(self, flight: BucketInFlight) -> None:
        """Give the flight's mains storage of their own, or their home's bytes, for a
        ``mains_only`` walk to fill (nothing is read)."""
        for k in range(len(flight.entries)):
            for name, main in flight.tensors(k, False):
                if not self._share(flight, name, k, main):
                    self.accounting.materialize(main)

    def _read_ahead_of(
        self, index: int, ahead: deque[BucketInFlight], writing: deque[BucketInFlight], stats: StepStats
    ) -> None:
        """Fetch bucket ``index`` and the next ones, waiting for every write but the newest:
        this update (and its write) queue behind the write still running, so the writing
        direction never idles for an update, and the next read starts as the write
        before it finishes. Further ahead only as far as finished writes allow, except
        at the first bucket written in place, where every write before it is waited for
        anyway: the buckets after it are fetched (allocated, read) first, so a failure
        there comes while the step can still be rolled back."""
        self._read_ahead(index, index + max(0, self.max_in_flight - 2), ahead, writing, stats)
        drain = index == self.drain_before
        self._read_ahead(index, index + self.max_in_flight - 1, ahead, writing, stats, wait=drain)

    def fetch(
        self, index: int, stats: StepStats, moments: bool = True, beside_training: bool = False
    ) -> BucketInFlight:
        """:meth:`BucketMover.fetch`, once bucket ``index``'s last write has landed (and
        :attr:`before_fetch` has returned)."""
        if self.before_fetch is not None:
            self.before_fetch(index)
        if self._has_deferred_write(index):
            self.advance_deferred_writes(through=index)  # a bucket is read only after its last write has landed
        return super().fetch(index, stats, moments, beside_training)

    def _make_room(
        self, ahead: deque[BucketInFlight], writing: deque[BucketInFlight], room: int | None = None, wait: bool = True
    ) -> bool:
        """Retire the oldest writes until another bucket may be materialized (at most
        ``room`` holding memory in flight, default ``max_in_flight``; buckets that share their
        home's bytes take none); False when the buckets in flight are all still being
        read or computed, or (without ``wait``) the oldest write is still running."""
        while sum(f.holds_memory for f in ahead) + sum(f.holds_memory for f in writing) >= (room or self.max_in_flight):
            if not writing or not (wait or writing[0].writes is None or writing[0].writes.done()):
                return False
            self._retire_oldest(writing)
        return True

    def _read_ahead(
        self,
        first: int,
        last: int,
        ahead: deque[BucketInFlight],
        writing: deque[BucketInFlight],
        stats: StepStats,
        room: int | None = None,
        wait: bool = True,
        beside_training: bool = False,
    ) -> None:
        """Start fetching buckets ``first`` to ``last``, after those in ``ahead``,
        while the buckets in flight allow it (``_make_room``, waiting for writes to
        finish only with ``wait``); one that materializes nothing needs no room."""
        started = (ahead[-1].bucket.index + 1) if ahead else first
        for index in range(started, min(last, len(self.buckets) - 1) + 1):
            # A bucket that shares its home's bytes needs no room: it is not held up behind
            # the writes of the buckets before it (the gpu home's, after the host ones').
            if not self.lends_all(index) and not self._make_room(ahead, writing, room, wait):
                return
            ahead.append(self.fetch(index, stats, beside_training=beside_training))

    def _retire_oldest(self, writing: deque[BucketInFlight]) -> None:
        """Wait for the oldest bucket's writes, then release its device memory. It
        leaves ``writing`` only then: after a failure the caller still aborts it."""
        flight = writing[0]
        if flight.writes is not None:  # None: an interrupt came after the wait
            flight.writes.wait()
            flight.writes = None
        self._release(flight)  # before it leaves: an interrupt then cannot leak its memory
        writing.popleft()

    # ---- the deferred writes ----------------------------------------------------------

    def advance_deferred_writes(self, block: bool = False, through: int | None = None) -> None:
        """Move the deferred writes along: submit those not yet submitted, then retire
        (wait for and release) the oldest while done; with ``block`` all of them, with
        ``through`` at least those up to bucket ``through``'s.
        On an error the rest are aborted and :class:`DeferredWriteError` raised; an interrupt
        leaves them pending for a later call."""

        def wanted(flight: BucketInFlight) -> bool:
            return block or flight.writes is None or flight.writes.done() or self._has_deferred_write(through)

        try:
            for flight in self.deferred_writes:
                # ``held`` is cleared only once submitted: an interrupt before leaves it to
                # submit again. One after the pending transfers are recorded leaves both; they are then
                # the write (what is held is never read again), and submitting again would lose
                # a running write's pending transfers.
                if flight.held is not None and flight.writes is None:
                    flight.writes = self.engine.write(flight.handle, *flight.held, beside_training=True)
                    flight.held = None
            while self.deferred_writes and wanted(self.deferred_writes[0]):
                self._retire_oldest(self.deferred_writes)
        except Exception as exc:
            deferred_writes, self.deferred_writes = list(self.deferred_writes), deque()
            self.abort(deferred_writes, 0.0 if isinstance(exc, StreamIOTimeout) else self.io_timeout_s)
            raise DeferredWriteError(f"a deferred write failed: {exc}") from exc

    def _has_deferred_write(self, index: int | None) -> bool:
        """Whether bucket ``index``'s deferred write is still in :attr:`deferred_writes`."""
        return index is not None and any(flight.bucket.index == index for flight in self.deferred_writes)

    def drop_deferred_writes(self) -> None:
        """Forget the deferred writes (the step that made them failed, or the state is
        being deleted): those never submitted are released at once, the others once
        no transfer touches their memory (not waited for after a hang)."""
        deferred_writes, self.deferred_writes = list(self.deferred_writes), deque()
        for flight in deferred_writes:
            flight.held = None
        self.abort(deferred_writes, self.io_timeout_s)

    # ---- prefetch --------------------------------------------------------------------

    def prefetch(self, window_bytes: int = 0, window_only: bool = False) -> None:
        """Start, or extend, reading the first buckets of the next walk: ``max_in_flight`` of
        them, or more while their materialized bytes fit ``window_bytes`` (only those
        with ``window_only``). Buckets still in :attr:`deferred_writes` count against the
        window, and the reads stop before the first of them: a bucket is read
        only after its last write has landed."""
        deferred_writes = {f.bucket.index: f.bucket.materialized_bytes for f in self.deferred_writes}
        fit = len(leading_fit(self.buckets, window_bytes - sum(deferred_writes.values())))
        count = min(
            fit if window_only else max(self.max_in_flight, fit), min(deferred_writes, default=len(self.buckets))
        )
        if count <= len(self._prefetched):
            return
        try:
            # The window's reads run during forward and backward; a plain prefetch just before the step.
            self._read_ahead(
                0, count - 1, self._prefetched, deque(), self._prefetch_stats, count, beside_training=window_only
            )
        except BaseException:
            self.drop_prefetch()
            raise

    def drop_prefetch(self) -> None:
        """Forget prefetched buckets (their bytes are about to change, or are not needed)."""
        flights, self._prefetched = self._prefetched, deque()
        self._prefetch_stats = StepStats()
        self.abort(flights, self.io_timeout_s)

    def _take_prefetched(self, stats: StepStats) -> deque[BucketInFlight]:
        stats.add(self._prefetch_stats)
        ahead, self._prefetched, self._prefetch_stats = self._prefetched, deque(), StepStats()
        return ahead
