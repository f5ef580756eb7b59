"""How a bucket's chunks are scheduled between a backing and the device.

:class:`SyncEngine` runs them at once on the caller's thread through one staging
buffer (the baseline); :class:`PipelinedEngine` runs them on reader and writer
threads, several requests in flight per direction, each thread with its own
staging chunk and CUDA stream, so reads of one bucket and writes of another
overlap each other and the caller's compute (a step's copies of pinned host
memory need no thread: they are queued whole on a copy stream per direction; the
overlap window's, beside training, go through one window thread per direction). A
submission returns a :class:`TransferBatch` to wait on. Both satisfy
:class:`~miles_plugins.optimizers.homes.protocols.Engine`.

Host memory for streaming is the staging chunks, whatever the state size (the
host home adds the state itself, which is its point).
"""

from __future__ import annotations

import concurrent.futures
import enum
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import torch
from torch.cuda import Event

from miles_plugins.optimizers.homes.host_memory import HostMemory
from miles_plugins.optimizers.homes.protocols import DmaHandle, Handle, Transfer
from miles_plugins.optimizers.homes.transfer_batch import TransferBatch

# The overlap window's requests of pinned host memory (see PipelinedEngine): long enough
# that the window thread's own host time between two requests leaves the copy engine
# busy, short enough that the training's own copies find a place in the queues between
# two (docs/performance.md, "The window thread", has the timings).
WINDOW_REQUEST_BYTES = 64 << 20

# A handle's read or write of one chunk: (offset, device tensor, staging chunk or None).
_Copy = Callable[[int, torch.Tensor, HostMemory | None], None]


class Direction(enum.IntEnum):
    """Which way a submission moves bytes; indexes the engine's per-direction threads and streams."""

    READ = 0  # from the bucket into device tensors
    WRITE = 1  # from device tensors into the bucket


def _copy_of(handle: Handle, direction: Direction) -> _Copy:
    return handle.read if direction is Direction.READ else handle.write


def _path_of(handle: Handle, direction: Direction) -> str:
    return handle.read_path if direction is Direction.READ else handle.write_path


def _chunks(transfers: Sequence[Transfer], chunk: int) -> Iterator[Transfer]:
    for offset, tensor in transfers:
        for start in range(0, tensor.numel(), chunk):
            yield offset + start, tensor[start : start + chunk]


class _ReadWrite:
    """An engine's :meth:`read` and :meth:`write` (their contract:
    :class:`~miles_plugins.optimizers.homes.protocols.Engine`), both served by the
    subclass's ``_transfer`` with the :class:`Direction`."""

    def read(
        self, handle: Handle, transfers: Sequence[Transfer], ready: Event | None = None, beside_training: bool = False
    ) -> TransferBatch:
        return self._transfer(Direction.READ, handle, transfers, ready, beside_training)

    def write(
        self, handle: Handle, transfers: Sequence[Transfer], ready: Event | None = None, beside_training: bool = False
    ) -> TransferBatch:
        return self._transfer(Direction.WRITE, handle, transfers, ready, beside_training)


class SyncEngine(_ReadWrite):
    """The baseline: each transfer runs now, on the caller's thread and stream
    (so it is ordered after the caller's work without an event), chunk by chunk
    through one staging buffer."""

    def __init__(self, chunk_bytes: int, pin: bool) -> None:
        self.staging = HostMemory(chunk_bytes, pin)

    def _transfer(self, direction: Direction, handle: Handle, transfers: Sequence[Transfer], *_) -> TransferBatch:
        """Every chunk now, in order; ``ready`` and ``beside_training`` (the rest) change nothing here."""
        copy = _copy_of(handle, direction)
        for offset, tensor in _chunks(transfers, self.staging.nbytes):
            copy(offset, tensor, self.staging)
        return TransferBatch()

    def idle_buffer(self) -> HostMemory:
        return self.staging

    def close(self, wait: bool = True) -> None:
        self.staging.release()


class _DaemonPool:
    """``threads`` daemon threads serving a queue of calls, each with its future.

    ``concurrent.futures.ThreadPoolExecutor`` joins its threads at interpreter
    exit: one thread stuck in a read from a hung drive would keep the process
    (and, since that join runs before ``atexit``, its scratch) alive forever.
    Daemon threads are abandoned at exit instead.
    """

    def __init__(self, threads: int, name: str, init: Callable[[], None]) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, args=(init,), name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def _serve(self, init: Callable[[], None]) -> None:
        try:
            init()
            broken = None
        except Exception as exc:  # noqa: BLE001 - e.g. its CUDA stream could not be made
            # Fail every request this thread takes, at once: left unserved they would be
            # reported, a timeout later, as a hung drive.
            broken = RuntimeError(f"I/O thread {threading.current_thread().name} could not start: {exc!r}")
            broken.__cause__ = exc
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            if broken is not None:
                future.set_exception(broken)
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args))
        return future

    def shutdown(self, wait: bool) -> None:
        """Stop the threads after the calls already queued (``wait``), or cancel
        those calls and leave running ones behind (``wait=False``: they hang)."""
        if not wait:
            while True:
                try:
                    call = self._calls.get_nowait()
                except queue.Empty:
                    break
                if call is not None:
                    call[0].cancel()
        for _ in self._threads:
            self._calls.put(None)
        if wait:
            for thread in self._threads:
                thread.join()


class PipelinedEngine(_ReadWrite):
    """Reader and writer threads, ``threads`` of each per queue: every chunk is one
    request, so up to ``threads`` reads and ``threads`` writes are in flight at once
    on each queue. A handle's ``io_queue`` (one per state directory; 0 for memory)
    picks the threads that serve it, so each drive gets its own requests
    in flight instead of waiting behind another drive's in one FIFO. A handle
    ``on_caller_stream`` (device memory) is served at once on the caller's thread
    and stream instead: a device-to-device copy is asynchronous, so a worker
    stream's copy would be ordered neither with the caller's update nor with the
    caching allocator, which may hand a released bucket's memory out again.

    Each reader/writer thread owns one staging chunk and, on CUDA, one stream: a
    chunk's device copy runs on that stream and is complete before the thread
    takes its next request, so a staging chunk is never reused while a copy
    reads it (a window thread, below, has a stream and no staging).

    A ``dma`` handle (pinned host memory, CUDA) needs no thread and no staging
    inside a step: its transfers are queued whole, as asynchronous copies on one
    copy stream per direction, from the caller's thread; the pending transfers wait for an
    event after them (the copy engines then run both directions at once at full
    speed, which the threads' chunked copies do not reach). ``beside_training``
    (the overlap window's transfers, during forward and backward) sends them
    instead through one *window thread* per direction, as requests of
    ``WINDOW_REQUEST_BYTES``, one at a time, leaving the training's own copies a
    place in the queues at every request and its thread the GIL most of the time
    (docs/performance.md compares the three routings).

    Ordering with the caller's stream: ``ready`` is an event the caller records
    after the last work that must come first; each request's copy waits for it
    on the device. A write needs it (the update must be done before its bytes
    are copied out); so does a read into freshly allocated memory (the caching
    allocator hands out blocks whose previous users on the caller's stream may
    still be running). Tensors a read fills are used only after its pending transfers are
    waited on.
    """

    def __init__(
        self,
        *,
        threads: int,
        chunk_bytes: int,
        pin: bool,
        device: torch.device,
        timeout_s: float,
        queues: int = 1,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self._stagings = [HostMemory(chunk_bytes, pin) for _ in range(2 * threads * queues)]
        self._device = device
        self._local = threading.local()
        pool = iter(self._stagings)
        lock = threading.Lock()

        def init_stream() -> None:
            if device.type == "cuda":
                torch.cuda.set_device(device)
                self._local.stream = torch.cuda.Stream(device)

        def init_worker() -> None:
            with lock:
                self._local.staging = next(pool)
            init_stream()

        def init_window_thread() -> None:  # pinned host memory only: no staging
            self._local.staging = None
            init_stream()

        self._readers = [_DaemonPool(threads, f"stream-read{q}", init_worker) for q in range(queues)]
        self._writers = [_DaemonPool(threads, f"stream-write{q}", init_worker) for q in range(queues)]
        self._window_threads: tuple[_DaemonPool, ...] = ()
        self._copy_streams = None
        if device.type == "cuda":
            # One of each per direction: a stream's copies run in order, the two streams' at once.
            self._copy_streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            self._window_threads = (
                _DaemonPool(1, "window-read", init_window_thread),
                _DaemonPool(1, "window-write", init_window_thread),
            )

    def _run(
        self,
        copy: _Copy,
        offset: int,
        tensor: torch.Tensor,
        ready: Event | None,
    ) -> None:
        """One request, on a reader, writer or window thread: through its staging chunk,
        on its stream after ``ready``."""
        local = self._local
        if self._device.type != "cuda":
            copy(offset, tensor, local.staging)
            return
        with torch.cuda.stream(local.stream):
            if ready is not None:
                local.stream.wait_event(ready)
            copy(offset, tensor, local.staging)

    def _transfer(
        self,
        direction: Direction,
        handle: Handle,
        transfers: Sequence[Transfer],
        ready: Event | None,
        beside_training: bool,
    ) -> TransferBatch:
        """Route one submission: pinned host memory on CUDA to the copy stream, or beside
        training to the window thread; the rest to the handle's reader or writer threads."""
        path = _path_of(handle, direction)
        if handle.dma and self._copy_streams:
            if beside_training:
                pool = self._window_threads[direction]
                return self._submit(pool, handle, direction, transfers, ready, WINDOW_REQUEST_BYTES)
            dma = cast(DmaHandle, handle)
            queue_copy = dma.read_async if direction is Direction.READ else dma.write_async
            return self._queue_copies(self._copy_streams[direction], queue_copy, path, transfers, ready)
        pool = (self._readers, self._writers)[direction][handle.io_queue]
        return self._submit(pool, handle, direction, transfers, ready, self.chunk_bytes)

    def _submit(
        self,
        pool: _DaemonPool,
        handle: Handle,
        direction: Direction,
        transfers: Sequence[Transfer],
        ready: Event | None,
        chunk_bytes: int,
    ) -> TransferBatch:
        """Each chunk of ``transfers`` as one request to ``pool``'s threads; a handle
        ``on_caller_stream`` copies each tensor now instead."""
        copy = _copy_of(handle, direction)
        if handle.on_caller_stream:
            # Copies on the caller's stream (the gpu home's buffers, on the device or, after
            # to_host, in host memory): one per tensor, as chunks exist for staging, which these skip.
            for offset, tensor in transfers:
                copy(offset, tensor, None)
            return TransferBatch()
        futures: list[concurrent.futures.Future] = []
        try:
            for offset, tensor in _chunks(transfers, chunk_bytes):
                futures.append(pool.submit(self._run, copy, offset, tensor, ready))
            return TransferBatch(futures=futures, name=_path_of(handle, direction), timeout_s=self.timeout_s)
        except BaseException:
            # No pending transfers reach the caller, who releases the tensors now: requests not yet
            # started are cancelled, started ones waited for (as _queue_copies does).
            for future in futures:
                future.cancel()
            concurrent.futures.wait(futures, timeout=self.timeout_s)
            raise

    def _queue_copies(
        self,
        stream: torch.cuda.Stream,
        copy: Callable[[int, torch.Tensor], None],
        path: str,
        transfers: Sequence[Transfer],
        ready: Event | None,
    ) -> TransferBatch:
        """Queue ``copy(offset, tensor)`` of every transfer on ``stream`` after ``ready``."""
        try:
            with torch.cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)
                for offset, tensor in transfers:
                    copy(offset, tensor)
            done = torch.cuda.Event()
            done.record(stream)
            return TransferBatch(name=path, timeout_s=self.timeout_s, events=[done])
        except BaseException:
            # No pending transfers reach the caller, who releases the tensors now: nothing queued so far
            # may still touch them (an interrupt between two copies, a CUDA error).
            stream.synchronize()
            raise

    def idle_buffer(self) -> HostMemory:
        """A staging chunk the caller may use while no transfer is in flight."""
        return self._stagings[0]

    def close(self, wait: bool = True) -> None:
        """Stop the threads; with ``wait=False`` (after a timeout) hung requests are
        abandoned, and their staging stays allocated for them."""
        for pool in (*self._readers, *self._writers, *self._window_threads):
            pool.shutdown(wait)
        if wait:
            for staging in self._stagings:
                staging.release()
