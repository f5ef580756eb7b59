"""Positional file reads and writes that finish or say why, and block checksums.

:func:`pread_full` / :func:`pwrite_full` move a whole buffer at an offset
(resuming after partial transfers, direct-I/O aligned); :class:`BlockCrc`,
:func:`file_crcs` and :func:`copy_file_crc32` compute the per-block CRC-32 that
checkpoint manifests record. Used by the file backing and by checkpoints.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable

from miles_plugins.optimizers.errors import StreamIOError
from miles_plugins.optimizers.formats.layout import ALIGNMENT
from miles_plugins.optimizers.homes.fs import open_file

# Why a transfer that got no further stopped, as its error says (``done`` of ``total`` bytes).
_EARLY_END = "end of file after {done} of {total} bytes (file truncated?)"
_NO_PROGRESS = "no progress after {done} of {total} bytes"


def pread_full(fd: int, path: str, offset: int, buffer: memoryview, align: int = 1) -> None:
    """Fill ``buffer`` from ``offset``; a read error or an early end of file raises
    :class:`StreamIOError` naming the file and offset. After a partial read the
    rest is asked for from the last ``align`` boundary (direct I/O accepts only
    aligned offsets and lengths; a few bytes are then read twice); a read that
    gets no further than the last one is the end of the file."""
    _transfer_full(os.preadv, "read", _EARLY_END, fd, path, offset, buffer, align)


def pwrite_full(fd: int, path: str, offset: int, buffer: memoryview, align: int = 1) -> None:
    """Write all of ``buffer`` at ``offset``; an error or no progress raises
    :class:`StreamIOError` naming the file and offset. After a partial write the
    rest goes from the last ``align`` boundary, as in :func:`pread_full`."""
    _transfer_full(os.pwritev, "write", _NO_PROGRESS, fd, path, offset, buffer, align)


def _transfer_full(
    transfer: Callable[[int, list[memoryview], int], int],
    verb: str,
    stalled: str,
    fd: int,
    path: str,
    offset: int,
    buffer: memoryview,
    align: int,
) -> None:
    """Move all of ``buffer`` with ``transfer`` (``os.preadv`` or ``os.pwritev``),
    resuming each partial transfer from its last ``align`` boundary; a transfer that
    gets no further raises, ``stalled`` (formatted with ``done`` and ``total``) saying how."""
    total = len(buffer)
    done = 0
    while done < total:
        start = done - done % align
        try:
            moved = transfer(fd, [buffer[start:]], offset + start)
        except OSError as exc:
            raise StreamIOError(
                f"{verb} of {path} failed at offset {offset + start}: {exc.strerror}", path, offset + start, exc.errno
            ) from exc
        if start + moved <= done:
            raise StreamIOError(
                f"short {verb} of {path} at offset {offset + done}: {stalled.format(done=done, total=total)}",
                path,
                offset + done,
            )
        done = start + moved


class BlockCrc:
    """The CRC-32 of each ``block_bytes`` block of a byte stream fed in pieces of
    any size (the last block may be shorter); ``block_bytes`` None: one CRC-32 of
    everything (what manifests without per-block checksums record)."""

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
