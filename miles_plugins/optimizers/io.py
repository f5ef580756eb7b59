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
            self._pread_full(fd, path, offset + done, n)
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
            self._pwrite_full(fd, path, offset + done, n)
            done += n

    def _pread_full(self, fd: int, path: str, offset: int, n: int) -> None:
        got = 0
        while got < n:
            try:
                r = os.preadv(fd, [self.staging.view[got:n]], offset + got)
            except OSError as exc:
                raise StreamIOError(
                    f"read of {path} failed at offset {offset + got}: {exc.strerror}",
                    path,
                    offset + got,
                    exc.errno,
                ) from exc
            if r == 0:
                raise StreamIOError(
                    f"short read of {path} at offset {offset + got}: end of file after "
                    f"{got} of {n} bytes (file truncated?)",
                    path,
                    offset + got,
                )
            got += r

    def _pwrite_full(self, fd: int, path: str, offset: int, n: int) -> None:
        put = 0
        while put < n:
            try:
                w = os.pwritev(fd, [self.staging.view[put:n]], offset + put)
            except OSError as exc:
                raise StreamIOError(
                    f"write of {path} failed at offset {offset + put}: {exc.strerror}",
                    path,
                    offset + put,
                    exc.errno,
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
        n = min(len(buffer), size - done)
        chunk = buffer[:n]
        got = 0
        while got < n:
            try:
                r = os.preadv(src_fd, [chunk[got:]], done + got)
            except OSError as exc:
                raise StreamIOError(
                    f"read of {src_path} failed at offset {done + got}: {exc.strerror}", src_path, done + got, exc.errno
                ) from exc
            if r == 0:
                raise StreamIOError(
                    f"short read of {src_path} at offset {done + got}: the file ends before the "
                    f"{size} bytes expected (truncated?)",
                    src_path,
                    done + got,
                )
            got += r
        crc = zlib.crc32(chunk, crc)
        put = 0
        while put < n:
            try:
                w = os.pwritev(dst_fd, [chunk[put:]], done + put)
            except OSError as exc:
                raise StreamIOError(
                    f"write of {dst_path} failed at offset {done + put}: {exc.strerror}",
                    dst_path,
                    done + put,
                    exc.errno,
                ) from exc
            if w == 0:
                raise StreamIOError(f"short write of {dst_path} at offset {done + put}", dst_path, done + put)
            put += w
        done += n
    return crc
