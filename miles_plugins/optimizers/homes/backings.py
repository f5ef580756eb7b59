"""Where a bucket's bytes live between steps: the backings of the disk and host homes.

- :class:`FileBacking` (``disk``): one file per bucket and slot, direct I/O
  where the filesystem allows it;
- :class:`HostBacking` (``host``): one pinned host buffer per bucket;
- the ``gpu`` home's, ``DeviceBacking``, is in ``device_backing.py``.

``open(bucket)`` gives a handle (:class:`FileHandle`, :class:`BufferHandle`) whose
``read`` / ``write`` move one chunk between that bucket and a device tensor; the
engines (``engines.py``) schedule those calls. ``export`` / ``restore`` copy a
bucket to and from a checkpoint file. Every backing satisfies
:class:`~miles_plugins.optimizers.homes.protocols.Backing` and every handle
:class:`~miles_plugins.optimizers.homes.protocols.Handle`, so every combination
of backing and engine runs side by side.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence

import torch

from miles_plugins.optimizers.errors import StreamIOError
from miles_plugins.optimizers.formats.layout import ALIGNMENT, BucketLayout, align_up
from miles_plugins.optimizers.homes.file_io import BlockCrc, copy_file_crc32, pread_full, pwrite_full
from miles_plugins.optimizers.homes.fs import open_file
from miles_plugins.optimizers.homes.host_memory import HostMemory

logger = logging.getLogger(__name__)


class FileHandle:
    """A bucket's files opened for one pass: ``read`` from ``read_path``, ``write``
    to ``write_path`` (the same file, or the other slot). Each call moves one
    chunk (at most the staging buffer) at an aligned offset; with direct I/O the
    transfer is rounded up to the alignment, which the layout reserves as padding."""

    on_caller_stream = dma = False

    def __init__(self, read_path: str, write_path: str, direct: bool, *, io_queue: int = 0) -> None:
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

    def view_of(self, offset: int, tensor: torch.Tensor) -> None:
        """Files hold no tensor to share (see ``BufferHandle.view_of``)."""
        return None

    def _span(self, n: int) -> int:
        return align_up(n) if self.direct else n

    @property
    def _align(self) -> int:
        return ALIGNMENT if self.direct else 1

    def close(self) -> None:
        """Close both files, each once (an fd closed twice may by then be another file's),
        even where the first close reports an error; the first error is raised."""
        fds = dict.fromkeys(fd for fd in (self.write_fd, self.read_fd) if fd is not None)
        self.read_fd = self.write_fd = None
        failure = None
        for fd in fds:
            try:
                os.close(fd)
            except OSError as exc:
                failure = failure or exc
        if failure is not None:
            raise StreamIOError(f"closing {self.write_path}: {failure.strerror}", self.write_path, 0, failure.errno)


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
        *,
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

    def lends(self, bucket: BucketLayout, device: torch.device) -> bool:
        """Files and host memory lend no bytes to device tensors (``DeviceBacking.lends``)."""
        return False

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
        return FileHandle(self.path(bucket), self.path(bucket, write_slot), self.direct, io_queue=self.io_queue)

    def commit(self) -> None:
        """The slot a step wrote becomes the state (one-slot buckets were written in place)."""
        self.committed = 1 - self.committed

    def snapshot(self) -> int:
        """The committed slot: a step writes the other one, the step after it this one."""
        return self.committed

    def overwrites(self, bucket: BucketLayout, snapshot: int) -> bool:
        return not self.keeps_previous_state_of(bucket) or 1 - self.committed == snapshot

    def export(
        self,
        bucket: BucketLayout,
        dst_fd: int,
        dst_path: str,
        buffer: HostMemory,
        crc: BlockCrc,
        snapshot: int | None = None,
    ) -> None:
        """Copy the bucket's committed bytes (or the slot ``snapshot`` names) into an open file, through ``crc``."""
        path = self.path(bucket, snapshot)
        fd = open_file(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))  # as the steps read it
        try:
            copy_file_crc32(fd, path, dst_fd, dst_path, bucket.file_size, buffer.view, crc)
        finally:
            os.close(fd)

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
    copies on the caller's thread and stream; ``dma`` (pinned host memory, CUDA
    tensors): inside a step it queues them as asynchronous copies on its own copy
    streams (see :class:`PipelinedEngine`). ``read`` / ``write`` copy on the current stream
    (returning once the bytes are there for host memory; device-to-device
    copies are queued like any kernel); ``read_async`` / ``write_async`` queue
    a non-blocking copy on the current stream. ``shared``: :meth:`view_of` lends the
    buffer's bytes to tensors on its device (the gpu home's)."""

    io_queue = 0

    def __init__(
        self,
        buffer: torch.Tensor,
        name: str,
        *,
        on_caller_stream: bool = False,
        dma: bool = False,
        shared: bool = False,
    ) -> None:
        self.buffer = buffer
        self.read_path = self.write_path = name
        self.on_caller_stream = on_caller_stream
        self.dma = dma
        self.shared = shared

    def view_of(self, offset: int, tensor: torch.Tensor) -> torch.Tensor | None:
        """The buffer's bytes from ``offset`` as a tensor of ``tensor``'s dtype and shape,
        where the buffer lends them (``shared``) and lives on ``tensor``'s device; else
        None (the caller copies)."""
        if not self.shared or self.buffer.device != tensor.device:
            return None
        nbytes = tensor.numel() * tensor.element_size()
        return self.buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)

    def read(self, offset: int, dst: torch.Tensor, staging: HostMemory | None) -> None:
        dst.copy_(self.buffer[offset : offset + dst.numel()])

    def write(self, offset: int, src: torch.Tensor, staging: HostMemory | None) -> None:
        self.buffer[offset : offset + src.numel()].copy_(src)

    def read_async(self, offset: int, dst: torch.Tensor) -> None:
        dst.copy_(self.buffer[offset : offset + dst.numel()], non_blocking=True)

    def write_async(self, offset: int, src: torch.Tensor) -> None:
        self.buffer[offset : offset + src.numel()].copy_(src, non_blocking=True)

    def close(self) -> None:
        pass


class WrittenInPlace:
    """What a backing with one copy of each bucket (memory) answers: a step writes over
    the live bytes, so a snapshot names them as they are and every write overwrites them."""

    def keeps_previous_state_of(self, bucket: BucketLayout) -> bool:
        return False

    def snapshot(self) -> None:
        return None

    def overwrites(self, bucket: BucketLayout, snapshot: None) -> bool:
        return True


class HostBacking(WrittenInPlace):
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

    def lends(self, bucket: BucketLayout, device: torch.device) -> bool:
        """Files and host memory lend no bytes to device tensors (``DeviceBacking.lends``)."""
        return False

    def open(self, bucket: BucketLayout, in_place: bool = False) -> BufferHandle:
        """The bucket's buffer, read and written in place (the host home has no spare)."""
        memory = self.buffers[bucket.index]
        return BufferHandle(memory.tensor, f"<host memory of bucket {bucket.index}>", dma=memory.pinned)

    def commit(self) -> None:
        pass

    def export(
        self, bucket: BucketLayout, dst_fd: int, dst_path: str, buffer: HostMemory, crc: BlockCrc, snapshot: None = None
    ) -> None:
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
