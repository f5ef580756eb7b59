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
    copy's elements read from its saved entry, in turn."""
    out = memoryview(bytearray(numel * itemsize))
    for saved, c in ranges:
        target = out[c.target_offset * itemsize : (c.target_offset + c.count) * itemsize]
        saved.file.read_into(saved.offset + c.source_offset * itemsize, target)
    return out


def requantized_segment(name: str, numel: int, ranges: Iterable[tuple[SavedEntry, Copy]]) -> memoryview:
    """A blockwise 8-bit segment (moment ``name``) of ``numel`` elements in its
    stored form: each copy's values decoded from its saved entry, then quantized
    in this entry's own blocks. Exact where the blocks are the same; elsewhere one
    more rounding, as a step's store adds."""
    signed, sqrt = quant8.MOMENT_FORMATS[name]
    values = torch.empty(numel, dtype=torch.float32)
    for saved, c in ranges:
        target = values[c.target_offset : c.target_offset + c.count]
        if not quant8.quantizes(saved.numel):  # a saved entry too small to quantize is stored as fp32
            saved.file.read_into(saved.offset + c.source_offset * 4, bytes_of(target))
        else:
            target.copy_(_decoded(saved, c, signed, sqrt))
    quant8.encode_in_place(values, signed, sqrt)
    return bytes_of(values)[: quant8.stored_nbytes(numel)]


def _decoded(saved: SavedEntry, c: Copy, signed: bool, sqrt: bool) -> torch.Tensor:
    """A copy's fp32 values, decoded from the saved 8-bit blocks its range touches."""
    first, last = c.source_offset // quant8.BLOCK, (c.source_offset + c.count - 1) // quant8.BLOCK
    start, end = first * quant8.BLOCK, min((last + 1) * quant8.BLOCK, saved.numel)
    codes = torch.empty(end - start, dtype=torch.uint8)
    scales = torch.empty(last - first + 1, dtype=torch.float32)
    saved.file.read_into(saved.offset + start, bytes_of(codes))
    saved.file.read_into(saved.offset + saved.numel + first * 4, bytes_of(scales))  # the scales follow the codes
    decoded = quant8.dequantize_chunk(codes, scales, signed)
    if sqrt:
        decoded.square_()
    return decoded[c.source_offset - start : c.source_offset - start + c.count]


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")
