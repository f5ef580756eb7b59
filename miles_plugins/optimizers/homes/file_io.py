"""Positional file reads and writes that finish or say why, and block checksums.

:func:`pread_full` / :func:`pwrite_full` move a whole buffer at an offset
(resuming after partial transfers, direct-I/O aligned); :class:`BlockCrc`,
:func:`file_crcs` and :func:`copy_file_crc32` compute the per-block CRC-32 that
checkpoint manifests record. Used by the file backing and by checkpoints.
"""

from __future__ import annotations

import os
import zlib

from miles_plugins.optimizers.errors import StreamIOError
from miles_plugins.optimizers.formats.layout import ALIGNMENT
from miles_plugins.optimizers.homes.fs import open_file


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
