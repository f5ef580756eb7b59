"""The remap behind a load at another data-parallel size, as plain code.

Every streamed entry is a contiguous element range of one param: :class:`Piece`
(the param's identity, where the range starts in the param, how many elements).
Under the distributed optimizer each DP rank owns, per DDP bucket, one
contiguous range of the bucket's buffer, and Megatron pads buffers per DP size
(each param's start to 64 elements, each bucket's end to a multiple of
``lcm(dp, 128)``). Padding belongs to no param, so in param coordinates a
sharding is only a partition of each param's elements, whatever the DP size:
loading at DP=M what was saved at DP=N means finding, for each of this rank's
pieces, the saved pieces that cover it (:func:`plan`).

Nothing here reads files or knows storage formats: the caller turns each
:class:`Copy` into byte ranges of the saved files (elementwise formats), or
decodes and re-encodes (blockwise 8-bit moments).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


class RemapError(ValueError):
    """The saved pieces do not cover, or cover twice, what this rank needs."""


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + numel)`` of the param named ``key``."""

    key: str
    start: int
    numel: int

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Copy:
    """``count`` elements from ``source`` (a saved piece's location) at element
    ``source_offset`` within that piece, to ``target_offset`` within the target piece;
    ``rows`` such runs, run ``r`` at ``r * source_stride`` and ``r * target_stride``
    further (a box cut on another axis than its last, ``reshard_keys``)."""

    source: Hashable
    source_offset: int
    target_offset: int
    count: int
    rows: int = 1
    source_stride: int = 0
    target_stride: int = 0

    @property
    def numel(self) -> int:
        return self.count * self.rows

    def target_of(self, source_index: int) -> int | None:
        """Where element ``source_index`` of the saved piece lands in the target piece;
        None when this copy does not take it."""
        at = source_index - self.source_offset
        row, within = divmod(at, self.source_stride) if self.rows > 1 else (0, at)
        if at < 0 or row >= self.rows or not 0 <= within < self.count:
            return None
        return self.target_offset + row * self.target_stride + within


def plan(targets: Sequence[Piece], sources: Sequence[tuple[Hashable, Piece]]) -> list[list[Copy]]:
    """Per target piece, the copies that fill it exactly once, in target order.

    ``sources`` pairs each saved piece with its location (any hashable the caller
    resolves, e.g. (store, bucket, entry)). Raises :class:`RemapError` when two
    saved pieces overlap (mixed saves), or when some element a target needs is in
    no saved piece (naming the param and the missing range).
    """
    saved = _saved_ranges_by_param(sources)
    return [_copies_filling(target, *saved.get(target.key, ([], []))) for target in targets]


# One saved piece as [start, end) in its param, and its location.
_SavedRange = tuple[int, int, Hashable]


def _saved_ranges_by_param(sources: Sequence[tuple[Hashable, Piece]]) -> dict[str, tuple[list[int], list[_SavedRange]]]:
    """Per param, its saved pieces' starts and ranges in element order; raises on an overlap."""
    by_key: dict[str, list[_SavedRange]] = {}
    for location, piece in sources:
        if piece.numel > 0:
            by_key.setdefault(piece.key, []).append((piece.start, piece.end, location))
    saved = {}
    for key, ranges in by_key.items():
        ranges.sort(key=lambda r: (r[0], r[1]))
        for (a_start, a_end, a_loc), (b_start, _, b_loc) in zip(ranges, ranges[1:], strict=False):
            if b_start < a_end:
                raise RemapError(
                    f"param {key!r}: saved pieces {a_loc} [{a_start}, {a_end}) and {b_loc} from {b_start} overlap: "
                    "the checkpoint mixes saves"
                )
        saved[key] = ([r[0] for r in ranges], ranges)
    return saved


def _copies_filling(target: Piece, starts: list[int], ranges: list[_SavedRange]) -> list[Copy]:
    """The copies from one param's saved ``ranges`` (sorted, with their ``starts``)
    that fill ``target``; raises naming the first element none holds."""
    here, out = target.start, []
    # The last saved piece starting at or before the target's first element.
    i = max(bisect.bisect_right(starts, here) - 1, 0)
    while here < target.end:
        if i < len(ranges) and ranges[i][1] <= here:
            i += 1  # that piece ends before the target starts; the next one starts after it
        if i >= len(ranges) or ranges[i][0] > here:
            gap_end = min(ranges[i][0], target.end) if i < len(ranges) else target.end
            raise RemapError(
                f"param {target.key!r}: elements [{here}, {gap_end}) are in no saved piece "
                f"(this rank needs [{target.start}, {target.end}))"
            )
        start, end, location = ranges[i]
        count = min(end, target.end) - here
        out.append(Copy(location, here - start, here - target.start, count))
        here += count
        i += 1
    return out
