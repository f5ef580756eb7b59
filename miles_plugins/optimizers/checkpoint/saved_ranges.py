"""Reading element ranges of saved stores back, every byte verified.

A read covers whole checksum blocks of the saved file (``manifest.CRC_BLOCK_BYTES``)
and checks each block's CRC-32 (:class:`VerifiedFile`). One live entry's stored
segment is assembled from the saved ranges a reshard plan names for it
(:class:`~miles_plugins.optimizers.checkpoint.reshard_plan.Copy`): elementwise
formats (fp32 and bf16 moments, fp32 and remainder mains) byte for byte
(:func:`copied_segment`); blockwise 8-bit moments decoded from the saved blocks
a range touches and quantized again in the entry's own blocks
(:func:`requantized_segment`). Host memory: one entry's segment, and one
checksum block per open file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from miles_plugins.optimizers.checkpoint.manifest import Manifest, crc_mismatch
from miles_plugins.optimizers.checkpoint.reshard_plan import Copy
from miles_plugins.optimizers.errors import CheckpointMismatchError
from miles_plugins.optimizers.formats import quant8
from miles_plugins.optimizers.homes.file_io import BlockCrc, pread_full
from miles_plugins.optimizers.homes.fs import open_file


class VerifiedFile:
    """Reads of any byte range of a saved file, each covering whole checksum blocks
    whose CRC-32s are checked (the last block read is kept for the next read)."""

    def __init__(self, path: str, manifest: Manifest, name: str) -> None:
        self.path, self.size = path, manifest.files[name]["size"]
        self.block_bytes, self.crcs = manifest.block_bytes, manifest.crcs(name)
        self.fd = open_file(path, os.O_RDONLY)
        self._last_block: tuple[int, bytearray] | None = None

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes from ``offset``, every block they touch verified."""
        n, b = len(out), self.block_bytes
        if offset < 0 or offset + n > self.size:
            raise CheckpointMismatchError(f"{self.path}: bytes {offset}-{offset + n - 1} are past its end")
        done = 0
        while done < n:
            index, within = divmod(offset + done, b)
            block = self._verified_block(index)
            take = min(n - done, len(block) - within)
            out[done : done + take] = block[within : within + take]
            done += take

    def _verified_block(self, index: int) -> bytearray:
        if self._last_block is None or self._last_block[0] != index:
            data = bytearray(min(self.block_bytes, self.size - index * self.block_bytes))
            pread_full(self.fd, self.path, index * self.block_bytes, memoryview(data))
            crc = BlockCrc(None)
            crc.update(data)
            mismatch = crc_mismatch(crc.blocks, [self.crcs[index]], None)
            if mismatch:
                raise CheckpointMismatchError(f"{self.path}: block {index}: {mismatch}: the checkpoint is corrupt")
            self._last_block = (index, data)
        return self._last_block[1]

    def close(self) -> None:
        os.close(self.fd)


class SavedFiles:
    """Saved files opened for verified reads, each once, all closed together
    (a context manager)."""

    def __init__(self) -> None:
        self._files: dict[str, VerifiedFile] = {}

    def open(self, directory: str, manifest: Manifest, name: str) -> VerifiedFile:
        """File ``name`` of the saved store in ``directory`` (whose manifest is ``manifest``)."""
        path = os.path.join(directory, name)
        if path not in self._files:
            self._files[path] = VerifiedFile(path, manifest, name)
        return self._files[path]

    def close(self) -> None:
        for file in self._files.values():
            file.close()

    def __enter__(self) -> SavedFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class SavedEntry:
    """Where one saved entry's segment lies: its file, the byte offset at which the
    segment starts, and the entry's element count."""

    file: VerifiedFile
    offset: int
    numel: int


def copied_segment(itemsize: int, numel: int, ranges: Iterable[tuple[SavedEntry, Copy]]) -> memoryview:
    """An elementwise segment of ``numel`` elements of ``itemsize`` bytes: each
    copy's elements read from its saved entry, in turn; elements no copy names
    stay zero."""
    out = memoryview(bytearray(numel * itemsize))
    for saved, c in ranges:
        if c.rows == 1:
            target = out[c.target_offset * itemsize : (c.target_offset + c.count) * itemsize]
            saved.file.read_into(saved.offset + c.source_offset * itemsize, target)
            continue
        rows = torch.frombuffer(out, dtype=torch.uint8) if len(out) else None
        for first, count in _row_chunks(c, itemsize):
            span = bytearray(((count - 1) * c.source_stride + c.count) * itemsize)
            saved.file.read_into(
                saved.offset + (c.source_offset + first * c.source_stride) * itemsize, memoryview(span)
            )
            _place_rows(rows, torch.frombuffer(span, dtype=torch.uint8), c, first, count, itemsize)
    return out


def requantized_segment(name: str, numel: int, ranges: Iterable[tuple[SavedEntry, Copy]]) -> memoryview:
    """A blockwise 8-bit segment (moment ``name``) of ``numel`` elements in its
    stored form: each copy's values decoded from its saved entry, then quantized
    in this entry's own blocks (elements no copy names are zero). Exact where the
    blocks are the same; elsewhere one more rounding, as a step's store adds."""
    signed, sqrt = quant8.MOMENT_FORMATS[name]
    values = torch.zeros(numel, dtype=torch.float32)
    for saved, c in ranges:
        if c.count == 0:
            continue
        for first, count in _row_chunks(c, 4):
            span = _saved_values(
                saved, c.source_offset + first * c.source_stride, (count - 1) * c.source_stride + c.count, signed, sqrt
            )
            _place_rows(values, span, c, first, count, 1)
    quant8.encode_in_place(values, signed, sqrt)
    return bytes_of(values)[: quant8.stored_nbytes(numel)]


# Saved bytes read at once for the rows of one strided copy.
_SPAN_BYTES = 16 << 20


def _row_chunks(c: Copy, itemsize: int) -> Iterable[tuple[int, int]]:
    """(first row, row count) of ``c``'s rows in groups whose saved span stays near ``_SPAN_BYTES``."""
    per = max(1, _SPAN_BYTES // max(1, c.source_stride * itemsize)) if c.rows > 1 else 1
    for first in range(0, c.rows, per):
        yield first, min(per, c.rows - first)


def _place_rows(out: torch.Tensor, span: torch.Tensor, c: Copy, first: int, count: int, itemsize: int) -> None:
    """Rows ``first`` to ``first + count`` of ``c`` from ``span`` (the saved elements from
    the first of them on) into ``out``, in units of ``itemsize`` (bytes or values)."""
    width = c.count * itemsize
    source = span.as_strided((count, width), (c.source_stride * itemsize, 1))
    at = (c.target_offset + first * c.target_stride) * itemsize
    out.as_strided((count, width), (c.target_stride * itemsize, 1), at).copy_(source)


def _saved_values(saved: SavedEntry, first: int, count: int, signed: bool, sqrt: bool) -> torch.Tensor:
    """Elements ``[first, first + count)`` of a saved 8-bit entry, as fp32 values (an entry
    too small to quantize is stored as fp32)."""
    if not quant8.quantizes(saved.numel):
        values = torch.empty(count, dtype=torch.float32)
        saved.file.read_into(saved.offset + first * 4, bytes_of(values))
        return values
    low, high = first // quant8.BLOCK, (first + count - 1) // quant8.BLOCK
    start, end = low * quant8.BLOCK, min((high + 1) * quant8.BLOCK, saved.numel)
    codes = torch.empty(end - start, dtype=torch.uint8)
    scales = torch.empty(high - low + 1, dtype=torch.float32)
    saved.file.read_into(saved.offset + start, bytes_of(codes))
    saved.file.read_into(saved.offset + saved.numel + low * 4, bytes_of(scales))  # the scales follow the codes
    decoded = quant8.dequantize_chunk(codes, scales, signed)
    if sqrt:
        decoded.square_()
    return decoded[first - start : first - start + count]


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")
