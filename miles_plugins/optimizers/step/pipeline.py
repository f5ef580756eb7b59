"""The bucket walker: moves buckets between storage and the device, a few at a time.

A bucket in flight is a :class:`Flight`. :meth:`Pipeline.walk` takes every
bucket through

    fetch    materialize its fp32 mains and moments, read their stored bytes
             (the engine), decode them in place; or, where the home lends its
             bytes and they are the fp32 values (the gpu home), share them;
    visit    the caller's work on the materialized bucket (the Adam update);
    store    encode in place and submit the writes (the engine);
    retire   wait for the writes, release the bucket's device memory.

Reads of the next buckets and writes of the previous ones overlap the current
bucket's visit. At most ``depth`` buckets are materialized at once (the
computing one, the ones read ahead, the ones still writing), so optimizer state
on the device is bounded by ``depth`` times the largest bucket; the sync engine
runs with ``depth`` 1. A bucket that materializes nothing (every tensor shares
its home's bytes: :meth:`Pipeline.lends_all`) is not counted and waits for no
room. The walk never waits for the newest write: each bucket's update and write
queue behind it, so the writes run back to back; a read ahead starts at a
bucket boundary, once every write but the newest has finished (one that
materializes nothing, at once).
``prefetch()`` starts the first reads before the walk.

Across the step boundary (the store's overlap window): ``walk(defer=...)`` leaves
the named buckets encoded on the device with their writes not yet submitted;
``land()`` submits them and retires those done, so they run during the caller's
next forward; ``prefetch(window_bytes)`` reads more than ``depth`` buckets ahead,
as the landed writes make room, never past a bucket still landing (a bucket is
read only after its last write). The next walk waits for each bucket's landing
just before reading it, so the writes still landing run beside its reads (on a
drive, waiting for all of them first would leave it writing alone, then reading
alone); a failed one raises :class:`LandingError`.

The walker knows nothing of Adam, rollback or checkpoints (the store's
concerns); on a failure it stops every transfer it started and re-raises.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from miles_plugins.optimizers.errors import StreamIOTimeout
from miles_plugins.optimizers.formats.layout import MOMENT_SEGMENTS, BucketLayout
from miles_plugins.optimizers.homes.engines import Ticket, Transfer
from miles_plugins.optimizers.step.bucket_optimizer import BucketOptimizer
from miles_plugins.optimizers.step.codec import Codec, stored_bytes
from miles_plugins.optimizers.step.entries import Entry, StepStats


class LandingError(RuntimeError):
    """A deferred write failed (its cause is the transfer's error), found by
    :meth:`Pipeline.land` or by a walk waiting for it: that walk's state is not
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
class Flight:
    """One bucket between its fetch and its retirement.

    ``converts`` are (segment name, entry, tensor) a read fills in their stored
    format, to be decoded once it is done. ``shared`` are the tensors that share
    their home's bytes for the visit instead of a copy (the gpu home's fp32-stored
    ones: ``BufferHandle.view_of``), each with a detached alias of the (empty)
    storage it had, which it gets back when the flight is released. ``holds_memory``:
    False for a bucket whose every tensor shares its home's bytes (``Pipeline.lends_all``):
    it takes no room among the ``depth`` buckets in flight.
    """

    bucket: BucketLayout
    optimizer: BucketOptimizer
    entries: list[Entry]
    handle: object = None
    reads: Ticket | None = None
    writes: Ticket | None = None
    # A deferred write (walk's ``defer``): its transfers and the event after its
    # encoding, until ``land()`` submits them.
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


class Pipeline:
    """Walks ``buckets`` through the backing and the engine, ``depth`` at a time.

    Args:
        entries: the store's entries (buckets index into them).
        buckets, optimizers: the layout and each bucket's optimizer.
        backing, engine: where the bytes live and how they move (``homes/backings.py``, ``homes/engines.py``).
        codec: the storage formats.
        depth: the most buckets materialized at once.
        device: where buckets are materialized (CUDA ordering uses events).
        io_timeout_s: what an abort after a failure may still wait, in total.
        drain_before: the first bucket whose update cannot be undone (written in
            place); the walk waits for every write before it is visited, so a
            failure of those surfaces while the step can still be rolled back.
            None: no such bucket.
    """

    def __init__(
        self,
        entries: Sequence[Entry],
        buckets: Sequence[BucketLayout],
        optimizers: Sequence[BucketOptimizer],
        backing,
        engine,
        codec: Codec,
        depth: int,
        device: torch.device,
        io_timeout_s: float,
        drain_before: int | None = None,
    ) -> None:
        self.entries, self.buckets, self.optimizers = entries, buckets, optimizers
        self.drain_before = drain_before
        self.backing, self.engine, self.codec = backing, engine, codec
        self.depth, self.device, self.io_timeout_s = depth, device, io_timeout_s
        self.accounting = StateAccounting()
        # Set once transfers hung: their memory may still be written and is abandoned,
        # so the store must not run again (it checks this flag). ``hang_cause``: set
        # where it was not a timeout.
        self.hung = False
        self.hang_cause: str | None = None
        # Buckets whose reads prefetch() started, and what those reads moved.
        self._prefetched: deque[Flight] = deque()
        self._prefetch_stats = StepStats()
        # Buckets a walk left with deferred writes, oldest first (see land()).
        self.landing: deque[Flight] = deque()

    # ---- the walk ------------------------------------------------------------------

    def walk(
        self,
        visit: Callable[[Flight], None],
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
        ``defer``: indices of buckets whose writes wait for :meth:`land` (they stay
        materialized, outside the ``depth`` count, in :attr:`landing` once the walk is done).
        The deferred writes of the walk before may still be landing: each is waited for
        just before its bucket is read (:meth:`fetch`).
        On a failure every flight of this walk is aborted (:meth:`abort`), those of
        ``defer`` too, and the error re-raised; the writes of the walk before stay in
        :attr:`landing`, theirs being the stored state (unless one of them failed:
        :class:`LandingError`, and :meth:`land` aborted them all).
        """
        if mains_only and self.landing:
            raise RuntimeError(
                f"a walk rewriting mains with {len(self.landing)} deferred writes still pending: its writes "
                "would race theirs (the store lands them first)"
            )
        ahead = deque() if mains_only else self._take_prefetched(stats)
        writing: deque[Flight] = deque()
        deferred: deque[Flight] = deque()
        current = None
        try:
            for index in range(len(self.buckets)):
                if mains_only:
                    self._make_room(ahead, writing)
                    current = self._open(index, in_place=True)
                    for k in range(len(current.entries)):
                        for name, main in current.tensors(k, False):
                            if not self._share(current, name, k, main):
                                self.accounting.materialize(main)
                else:
                    # This bucket and the next ones, waiting for every write but the newest: this
                    # update (and its write) queue behind the write still running, so the writing
                    # direction never idles for an update, and the next read starts as the write
                    # before it finishes. Further ahead only as far as finished writes allow,
                    # except at the first bucket written in place, where every write before it is
                    # waited for anyway: the buckets after it are fetched (allocated, read) first,
                    # so a failure there comes while the step can still be rolled back.
                    self._read_ahead(index, index + max(0, self.depth - 2), ahead, writing, stats)
                    drain = index == self.drain_before
                    self._read_ahead(index, index + self.depth - 1, ahead, writing, stats, wait=drain)
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
            # After a timeout (a deferred write's too) nothing more is waited for: the deadline has
            # passed (after a hang land() found, abort() waits for nothing either).
            timed_out = isinstance(exc, StreamIOTimeout) or isinstance(exc.__cause__, StreamIOTimeout)
            wait_s = 0.0 if timed_out else self.io_timeout_s
            self.abort([*ahead, *writing, *deferred, *([current] if current else [])], wait_s)
            raise
        # Every bucket was read, so the earlier deferred writes have all landed: the
        # oldest first holds all the same.
        self.landing.extend(deferred)

    def land(self, block: bool = False, through: int | None = None) -> None:
        """Move the deferred writes along: submit those not yet submitted, then retire
        (wait for and release) the oldest while done; with ``block`` all of them, with
        ``through`` at least those up to bucket ``through``'s.
        On an error the rest are aborted and :class:`LandingError` raised; an interrupt
        leaves them pending for a later call."""

        def wanted(flight: Flight) -> bool:
            return block or flight.writes is None or flight.writes.done() or self._landing(through)

        try:
            for flight in self.landing:
                # ``held`` is cleared only once submitted: an interrupt before leaves it to
                # submit again. One after the ticket is recorded leaves both; the ticket is then
                # the write (what is held is never read again), and submitting again would lose
                # a running write's ticket.
                if flight.held is not None and flight.writes is None:
                    flight.writes = self.engine.write(flight.handle, *flight.held, beside_training=True)
                    flight.held = None
            while self.landing and wanted(self.landing[0]):
                self._retire_oldest(self.landing)
        except Exception as exc:
            landing, self.landing = list(self.landing), deque()
            self.abort(landing, 0.0 if isinstance(exc, StreamIOTimeout) else self.io_timeout_s)
            raise LandingError(f"a deferred write failed: {exc}") from exc

    def _landing(self, index: int | None) -> bool:
        """Whether bucket ``index``'s deferred write is still in :attr:`landing`."""
        return index is not None and any(flight.bucket.index == index for flight in self.landing)

    def drop_landing(self) -> None:
        """Forget the deferred writes (the step that made them failed, or the state is
        being deleted): those never submitted are released at once, the others once
        no transfer touches their memory (not waited for after a hang)."""
        landing, self.landing = list(self.landing), deque()
        for flight in landing:
            flight.held = None
        self.abort(landing, self.io_timeout_s)

    @contextlib.contextmanager
    def read_one(self, index: int, moments: bool = True) -> Iterator[Flight]:
        """Bucket ``index`` materialized and read, or sharing its home's bytes (one at a
        time), released afterwards."""
        flight = self.fetch(index, StepStats(), moments)
        wait_s = self.io_timeout_s
        try:
            self.finish_fetch(flight)
            yield flight
        except StreamIOTimeout:
            wait_s = 0.0  # the deadline has passed: do not wait for it again
            raise
        finally:
            self.abort([flight], wait_s)

    # ---- prefetch --------------------------------------------------------------------

    def prefetch(self, window_bytes: int = 0, window_only: bool = False) -> None:
        """Start, or extend, reading the first buckets of the next walk: ``depth`` of
        them, or more while their materialized bytes fit ``window_bytes`` (only those
        with ``window_only``). Buckets still in :attr:`landing` count against the
        window, and the reads stop before the first of them: a bucket is read
        only after its last write has landed."""
        landing = {f.bucket.index: f.bucket.materialized_bytes for f in self.landing}
        fit = len(leading_fit(self.buckets, window_bytes - sum(landing.values())))
        count = min(fit if window_only else max(self.depth, fit), min(landing, default=len(self.buckets)))
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

    def _take_prefetched(self, stats: StepStats) -> deque[Flight]:
        stats.add(self._prefetch_stats)
        ahead, self._prefetched, self._prefetch_stats = self._prefetched, deque(), StepStats()
        return ahead

    # ---- one bucket's fetch and store ------------------------------------------------

    def _open(self, index: int, in_place: bool) -> Flight:
        bucket = self.buckets[index]
        flight = Flight(bucket, self.optimizers[index], [self.entries[i] for i in bucket.entry_indices])
        flight.handle = self.backing.open(bucket, in_place=in_place)
        return flight

    def fetch(self, index: int, stats: StepStats, moments: bool = True, beside_training: bool = False) -> Flight:
        """Materialize bucket ``index``'s mains (and moments) and submit their reads
        (``beside_training``: between steps, see ``PipelinedEngine``). A stored
        format other than fp32 lands in the first bytes of the tensor's own
        storage, decoded in place by :meth:`finish_fetch`; an fp32 one the home
        lends (the gpu home's) is shared instead (:meth:`_share`)."""
        if self._landing(index):
            self.land(through=index)  # a bucket is read only after its last write has landed
        holds_memory = not self.lends_all(index)  # before any tensor shares: then they hold its bytes
        flight = self._open(index, in_place=False)  # nothing materialized yet if this fails
        flight.holds_memory = holds_memory
        try:
            transfers: list[Transfer] = []
            for k in range(len(flight.entries)):
                for name, tensor in flight.tensors(k, moments):
                    segment = flight.bucket.segments[name]
                    stats.bytes_read += segment.entry_nbytes[k]
                    if self._share(flight, name, k, tensor):
                        continue  # its home's bytes: nothing to read
                    self.accounting.materialize(tensor)
                    flight.holds_memory = True  # lends_all foresees this; counted whatever it said
                    if self.codec.converts(segment, tensor):
                        flight.converts.append((name, k, tensor))
                    transfers.append((segment.entry_offsets[k], stored_bytes(tensor, segment)))
            # The engine's copies wait for everything queued on this stream so far:
            # fresh blocks from the caching allocator may still be in use there.
            flight.reads = self.engine.read(flight.handle, transfers, self._ready_event(), beside_training)
        except BaseException:
            self.abort([flight], self.io_timeout_s)
            raise
        return flight

    def finish_fetch(self, flight: Flight) -> None:
        flight.reads.wait()
        flight.reads = None
        segments, entries = flight.bucket.segments, flight.entries
        self.codec.decode(
            flight.bucket, [(segments[name], k, tensor, entries[k].param) for name, k, tensor in flight.converts]
        )
        flight.converts.clear()

    def store(self, flight: Flight, stats: StepStats, moments: bool = True, submit: bool = True) -> None:
        """Encode the bucket's mains (and moments) in place and submit their writes
        (or, without ``submit``, hold them for :meth:`land`).
        Encoding runs on the device, before the host copy: a same-dtype
        device->host copy is far faster than a converting one. The fp32 values
        are gone afterwards; the bucket is released when retired."""
        items = [
            (flight.bucket.segments[name], k, tensor, entry.param)
            for k, entry in enumerate(flight.entries)
            for name, tensor in flight.tensors(k, moments)
        ]
        self.codec.encode(flight.bucket, items)
        shared = {id(tensor) for tensor, _ in flight.shared}
        transfers: list[Transfer] = []
        for segment, k, tensor, _ in items:
            stats.bytes_written += segment.entry_nbytes[k]
            if id(tensor) not in shared:  # a shared tensor was updated in its home's bytes
                transfers.append((segment.entry_offsets[k], stored_bytes(tensor, segment)))
        # The engine copies on its own streams (its threads', or its copy streams for
        # pinned host memory), after the update and the encoding queued on this one.
        if submit:
            flight.writes = self.engine.write(flight.handle, transfers, self._ready_event())
        else:
            flight.held = (transfers, self._ready_event())
        stats.buckets += 1

    def _ready_event(self) -> torch.cuda.Event | None:
        """An event on the caller's stream after everything queued so far (CUDA only)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def lends_all(self, index: int) -> bool:
        """Whether fetching bucket ``index`` (mains and moments) materializes nothing:
        every tensor will share its home's bytes (:meth:`_share`: stored as fp32 in a
        home that lends them, moments the optimizer already made, no values of their own)."""
        bucket = self.buckets[index]
        if bucket.converted_bytes or not self.backing.lends(bucket, self.device):
            return False
        optimizer = self.optimizers[index]
        for i in bucket.entry_indices:
            main = self.entries[i].main
            state = optimizer.moments(main)
            if state is None:  # the step creates them: memory of their own
                return False
            tensors = [main, *state] if bucket.streams_main else state
            if any(t.untyped_storage().nbytes() for t in tensors):
                return False
        return True

    def _make_room(
        self, ahead: deque[Flight], writing: deque[Flight], room: int | None = None, wait: bool = True
    ) -> bool:
        """Retire the oldest writes until another bucket may be materialized (at most
        ``room`` holding memory in flight, default ``depth``; buckets that share their
        home's bytes take none); False when the buckets in flight are all still being
        read or computed, or (without ``wait``) the oldest write is still running."""
        while sum(f.holds_memory for f in ahead) + sum(f.holds_memory for f in writing) >= (room or self.depth):
            if not writing or not (wait or writing[0].writes is None or writing[0].writes.done()):
                return False
            self._retire_oldest(writing)
        return True

    def _read_ahead(
        self,
        first: int,
        last: int,
        ahead: deque[Flight],
        writing: deque[Flight],
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

    def _retire_oldest(self, writing: deque[Flight]) -> None:
        """Wait for the oldest bucket's writes, then release its device memory. It
        leaves ``writing`` only then: after a failure the caller still aborts it."""
        flight = writing[0]
        if flight.writes is not None:  # None: an interrupt came after the wait
            flight.writes.wait()
            flight.writes = None
        self._release(flight)  # before it leaves: an interrupt then cannot leak its memory
        writing.popleft()

    def _share(self, flight: Flight, name: str, k: int, tensor: torch.Tensor) -> bool:
        """Give ``tensor`` (entry ``k``'s, of segment ``name``) its home's bytes, where the
        home lends them, its stored form is its fp32 bytes, and it holds no values of its
        own (a main Megatron built is written to the home from its own storage, once);
        False where it must be materialized and copied instead."""
        segment = flight.bucket.segments[name]
        if self.codec.converts(segment, tensor) or tensor.untyped_storage().nbytes():
            return False
        view = flight.handle.view_of(segment.entry_offsets[k], tensor)
        if view is None:
            return False
        flight.shared.append((tensor, tensor.detach()))  # first: a release then restores it
        tensor.data = view
        return True

    def _release(self, flight: Flight) -> None:
        # The shared tensors first get their own (empty) storage back: the home's must
        # never be resized or freed through them.
        for tensor, own in flight.shared:
            tensor.data = own
        flight.shared.clear()
        for entry in flight.entries:
            if flight.bucket.streams_main:  # else the main is an fp32 param, which stays
                self.accounting.release(entry.main)
            for moment in flight.optimizer.moments(entry.main) or ():
                self.accounting.release(moment)
        flight.converts.clear()
        handle, flight.handle = flight.handle, None  # forgotten first: a failed close is never retried
        if handle is not None:
            handle.close()

    def abort(self, flights: Sequence[Flight], wait_s: float) -> bool:
        """Stop using ``flights`` after a failure or when their state is not needed:
        wait until no transfer touches their memory, then release it. All the
        waits share one deadline, ``wait_s`` from now (now, once :attr:`hung`:
        the stalled drive holds these transfers too, and the store refuses anyway). Errors of the transfers
        themselves were (or will be) reported by their owner. Returns True (and
        sets :attr:`hung`) when some transfers are still running at the
        deadline: their flights' memory is then left allocated, since a late
        transfer may still write into it. An interrupt during a wait is raised
        once every flight is handled, the waited-for one counted as hung. A
        release that fails or is interrupted does not stop the others; the first
        such error is raised once all are handled, with :attr:`hung` set (that
        flight's tensors may still share its home's bytes: the store must not go on)."""
        deadline = time.monotonic() + (0.0 if self.hung else wait_s)
        hung = False
        interrupt: BaseException | None = None
        failed_release: BaseException | None = None
        for flight in flights:
            stuck = False
            for ticket in (flight.reads, flight.writes):
                if ticket is None:
                    continue
                try:
                    ticket.wait(max(0.0, deadline - time.monotonic()))
                except StreamIOTimeout:
                    stuck = True
                except Exception:  # noqa: BLE001 - reported by the transfer's owner
                    pass
                except BaseException as exc:
                    # An interrupt (a second Ctrl-C) during the wait: the transfer may still
                    # run, so it counts as hung, and nothing more is waited for.
                    stuck, interrupt, deadline = True, interrupt or exc, time.monotonic()
            if stuck:
                hung = True
                continue
            flight.reads = flight.writes = flight.held = None
            try:
                self._release(flight)
            except BaseException as exc:  # an interrupt, or a handle's close failing
                failed_release = failed_release or exc
        if failed_release is not None and not self.hung:
            self.hang_cause = (
                f"releasing a bucket's device memory was cut short ({type(failed_release).__name__}: {failed_release})"
            )
        elif interrupt is not None and not self.hung:
            self.hang_cause = f"an interrupt ({type(interrupt).__name__}) cut short the wait for transfers in flight"
        self.hung = self.hung or hung or failed_release is not None
        if interrupt is not None or failed_release is not None:
            raise interrupt or failed_release
        return hung
