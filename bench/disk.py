"""The disk bound: what the drive under a directory does with direct I/O.

Measured the way the pipelined engine uses the drive (aligned requests of one
staging chunk, ``threads`` in flight per direction, ``O_DIRECT`` so the page
cache plays no part): reads alone, writes alone, and reads and writes at the
same time (a drive may or may not overlap them). :func:`step_bound` turns the
rates into the least time a step's bytes can take.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from dataclasses import asdict, dataclass

from miles_plugins.optimizers.homes.file_io import pread_full, pwrite_full
from miles_plugins.optimizers.homes.host_memory import HostMemory


@dataclass
class DiskRates:
    """Bytes per second; ``mixed_*`` were measured with both directions busy at once."""

    read: float
    write: float
    mixed_read: float
    mixed_write: float
    test_bytes: int
    direct: bool

    def as_dict(self) -> dict:
        return asdict(self)


def step_bound(rates: DiskRates, bytes_read: int, bytes_written: int) -> float:
    """Seconds the measured drive needs at least for a step's bytes: the better of
    one direction after the other and both at once (each at its measured rate)."""
    one_after_other = bytes_read / rates.read + bytes_written / rates.write
    both_at_once = max(bytes_read / rates.mixed_read, bytes_written / rates.mixed_write)
    return min(one_after_other, both_at_once)


def _open(path: str, direct: bool) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if direct else 0), 0o600)


def _transfer(fd: int, path: str, size: int, chunk: int, threads: int, write: bool) -> float:
    """Move ``size`` bytes of one file in ``chunk`` requests, ``threads`` in flight; returns seconds."""
    buffers = [HostMemory(chunk, pin=False) for _ in range(threads)]
    offsets = iter(range(0, size, chunk))

    def worker(buffer: HostMemory) -> None:
        for offset in offsets:  # shared iterator: each request goes to the next free thread
            view = buffer.view[: min(chunk, size - offset)]
            (pwrite_full if write else pread_full)(fd, path, offset, view)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(worker, b) for b in buffers]:
            future.result()
    if write:
        os.fsync(fd)
    return time.perf_counter() - start


def measure(directory: str, size: int, chunk: int, threads: int) -> DiskRates:
    """Measure the drive under ``directory`` with two files of ``size`` bytes (removed after)."""
    size = max(chunk, size // chunk * chunk)
    paths = [os.path.join(directory, f".disk-bound-{os.getpid()}-{i}") for i in range(2)]
    direct = True
    try:
        try:
            fds = [_open(p, True) for p in paths]
        except OSError:
            direct = False
            fds = [_open(p, False) for p in paths]
        for fd in fds:
            os.posix_fallocate(fd, 0, size)
        # Write both files once first: the state files are overwritten in place every
        # step, and a first write into fallocated (unwritten) extents is slower.
        for fd, path in zip(fds, paths, strict=True):
            _transfer(fd, path, size, chunk, threads, write=True)
        write = size / _transfer(fds[1], paths[1], size, chunk, threads, write=True)
        read = size / _transfer(fds[0], paths[0], size, chunk, threads, write=False)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            reading = pool.submit(_transfer, fds[0], paths[0], size, chunk, threads, False)
            writing = pool.submit(_transfer, fds[1], paths[1], size, chunk, threads, True)
            mixed_read, mixed_write = size / reading.result(), size / writing.result()
        for fd in fds:
            os.close(fd)
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
    return DiskRates(read, write, mixed_read, mixed_write, size, direct)
