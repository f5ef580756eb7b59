"""Moving bytes between the state's home (bucket files or host memory) and device tensors.

Two parts, kept apart so every combination runs side by side:

- a *backing* says where a bucket's bytes live: :class:`FileBacking` (one file
  per bucket, direct I/O where the filesystem allows it) or :class:`HostBacking`
  (one pinned host buffer per bucket). ``open(bucket)`` gives a handle whose
  ``read`` / ``write`` move one chunk between that bucket and a device tensor.
- an *engine* says how chunks are scheduled: :class:`SyncEngine` runs them at
  once on the caller's thread through one staging buffer (the baseline);
  :class:`PipelinedEngine` runs them on reader and writer threads, several
  requests in flight per direction, each thread with its own staging chunk and
  CUDA stream, so reads of one bucket and writes of another overlap each other
  and the caller's compute.

Host memory for streaming is the staging chunks, whatever the state size (the
host tier adds the state itself, which is its point).
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import mmap
import os
import queue
import threading
import zlib
from collections.abc import Callable, Sequence

import torch

from miles_plugins.optimizers.errors import StreamIOError, StreamIOTimeout
from miles_plugins.optimizers.formats.layout import ALIGNMENT, BucketLayout, align_up
from miles_plugins.optimizers.homes.fs import open_file

logger = logging.getLogger(__name__)


class HostMemory:
    """``nbytes`` of host memory, exactly that size and page-aligned (direct I/O
    needs the alignment): an anonymous private mapping, page-locked when ``pin``
    so host<->device copies run as DMA. The pinning is ``cudaHostRegister`` on
    the mapping, not torch's pinned allocator, which rounds every size up to a
    power of two (up to twice the host memory asked for). ``release()`` unpins.

    The mapping is left out of forked children (``MADV_DONTFORK``): Linux copies
    the DMA-pinned pages of a private mapping into the child at fork time, so
    every DataLoader worker Megatron forks after setup would otherwise double the
    host home (measured on an H200 machine: 16 GiB pinned, two forks, 16.2 GiB
    less available). A child never touches the state; where it forks and execs
    (subprocess), nothing changes."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        try:
            # Private: a shared anonymous mapping would be shmem, counted as page cache.
            self._mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            raise StreamIOError(
                f"cannot allocate {nbytes} bytes of host memory: {exc.strerror}", "<host memory>", 0, exc.errno
            ) from exc
        if _MADV_DONTFORK is not None:
            self._mapping.madvise(_MADV_DONTFORK)  # before pinning: the pages must never reach a child
        self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)[:nbytes]
        self.view = memoryview(self._mapping)[:nbytes]  # for os.preadv / os.pwritev
        self._pinned = False
        if pin and nbytes:
            err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
            if err:
                raise StreamIOError(
                    f"cannot page-lock {nbytes} bytes of host memory (cudaHostRegister error {err}); "
                    "raise the locked-memory limit (ulimit -l) or give the process more memory",
                    "<host memory>",
                    0,
                    errno.ENOMEM,
                )
            self._pinned = True

    def release(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False


# cudaHostRegisterPortable: pinned for every CUDA context, as torch's pinned memory is.
_HOST_REGISTER_PORTABLE = 1
# Linux only; elsewhere (no fork-time copy of pinned pages to avoid) None.
_MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", None)


class FileHandle:
    """A bucket's files opened for one pass: ``read`` from ``read_path``, ``write``
    to ``write_path`` (the same file, or the other slot). Each call moves one
    chunk (at most the staging buffer) at an aligned offset; with direct I/O the
    transfer is rounded up to the alignment, which the layout reserves as padding."""

    on_caller_stream = False

    def __init__(self, read_path: str, write_path: str, direct: bool, io_queue: int = 0) -> None:
        self.read_path, self.write_path = read_path, write_path
        self.direct, self.io_queue = direct, io_queue
        flags = os.O_RDWR | (os.O_DIRECT if direct else 0)
        self.read_fd = open_file(read_path, flags)
        try:
            self.write_fd = self.read_fd if write_path == read_path else open_file(write_path, flags)
        except BaseException:
            os.close(self.read_fd)
            raise

    def read(self, offset: int, dst: torch.Tensor, staging: HostMemory) -> None:
        n = dst.numel()
        pread_full(self.read_fd, self.read_path, offset, staging.view[: self._span(n)], self._align)
        # A plain (non_blocking=False) copy returns once the bytes are on the device,
        # so the staging chunk is free for the next request when this returns.
        dst.copy_(staging.tensor[:n])

    def write(self, offset: int, src: torch.Tensor, staging: HostMemory) -> None:
        n = src.numel()
        span = self._span(n)
        # Synchronous copy: the bytes are in staging before pwritev reads them.
        staging.tensor[:n].copy_(src)
        staging.tensor[n:span].zero_()  # the alignment padding, kept deterministic
        pwrite_full(self.write_fd, self.write_path, offset, staging.view[:span], self._align)

    def _span(self, n: int) -> int:
        return align_up(n) if self.direct else n

    @property
    def _align(self) -> int:
        return ALIGNMENT if self.direct else 1

    def close(self) -> None:
        if self.write_fd != self.read_fd:
            os.close(self.write_fd)
        os.close(self.read_fd)


class FileBacking:
    """The state in files under ``directory``: two *slots* per bucket.

    A step reads every bucket from the committed slot and writes it to the
    other one; :meth:`commit` flips them once the whole step is written. Until
    then the committed slot holds the complete state before the step, so a step
    that fails part way (a write error, a full disk, a hung drive) loses
    nothing before it. That costs twice the state in disk space.

    Buckets in ``one_slot`` (where the drive cannot hold two) have a single file,
    written in place as the host home is: a step that fails after updating one
    cannot be rolled back (``rollback.py``). ``Placement`` gives one slot to the
    last disk buckets of the walk, so the two-slot ones all come before them.

    Creates every file (new, private, never through a symlink) at its full size
    so a full disk fails here, not mid-step. With ``direct`` the files are
    opened ``O_DIRECT`` (no page cache: it would fill host RAM with state that
    is read once per step); where the filesystem refuses that, buffered I/O is
    used and a log line says so.
    """

    SLOTS = 2

    def __init__(
        self,
        directory: str,
        buckets: Sequence[BucketLayout],
        direct: bool,
        io_queue: int = 0,
        one_slot: frozenset[int] = frozenset(),
    ) -> None:
        self.directory = directory
        self.io_queue = io_queue  # which of the engine's sets of I/O threads serves this directory's drive
        self.one_slot = one_slot
        self.committed = 0
        for bucket in buckets:
            for slot in range(self._slots(bucket.index)):
                path = self.path(bucket, slot)
                fd = open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
                try:
                    os.posix_fallocate(fd, 0, bucket.file_size)
                except OSError as exc:
                    raise StreamIOError(
                        f"cannot reserve {bucket.file_size} bytes for {path}: {exc.strerror}", path, 0, exc.errno
                    ) from exc
                finally:
                    os.close(fd)
        self.direct = direct and bool(buckets) and _direct_io_works(self.path(buckets[0], 0))

    @classmethod
    def bytes_needed(cls, buckets: Sequence[BucketLayout], one_slot: frozenset[int] = frozenset()) -> int:
        return sum(b.file_size * (1 if b.index in one_slot else cls.SLOTS) for b in buckets)

    def _slots(self, index: int) -> int:
        return 1 if index in self.one_slot else self.SLOTS

    def keeps_previous_state_of(self, bucket: BucketLayout) -> bool:
        """Whether a step writes the bucket to a spare slot (the live state stays until commit)."""
        return bucket.index not in self.one_slot

    def path(self, bucket: BucketLayout, slot: int | None = None) -> str:
        """The file of ``slot`` (default: the committed one; a one-slot bucket's only file)."""
        slot = self.committed if slot is None else slot
        slot = slot if self.keeps_previous_state_of(bucket) else 0
        return os.path.join(self.directory, f"{bucket.file_name.removesuffix('.bin')}.slot{slot}.bin")

    def open(self, bucket: BucketLayout, in_place: bool = False) -> FileHandle:
        """Reads come from the committed slot; writes go to the other slot, or to
        the committed one ``in_place`` (rewriting mains outside a step; always for
        a one-slot bucket)."""
        write_slot = self.committed if in_place else 1 - self.committed
        return FileHandle(self.path(bucket), self.path(bucket, write_slot), self.direct, self.io_queue)

    def commit(self) -> None:
        """The slot a step wrote becomes the state (one-slot buckets were written in place)."""
        self.committed = 1 - self.committed

    def export(self, bucket: BucketLayout, dst_fd: int, dst_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        """Copy the bucket's committed bytes into an open file, through ``crc``."""
        handle = self.open(bucket, in_place=True)
        try:
            copy_file_crc32(handle.read_fd, handle.read_path, dst_fd, dst_path, bucket.file_size, buffer.view, crc)
        finally:
            handle.close()

    def restore(self, bucket: BucketLayout, src_fd: int, src_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        """Copy the bucket's bytes from an open file into the spare slot (the live state
        is untouched until :meth:`commit`; a one-slot bucket's file is overwritten), through ``crc``."""
        handle = self.open(bucket)
        try:
            copy_file_crc32(src_fd, src_path, handle.write_fd, handle.write_path, bucket.file_size, buffer.view, crc)
        finally:
            handle.close()

    def release(self) -> None:
        """Nothing to give back: the files go with the scratch directory."""


def _direct_io_works(path: str) -> bool:
    try:
        fd = open_file(path, os.O_RDWR | os.O_DIRECT)
    except StreamIOError as exc:
        if exc.errno != errno.EINVAL:
            raise
        logger.warning(
            "the filesystem holding %s refuses O_DIRECT: using buffered I/O (the page cache will hold "
            "recently streamed state)",
            os.path.dirname(path),
        )
        return False
    os.close(fd)
    logger.info("bucket files in %s use direct I/O", os.path.dirname(path))
    return True


class BufferHandle:
    """One bucket's buffer in memory (host or device); chunks copy straight between
    it and the tensors being streamed. ``on_caller_stream``: the engine runs its
    copies on the caller's thread and stream (see :class:`PipelinedEngine`)."""

    io_queue = 0

    def __init__(self, buffer: torch.Tensor, name: str, on_caller_stream: bool = False) -> None:
        self.buffer = buffer
        self.read_path = self.write_path = name
        self.on_caller_stream = on_caller_stream

    def read(self, offset: int, dst: torch.Tensor, staging: HostMemory | None) -> None:
        dst.copy_(self.buffer[offset : offset + dst.numel()])

    def write(self, offset: int, src: torch.Tensor, staging: HostMemory | None) -> None:
        self.buffer[offset : offset + src.numel()].copy_(src)

    def close(self) -> None:
        pass


class HostBacking:
    """The state in one host buffer per bucket, pinned when CUDA is available
    (device copies then run as DMA at full PCIe speed). One copy: a step writes
    in place (a second would double the host memory this tier exists to use)."""

    def __init__(self, buckets: Sequence[BucketLayout], pin: bool) -> None:
        self.buffers: dict[int, HostMemory] = {}
        try:
            for bucket in buckets:
                self.buffers[bucket.index] = HostMemory(bucket.file_size, pin)
        except (OSError, RuntimeError) as exc:
            self.release()
            raise StreamIOError(
                f"cannot hold bucket {bucket.index} ({bucket.file_size} bytes) in host memory: {exc}; "
                "lower the host budget (--stream-optimizer-state-host-budget-gb, host_budget_bytes), use the "
                "disk tier, or give the process more memory",
                f"<host bucket {bucket.index}>",
                0,
                errno.ENOMEM,
            ) from exc

    def keeps_previous_state_of(self, bucket: BucketLayout) -> bool:
        return False

    def open(self, bucket: BucketLayout, in_place: bool = True) -> BufferHandle:
        return BufferHandle(self.buffers[bucket.index].tensor, f"<host memory of bucket {bucket.index}>")

    def commit(self) -> None:
        pass

    def export(self, bucket: BucketLayout, dst_fd: int, dst_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        data = self.buffers[bucket.index].view
        pwrite_full(dst_fd, dst_path, 0, data)
        crc.update(data)

    def restore(self, bucket: BucketLayout, src_fd: int, src_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        """Copy the bucket's bytes from an open file into its buffer, in place (the
        host tier has no spare), through ``crc``."""
        data = self.buffers[bucket.index].view
        pread_full(src_fd, src_path, 0, data)
        crc.update(data)

    def release(self) -> None:
        for memory in self.buffers.values():
            memory.release()
        self.buffers.clear()


class DeviceBacking:
    """The state in one buffer per bucket in the compute device's memory (the
    ``gpu`` home): a step's reads and writes are device-to-device copies, with no
    PCIe transfer and no drive. The buffer holds the stored format, so a bucket
    here costs its stored size between steps and computes exactly as anywhere
    else. One copy, written in place, as the host home.

    A bucket's buffer is allocated at its first :meth:`open` (the store's first
    write of its mains), not here: by then the mains of every bucket written
    before it have given their device memory back, so a GPU home never sits on
    top of the fp32 mains Megatron's build allocated."""

    def __init__(self, buckets: Sequence[BucketLayout], device: torch.device) -> None:
        self.device = device
        self.buffers: dict[int, torch.Tensor] = {}
        self._offloaded: dict[int, HostMemory] = {}
        self._unallocated = {bucket.index: bucket for bucket in buckets}

    def add(self, bucket: BucketLayout) -> torch.Tensor:
        """Device memory for one more bucket, zeroed: bytes no write reaches (alignment
        padding, moments of entries that never got a grad) are saved as zeros, as from
        files and host memory. Raises ``StreamIOError`` (ENOMEM) where it does not fit."""
        try:
            buffer = torch.zeros(bucket.file_size, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            raise StreamIOError(
                f"cannot keep bucket {bucket.index} ({bucket.file_size} bytes) in {self.device} memory: {exc}; "
                "lower the GPU budget (--stream-optimizer-state-gpu-budget-gb, gpu_budget_bytes)",
                f"<device bucket {bucket.index}>",
                0,
                errno.ENOMEM,
            ) from exc
        self.buffers[bucket.index] = buffer
        return buffer

    def remove(self, bucket: BucketLayout) -> None:
        """Free one bucket's memory (it went back to its place below)."""
        del self.buffers[bucket.index]

    def keeps_previous_state_of(self, bucket: BucketLayout) -> bool:
        return False

    def _buffer(self, bucket: BucketLayout) -> torch.Tensor:
        if bucket.index in self._unallocated:
            self.add(self._unallocated.pop(bucket.index))
        return self.buffers[bucket.index]

    def open(self, bucket: BucketLayout, in_place: bool = True) -> BufferHandle:
        # Device-to-device copies go on the caller's stream: ordered with the update
        # and with the caching allocator's reuse of freed bucket memory.
        return BufferHandle(self._buffer(bucket), f"<device memory of bucket {bucket.index}>", True)

    @property
    def offloaded(self) -> bool:
        """Whether :meth:`to_host` moved the buffers to host memory."""
        return bool(self._offloaded)

    def to_host(self, pin: bool) -> None:
        """Move every buffer to host memory and free the device's (an RL rollout
        phase wants the GPU); steps still work, copying over PCIe, until :meth:`to_device`."""
        for index, buffer in list(self.buffers.items()):
            if index in self._offloaded:
                continue
            memory = HostMemory(buffer.numel(), pin)
            memory.tensor.copy_(buffer)
            self._offloaded[index] = memory
            self.buffers[index] = memory.tensor

    def to_device(self) -> None:
        """Bring the buffers :meth:`to_host` moved back into device memory."""
        for index, memory in list(self._offloaded.items()):
            self.buffers[index] = memory.tensor.to(self.device)
            memory.release()
            del self._offloaded[index]

    def commit(self) -> None:
        pass

    def export(self, bucket: BucketLayout, dst_fd: int, dst_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        """Copy the bucket's bytes into an open file through the host ``buffer``, chunk by chunk."""
        data = self._buffer(bucket)
        for start in range(0, data.numel(), buffer.nbytes):
            n = min(buffer.nbytes, data.numel() - start)
            buffer.tensor[:n].copy_(data[start : start + n])
            pwrite_full(dst_fd, dst_path, start, buffer.view[:n])
            crc.update(buffer.view[:n])

    def restore(self, bucket: BucketLayout, src_fd: int, src_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        """Copy the bucket's bytes from an open file into its buffer, in place, through ``crc``."""
        data = self._buffer(bucket)
        for start in range(0, data.numel(), buffer.nbytes):
            n = min(buffer.nbytes, data.numel() - start)
            pread_full(src_fd, src_path, start, buffer.view[:n])
            crc.update(buffer.view[:n])
            data[start : start + n].copy_(buffer.tensor[:n])

    def release(self) -> None:
        self.buffers.clear()
        self._unallocated.clear()
        for memory in self._offloaded.values():
            memory.release()
        self._offloaded.clear()


# ---- engines ---------------------------------------------------------------

# One transfer: (byte offset in the bucket, flat uint8 view of a device tensor).
Transfer = tuple[int, torch.Tensor]


class Ticket:
    """Transfers submitted together; ``wait()`` returns when all are done and
    raises the first failure (after every transfer has stopped touching memory),
    or :class:`StreamIOTimeout` when they are not all done within ``timeout_s``
    (or the ``timeout_s`` given to that wait: an abort after a failure waits
    only for what is left of its own deadline)."""

    def __init__(
        self, futures: Sequence[concurrent.futures.Future] = (), name: str = "", timeout_s: float | None = None
    ) -> None:
        self._futures = list(futures)
        self._name = name
        self._timeout_s = timeout_s

    def wait(self, timeout_s: float | None = None) -> None:
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        _, pending = concurrent.futures.wait(self._futures, timeout=timeout_s)
        if pending:
            raise StreamIOTimeout(
                f"I/O on {self._name} did not complete within {timeout_s:g} s: {len(pending)} of "
                f"{len(self._futures)} requests still pending (a hung drive?)",
                self._name,
                0,
                errno.ETIMEDOUT,
            )
        first = None
        for future in self._futures:
            if future.exception() is not None:
                first = first or future.exception()
        self._futures.clear()
        if first is not None:
            raise first


def _chunks(transfers: Sequence[Transfer], chunk: int):
    for offset, tensor in transfers:
        for start in range(0, tensor.numel(), chunk):
            yield offset + start, tensor[start : start + chunk]


class SyncEngine:
    """The baseline: each transfer runs now, on the caller's thread and stream
    (so it is ordered after the caller's work without an event), chunk by chunk
    through one staging buffer."""

    def __init__(self, chunk_bytes: int, pin: bool) -> None:
        self.staging = HostMemory(chunk_bytes, pin)

    def read(self, handle, transfers: Sequence[Transfer], ready: torch.cuda.Event | None = None) -> Ticket:
        for offset, dst in _chunks(transfers, self.staging.nbytes):
            handle.read(offset, dst, self.staging)
        return Ticket()

    def write(self, handle, transfers: Sequence[Transfer], ready: torch.cuda.Event | None = None) -> Ticket:
        for offset, src in _chunks(transfers, self.staging.nbytes):
            handle.write(offset, src, self.staging)
        return Ticket()

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
        init()
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
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


class PipelinedEngine:
    """Reader and writer threads, ``threads`` of each per queue: every chunk is one
    request, so up to ``threads`` reads and ``threads`` writes are in flight at once
    on each queue. A handle's ``io_queue`` (one per state directory; 0 for memory)
    picks the threads that serve it, so each drive gets its own requests
    in flight instead of waiting behind another drive's in one FIFO. A handle
    ``on_caller_stream`` (device memory) is served at once on the caller's thread
    and stream instead: a device-to-device copy is asynchronous, so a worker
    stream's copy would be ordered neither with the caller's update nor with the
    caching allocator, which may hand a released bucket's memory out again.

    Each thread owns one staging chunk and, on CUDA, one stream: a chunk's
    device copy runs on that stream and is complete before the thread takes its
    next request, so a staging chunk is never reused while a copy reads it.

    Ordering with the caller's stream: ``ready`` is an event the caller records
    after the last work that must come first; each request's copy waits for it
    on the device. A write needs it (the update must be done before its bytes
    are copied out); so does a read into freshly allocated memory (the caching
    allocator hands out blocks whose previous users on the caller's stream may
    still be running). Tensors a read fills are used only after its ticket is
    waited on.
    """

    def __init__(
        self, threads: int, chunk_bytes: int, pin: bool, device: torch.device, timeout_s: float, queues: int = 1
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self._stagings = [HostMemory(chunk_bytes, pin) for _ in range(2 * threads * queues)]
        self._device = device
        self._local = threading.local()
        pool = iter(self._stagings)
        lock = threading.Lock()

        def init_worker() -> None:
            with lock:
                self._local.staging = next(pool)
            if device.type == "cuda":
                torch.cuda.set_device(device)
                self._local.stream = torch.cuda.Stream(device)

        self._readers = [_DaemonPool(threads, f"stream-read{q}", init_worker) for q in range(queues)]
        self._writers = [_DaemonPool(threads, f"stream-write{q}", init_worker) for q in range(queues)]

    def _run(self, op, offset: int, tensor: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        local = self._local
        if self._device.type != "cuda":
            op(offset, tensor, local.staging)
            return
        with torch.cuda.stream(local.stream):
            if ready is not None:
                local.stream.wait_event(ready)
            op(offset, tensor, local.staging)

    def read(self, handle, transfers: Sequence[Transfer], ready: torch.cuda.Event | None = None) -> Ticket:
        return self._submit(self._readers, handle.read, handle, handle.read_path, transfers, ready)

    def write(self, handle, transfers: Sequence[Transfer], ready: torch.cuda.Event | None = None) -> Ticket:
        return self._submit(self._writers, handle.write, handle, handle.write_path, transfers, ready)

    def _submit(self, pools, op, handle, path: str, transfers: Sequence[Transfer], ready) -> Ticket:
        chunks = _chunks(transfers, self.chunk_bytes)
        if handle.on_caller_stream:
            for offset, tensor in chunks:
                op(offset, tensor, None)
            return Ticket()
        pool = pools[handle.io_queue]
        return Ticket([pool.submit(self._run, op, o, t, ready) for o, t in chunks], path, self.timeout_s)

    def idle_buffer(self) -> HostMemory:
        """A staging chunk the caller may use while no transfer is in flight."""
        return self._stagings[0]

    def close(self, wait: bool = True) -> None:
        """Stop the threads; with ``wait=False`` (after a timeout) hung requests are
        abandoned, and their staging stays allocated for them."""
        for pool in (*self._readers, *self._writers):
            pool.shutdown(wait)
        if wait:
            for staging in self._stagings:
                staging.release()


def pread_full(fd: int, path: str, offset: int, buffer: memoryview, align: int = 1) -> None:
    """Fill ``buffer`` from ``offset``; a read error or an early end of file raises
    :class:`StreamIOError` naming the file and offset. After a partial read the
    rest is asked for from the last ``align`` boundary (direct I/O accepts only
    aligned offsets and lengths; a few bytes are then read twice); a read that
    gets no further than the last one is the end of the file."""
    n = len(buffer)
    got = 0
    while got < n:
        start = got - got % align
        try:
            r = os.preadv(fd, [buffer[start:]], offset + start)
        except OSError as exc:
            raise StreamIOError(
                f"read of {path} failed at offset {offset + start}: {exc.strerror}", path, offset + start, exc.errno
            ) from exc
        if start + r <= got:
            raise StreamIOError(
                f"short read of {path} at offset {offset + got}: end of file after {got} of {n} bytes "
                "(file truncated?)",
                path,
                offset + got,
            )
        got = start + r


def pwrite_full(fd: int, path: str, offset: int, buffer: memoryview, align: int = 1) -> None:
    """Write all of ``buffer`` at ``offset``; an error or no progress raises
    :class:`StreamIOError` naming the file and offset. After a partial write the
    rest goes from the last ``align`` boundary, as in :func:`pread_full`."""
    n = len(buffer)
    put = 0
    while put < n:
        start = put - put % align
        try:
            w = os.pwritev(fd, [buffer[start:]], offset + start)
        except OSError as exc:
            raise StreamIOError(
                f"write of {path} failed at offset {offset + start}: {exc.strerror}", path, offset + start, exc.errno
            ) from exc
        if start + w <= put:
            raise StreamIOError(
                f"short write of {path} at offset {offset + put}: no progress after {put} of {n} bytes",
                path,
                offset + put,
            )
        put = start + w


class BlockCrc:
    """The CRC-32 of each ``block_bytes`` block of a byte stream fed in pieces of
    any size (the last block may be shorter); ``block_bytes`` None: one CRC-32 of
    everything (manifests before per-block checksums)."""

    def __init__(self, block_bytes: int | None) -> None:
        self.block_bytes = block_bytes
        self._done: list[int] = []
        self._crc = self._filled = 0

    def update(self, data: memoryview | bytes) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            take = len(data) if self.block_bytes is None else min(len(data), self.block_bytes - self._filled)
            self._crc = zlib.crc32(data[:take], self._crc)
            self._filled += take
            data = data[take:]
            if self._filled == self.block_bytes:
                self._done.append(self._crc)
                self._crc = self._filled = 0

    @property
    def blocks(self) -> list[int]:
        return self._done + ([self._crc] if self._filled or self.block_bytes is None else [])


def file_crcs(path: str, size: int, block_bytes: int | None, chunk_bytes: int = 16 << 20) -> list[int]:
    """The checksums of the first ``size`` bytes of file ``path``, as :class:`BlockCrc`
    with ``block_bytes`` computes them (read in chunks of ``chunk_bytes``)."""
    crc = BlockCrc(block_bytes)
    fd = open_file(path, os.O_RDONLY)
    try:
        copy_file_crc32(fd, path, None, "", size, memoryview(bytearray(min(chunk_bytes, max(size, 1)))), crc)
    finally:
        os.close(fd)
    return crc.blocks


def copy_file_crc32(
    src_fd: int, src_path: str, dst_fd: int | None, dst_path: str, size: int, buffer: memoryview, crc: BlockCrc
) -> None:
    """Copy ``size`` bytes from the start of one open file to another through
    ``buffer`` (with ``dst_fd`` None: only read them), feeding them to ``crc``.
    Raises :class:`StreamIOError` naming the file on an error or a short transfer."""
    done = 0
    while done < size:
        chunk = buffer[: min(len(buffer), size - done)]
        # Aligned retries: either side may be a direct-I/O bucket file.
        pread_full(src_fd, src_path, done, chunk, ALIGNMENT)
        crc.update(chunk)
        if dst_fd is not None:
            pwrite_full(dst_fd, dst_path, done, chunk, ALIGNMENT)
        done += len(chunk)
