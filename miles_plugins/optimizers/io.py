"""Moving bytes between bucket files and device tensors through a bounded staging buffer.

Every transfer passes through one host staging buffer in chunks of at most its
size, so host memory stays fixed however large the optimizer state grows. The
same code serves CPU tensors and CUDA tensors; with CUDA the buffer is pinned so
host<->device copies run at full PCIe speed.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import zlib

import torch


class StreamIOError(OSError):
    """A read or write of a bucket file that could not complete.

    ``path`` and ``offset`` name where it failed; ``errno`` carries the OS error
    when there was one.
    """

    def __init__(self, message: str, path: str, offset: int, err: int | None = None) -> None:
        super().__init__(err if err is not None else errno.EIO, message)
        self.path = path
        self.offset = offset

    def __str__(self) -> str:
        return self.strerror


class StagingBuffer:
    """A fixed-size host buffer: pinned when CUDA is available, page-aligned otherwise."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        if pin:
            # cudaHostAlloc memory is page-aligned and lets copies run as DMA.
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            # An anonymous mapping is page-aligned, which direct I/O will need.
            self._mapping = mmap.mmap(-1, nbytes)
            self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)
        # A memoryview over the same bytes, for os.preadv / os.pwritev.
        self.view = memoryview((ctypes.c_ubyte * nbytes).from_address(self.tensor.data_ptr())).cast("B")


def open_bucket_file(path: str, create: bool = False) -> int:
    """Open a bucket file for reading and writing, never through a symlink."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    if create:
        flags |= os.O_CREAT | os.O_EXCL
    try:
        return os.open(path, flags, 0o600)
    except OSError as exc:
        raise StreamIOError(f"cannot open bucket file {path}: {exc.strerror}", path, 0, exc.errno) from exc


def preallocate(fd: int, path: str, size: int) -> None:
    """Reserve the file's full size now so a full disk fails at setup, not mid-step."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise StreamIOError(f"cannot reserve {size} bytes for {path}: {exc.strerror}", path, 0, exc.errno) from exc


class SyncFileEngine:
    """Synchronous buffered I/O: one chunk at a time through one staging buffer.

    ``read`` fills a flat uint8 view of a tensor from a file range; ``write``
    stores one. Both raise :class:`StreamIOError` naming the file and offset on
    any error or on a transfer that cannot complete.
    """

    def __init__(self, staging: StagingBuffer) -> None:
        self.staging = staging

    def read(self, fd: int, path: str, offset: int, dst: torch.Tensor) -> None:
        total = dst.numel()
        done = 0
        while done < total:
            n = min(self.staging.nbytes, total - done)
            pread_full(fd, path, offset + done, self.staging.view[:n])
            dst[done : done + n].copy_(self.staging.tensor[:n])
            done += n

    def write(self, fd: int, path: str, offset: int, src: torch.Tensor) -> None:
        total = src.numel()
        done = 0
        while done < total:
            n = min(self.staging.nbytes, total - done)
            # The copy into staging finishes before pwritev reads the buffer:
            # copy_ from a device tensor into pageable/pinned memory is synchronous.
            self.staging.tensor[:n].copy_(src[done : done + n])
            pwrite_full(fd, path, offset + done, self.staging.view[:n])
            done += n


def pread_full(fd: int, path: str, offset: int, buffer: memoryview) -> None:
    """Fill ``buffer`` from ``offset``; a read error or an early end of file raises
    :class:`StreamIOError` naming the file and offset."""
    n = len(buffer)
    got = 0
    while got < n:
        try:
            r = os.preadv(fd, [buffer[got:]], offset + got)
        except OSError as exc:
            raise StreamIOError(
                f"read of {path} failed at offset {offset + got}: {exc.strerror}", path, offset + got, exc.errno
            ) from exc
        if r == 0:
            raise StreamIOError(
                f"short read of {path} at offset {offset + got}: end of file after {got} of {n} bytes "
                "(file truncated?)",
                path,
                offset + got,
            )
        got += r


def pwrite_full(fd: int, path: str, offset: int, buffer: memoryview) -> None:
    """Write all of ``buffer`` at ``offset``; an error or no progress raises
    :class:`StreamIOError` naming the file and offset."""
    n = len(buffer)
    put = 0
    while put < n:
        try:
            w = os.pwritev(fd, [buffer[put:]], offset + put)
        except OSError as exc:
            raise StreamIOError(
                f"write of {path} failed at offset {offset + put}: {exc.strerror}", path, offset + put, exc.errno
            ) from exc
        if w == 0:
            raise StreamIOError(
                f"short write of {path} at offset {offset + put}: no progress after {put} of {n} bytes",
                path,
                offset + put,
            )
        put += w


def copy_file_crc32(src_fd: int, src_path: str, dst_fd: int, dst_path: str, size: int, buffer: memoryview) -> int:
    """Copy ``size`` bytes from the start of one open file to another through
    ``buffer``; returns the CRC-32 of the bytes copied. Raises
    :class:`StreamIOError` naming the file on an error or a short transfer."""
    crc = 0
    done = 0
    while done < size:
        chunk = buffer[: min(len(buffer), size - done)]
        pread_full(src_fd, src_path, done, chunk)
        crc = zlib.crc32(chunk, crc)
        pwrite_full(dst_fd, dst_path, done, chunk)
        done += len(chunk)
    return crc
