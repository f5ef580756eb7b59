"""Bucket planning and the on-disk layout of one bucket file.

A bucket file holds three segments in this order: ``main`` (fp32, or the
int16 low bits of remainder mains), ``exp_avg`` and ``exp_avg_sq`` (the
moment storage dtype, or blockwise 8-bit codes and scales: ``quant8.py``).
A bucket of fp32 params, which are their own mains, has no ``main`` segment:
its mains are the params, in the model.
Inside a segment, entries follow in bucket order, each slice starting on an
``ALIGNMENT`` boundary so direct I/O can address it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from miles_plugins.optimizers.formats import quant8

# O_DIRECT needs file offsets, lengths and buffers aligned to the logical block
# size; 4096 covers every NVMe and filesystem we target.
ALIGNMENT = 4096

MAIN_DTYPE = torch.float32
SEGMENTS = ("main", "exp_avg", "exp_avg_sq")
MOMENT_SEGMENTS = SEGMENTS[1:]

# Bytes one element costs while materialized on the device: fp32 main and two
# fp32 moments, whatever the storage dtype.
MATERIALIZED_BYTES_PER_ELEMENT = 3 * MAIN_DTYPE.itemsize


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def plan_buckets(numels: Sequence[int], keys: Sequence[Hashable], cap_elements: int) -> list[list[int]]:
    """Group entry indices by key, then cut each group into buckets of at most
    ``cap_elements`` elements, keeping entry order.

    Keys are grouped in order of first appearance. An entry larger than the cap
    gets a bucket of its own; empty entries (0 elements) are dropped.
    """
    if cap_elements <= 0:
        raise ValueError(f"bucket cap must be > 0, got {cap_elements}")
    if len(numels) != len(keys):
        raise ValueError(f"{len(numels)} sizes but {len(keys)} keys")
    by_key: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        by_key.setdefault(key, []).append(index)

    buckets: list[list[int]] = []
    for indices in by_key.values():
        current: list[int] = []
        current_numel = 0
        for index in indices:
            numel = numels[index]
            if numel == 0:
                continue
            if current and current_numel + numel > cap_elements:
                buckets.append(current)
                current, current_numel = [], 0
            current.append(index)
            current_numel += numel
        if current:
            buckets.append(current)
    return buckets


@dataclass(frozen=True)
class Segment:
    """One segment of a bucket file: where each entry's slice lives."""

    name: str
    dtype: torch.dtype  # element by element; the codes' dtype when blockwise
    entry_offsets: tuple[int, ...]  # absolute file offset of each entry's slice
    entry_nbytes: tuple[int, ...]  # unpadded length of each entry's slice
    blockwise: bool = False  # 8-bit codes and per-block scales (quant8.py)

    def stored_nbytes(self, numel: int) -> int:
        """Bytes of the stored form of an entry of ``numel`` elements."""
        return quant8.stored_nbytes(numel) if self.blockwise else numel * self.dtype.itemsize


@dataclass(frozen=True)
class BucketLayout:
    """The file layout of one streaming bucket."""

    index: int
    entry_indices: tuple[int, ...]  # indices into the store's entry list
    numels: tuple[int, ...]
    segments: dict[str, Segment]
    file_name: str
    file_size: int

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def streams_main(self) -> bool:
        """False for a bucket of fp32 params: their mains are the params, in the model."""
        return "main" in self.segments

    def description(self) -> dict:
        """What a manifest records of this bucket (``"main": false``: fp32 params' moments only)."""
        return {
            "file": self.file_name,
            "size": self.file_size,
            "numels": list(self.numels),
            **({} if self.streams_main else {"main": False}),
        }

    @property
    def materialized_bytes(self) -> int:
        """Bytes of fp32 state this bucket occupies while it is on the device (its
        main, if it streams one, and both moments)."""
        return self.numel * MAIN_DTYPE.itemsize * len(self.segments)

    @property
    def converted_bytes(self) -> int:
        """Of :attr:`materialized_bytes`, those a step still materializes where the
        bucket's home lends its bytes (the ``gpu`` home): the segments whose stored form
        is not fp32 (remainder mains, bf16 or 8-bit moments), decoded into fp32 of their own."""
        converted = sum(1 for s in self.segments.values() if s.blockwise or s.dtype != MAIN_DTYPE)
        return self.numel * MAIN_DTYPE.itemsize * converted


def layout_store(
    entries: Sequence[tuple[int, int, Hashable, bool]],
    cap_elements: int,
    moment_dtype: torch.dtype,
    main_dtype: torch.dtype,
    blockwise_moments: bool,
) -> list[BucketLayout]:
    """A store's buckets. ``entries``: (id, elements, bucket key, is its own main) of
    each streamed entry, ids recorded as the buckets' ``entry_indices``. Entries with
    mains to stream come first, then those that are their own mains (fp32 params:
    moments only) in buckets of their own, last in the walk: they update their params
    in place, so a failure before them still rolls back. Each kind is cut by
    :func:`plan_buckets`."""
    buckets: list[BucketLayout] = []
    for with_main in (True, False):
        kind = [e for e in entries if e[3] != with_main]
        plan = plan_buckets([numel for _, numel, _, _ in kind], [key for _, _, key, _ in kind], cap_elements)
        buckets += [
            layout_bucket(
                len(buckets) + b,
                [kind[j][0] for j in members],
                [kind[j][1] for j in members],
                moment_dtype,
                main_dtype,
                blockwise_moments,
                with_main,
            )
            for b, members in enumerate(plan)
        ]
    return buckets


def layout_bucket(
    index: int,
    entry_indices: Sequence[int],
    numels: Sequence[int],
    moment_dtype: torch.dtype,
    main_dtype: torch.dtype = MAIN_DTYPE,
    blockwise_moments: bool = False,
    with_main: bool = True,
) -> BucketLayout:
    """Lay out the segments of one bucket file, every slice aligned; ``main_dtype``
    is how mains are stored (fp32, or int16 remainders); ``blockwise_moments``:
    the moments are 8-bit codes (``moment_dtype`` uint8) with per-block scales;
    ``with_main`` False: moments only (fp32 params, their own mains)."""
    offset = 0
    segments = {}
    for name in SEGMENTS if with_main else MOMENT_SEGMENTS:
        moment = name in MOMENT_SEGMENTS
        shape = Segment(name, moment_dtype if moment else main_dtype, (), (), blockwise=moment and blockwise_moments)
        offsets, lengths = [], []
        for numel in numels:
            offsets.append(offset)
            lengths.append(shape.stored_nbytes(numel))
            offset = align_up(offset + lengths[-1])
        segments[name] = Segment(name, shape.dtype, tuple(offsets), tuple(lengths), shape.blockwise)
    return BucketLayout(
        index=index,
        entry_indices=tuple(entry_indices),
        numels=tuple(numels),
        segments=segments,
        file_name=f"bucket_{index:05d}.bin",
        file_size=offset,
    )
