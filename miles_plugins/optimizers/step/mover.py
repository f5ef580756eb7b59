"""One bucket's trip between its home and the device (:class:`BucketMover`).

    fetch    materialize its fp32 mains and moments, read their stored bytes
             (the engine), decode them in place; or, where the home lends its
             bytes and they are the fp32 values (the gpu home), share them;
    store    encode in place and submit the writes (the engine), or hold them
             for later (the overlap window's deferred writes);
    release  give the device memory back, and the shared tensors their own
             (empty) storage;
    abort    after a failure, or when a bucket is not needed: wait (up to a
             deadline) until no transfer touches its memory, then release it.

The mover knows nothing of the walk's order or of how many buckets are in flight
(``pipeline.py``), nor of Adam, roll-back or checkpoints (the store's concerns).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from miles_plugins.optimizers.errors import StreamIOTimeout
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.protocols import Transfer
from miles_plugins.optimizers.step.bucket_optimizer import BucketOptimizer
from miles_plugins.optimizers.step.codec import Codec, stored_bytes
from miles_plugins.optimizers.step.entries import Entry, StepStats
from miles_plugins.optimizers.step.flight import BucketInFlight, StateAccounting

if TYPE_CHECKING:
    from miles_plugins.optimizers.homes.protocols import Backing, Engine


class BucketMover:
    """Moves one bucket at a time between the backing and the device.

    Args:
        entries: the store's entries (buckets index into them).
        buckets, optimizers: the layout and each bucket's optimizer.
        backing, engine: where the bytes live and how they move (``homes/backings.py``, ``homes/engines.py``).
        codec: the storage formats.
        device: where buckets are materialized (CUDA ordering uses events).
        io_timeout_s: what an abort after a failure may still wait, in total.
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
    ) -> None:
        self.entries, self.buckets, self.optimizers = entries, buckets, optimizers
        self.backing, self.engine, self.codec = backing, engine, codec
        self.device, self.io_timeout_s = device, io_timeout_s
        self.accounting = StateAccounting()
        # Set once transfers hung: their memory may still be written and is abandoned,
        # so the store must not run again (it checks this flag). ``hang_cause``: set
        # where it was not a timeout.
        self.hung = False
        self.hang_cause: str | None = None

    def _open(self, index: int, in_place: bool) -> BucketInFlight:
        """A flight of bucket ``index`` with its home opened (``in_place``: to write the slot it reads)."""
        bucket = self.buckets[index]
        flight = BucketInFlight(bucket, self.optimizers[index], [self.entries[i] for i in bucket.entry_indices])
        flight.handle = self.backing.open(bucket, in_place=in_place)
        return flight

    def fetch(
        self, index: int, stats: StepStats, moments: bool = True, beside_training: bool = False
    ) -> BucketInFlight:
        """Materialize bucket ``index``'s mains (and moments) and submit their reads
        (``beside_training``: between steps, see ``PipelinedEngine``). A stored
        format other than fp32 lands in the first bytes of the tensor's own
        storage, decoded in place by :meth:`finish_fetch`; an fp32 one the home
        lends (the gpu home's) is shared instead (:meth:`_share`)."""
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

    def finish_fetch(self, flight: BucketInFlight) -> None:
        """Wait for the flight's reads, then decode what arrived in a stored format."""
        flight.reads.wait()
        flight.reads = None
        segments, entries = flight.bucket.segments, flight.entries
        self.codec.decode(
            flight.bucket, [(segments[name], k, tensor, entries[k].param) for name, k, tensor in flight.converts]
        )
        flight.converts.clear()

    def store(self, flight: BucketInFlight, stats: StepStats, moments: bool = True, submit: bool = True) -> None:
        """Encode the bucket's mains (and moments) in place and submit their writes
        (or, without ``submit``, hold them in ``flight.held``: ``Pipeline.advance_deferred_writes`` submits them).
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

    def _share(self, flight: BucketInFlight, name: str, k: int, tensor: torch.Tensor) -> bool:
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

    def _release(self, flight: BucketInFlight) -> None:
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

    @contextlib.contextmanager
    def read_one(self, index: int, moments: bool = True) -> Iterator[BucketInFlight]:
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

    def abort(self, flights: Sequence[BucketInFlight], wait_s: float) -> bool:
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
            for pending in (flight.reads, flight.writes):
                if pending is None:
                    continue
                try:
                    pending.wait(max(0.0, deadline - time.monotonic()))
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
