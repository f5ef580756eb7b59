"""Which elements two parts of one global tensor share, as strided runs of their local params.

A part (:class:`Box`, from ``megatron/param_facts.py``) is a contiguous range of a
local param that fills a box of its key's global tensor: ``local_shape`` at
``global_offset``, after ``prepend_axis_num`` axes of extent one. Two parts of
one key share the elements of the intersection of their boxes; each row of that
intersection (its last axis) is one contiguous run in both local params, and the
rows follow each other at a fixed stride in each (:class:`Runs`). A row-parallel
weight split the other way has as many rows as the weight, yet stays one
:class:`Runs`: the plan is per pair of boxes, never per row.

:func:`shared_runs` gives those runs; :func:`clipped` keeps of them the elements
inside a range of each local param (a DP shard: an entry of a store), which cuts
at most two rows at each end. Nothing here reads files.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """One part of a param: elements ``[start, start + numel)`` of the local param,
    a box of shape ``[1] * prepend + local_shape`` at ``global_offset`` in the
    global tensor ``key`` of ``global_shape``."""

    key: str
    start: int
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    prepend: int

    @classmethod
    def of(cls, part: dict) -> Box:
        """The box of a part as ``param_facts`` records it."""
        return cls(
            part["key"],
            part["start"],
            tuple(part["local_shape"]),
            tuple(part["global_shape"]),
            tuple(part["global_offset"]),
            part["prepend_axis_num"],
        )

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def cell(self) -> tuple[int, ...]:
        """Its place on the prepended axes (layer, expert): boxes of other cells share nothing."""
        return self.global_offset[: self.prepend]

    @property
    def corner(self) -> tuple[int, ...]:
        """Its offset on the local axes."""
        return self.global_offset[self.prepend :]


@dataclass(frozen=True)
class Runs:
    """``rows`` runs of ``count`` elements: run ``r`` starts at element ``target +
    r * target_stride`` of one local param and at ``source + r * source_stride``
    of the other (strides unused for one row)."""

    target: int
    source: int
    count: int
    rows: int = 1
    target_stride: int = 0
    source_stride: int = 0

    @property
    def numel(self) -> int:
        return self.count * self.rows

    def row(self, r: int) -> tuple[int, int]:
        """Where run ``r`` starts in the target and in the source."""
        return self.target + r * self.target_stride, self.source + r * self.source_stride


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for extent in reversed(shape):
        out.append(step)
        step *= extent
    return out[::-1]


def shared_runs(target: Box, source: Box, limit: tuple[int, ...] | None = None) -> Iterator[Runs]:
    """The elements both boxes hold (and, with ``limit``, whose local coordinates
    are below it: the region two global shapes share), as runs of the two local
    flattenings (part-local: element 0 is the part's first). Same key assumed."""
    if target.cell != source.cell or len(target.corner) != len(source.corner):
        return
    lows, highs = [], []
    for d, (t0, te, s0, se) in enumerate(
        zip(target.corner, target.local_shape, source.corner, source.local_shape, strict=True)
    ):
        low, high = max(t0, s0), min(t0 + te, s0 + se)
        if limit is not None:
            high = min(high, limit[d])
        if high <= low:
            return
        lows.append(low)
        highs.append(high)
    if not lows:  # a param of one element (no local axes)
        yield Runs(0, 0, 1)
        return
    t_strides, s_strides = _strides(target.local_shape), _strides(source.local_shape)

    def offset(corner: tuple[int, ...], strides: list[int], index: tuple[int, ...]) -> int:
        return sum((i - c) * s for i, c, s in zip(index, corner, strides, strict=True))

    count = highs[-1] - lows[-1]
    if len(lows) == 1:
        yield Runs(lows[0] - target.corner[0], lows[0] - source.corner[0], count)
        return
    rows = highs[-2] - lows[-2]
    full = count == target.local_shape[-1] == source.local_shape[-1]
    for outer in itertools.product(*(range(lo, hi) for lo, hi in zip(lows[:-2], highs[:-2], strict=True))):
        first = (*outer, lows[-2], lows[-1])
        t, s = offset(target.corner, t_strides, first), offset(source.corner, s_strides, first)
        if full:  # whole rows of both: one contiguous run
            yield Runs(t, s, count * rows)
        else:
            yield Runs(t, s, count, rows, t_strides[-2], s_strides[-2])


def clipped(runs: Runs, target: tuple[int, int], source: tuple[int, int]) -> list[Runs]:
    """The elements of ``runs`` inside ``[target[0], target[1])`` of the target and
    ``[source[0], source[1])`` of the source: the rows wholly inside as one
    :class:`Runs`, and each row cut by a bound (at most two at each end) as one of its own."""
    if runs.rows == 1:
        return _cut_row(runs, 0, target, source)
    whole = _whole_rows(runs, target, source)
    touched = _touched_rows(runs, target, source)
    if touched[0] > touched[1]:
        return []
    out = []
    if whole[0] > whole[1]:  # no whole row: every touched row is cut (four at most)
        for r in range(touched[0], touched[1] + 1):
            out += _cut_row(runs, r, target, source)
        return out
    for r in range(touched[0], whole[0]):
        out += _cut_row(runs, r, target, source)
    t, s = runs.row(whole[0])
    out.append(Runs(t, s, runs.count, whole[1] - whole[0] + 1, runs.target_stride, runs.source_stride))
    for r in range(whole[1] + 1, touched[1] + 1):
        out += _cut_row(runs, r, target, source)
    return out


def _cut_row(runs: Runs, r: int, target: tuple[int, int], source: tuple[int, int]) -> list[Runs]:
    """Row ``r`` of ``runs`` within both bounds, as a run; [] when nothing is left."""
    t, s = runs.row(r)
    count = runs.count if runs.rows > 1 else runs.numel
    low = max(0, target[0] - t, source[0] - s)
    high = min(count, target[1] - t, source[1] - s)
    return [Runs(t + low, s + low, high - low)] if high > low else []


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _whole_rows(runs: Runs, target: tuple[int, int], source: tuple[int, int]) -> tuple[int, int]:
    """First and last row inside both bounds (first > last: none)."""
    first, last = 0, runs.rows - 1
    for start, stride, (low, high) in (
        (runs.target, runs.target_stride, target),
        (runs.source, runs.source_stride, source),
    ):
        first = max(first, _ceil_div(low - start, stride))
        last = min(last, (high - runs.count - start) // stride)
    return first, last


def _touched_rows(runs: Runs, target: tuple[int, int], source: tuple[int, int]) -> tuple[int, int]:
    """First and last row with an element inside both bounds' spans (first > last: none)."""
    first, last = 0, runs.rows - 1
    for start, stride, (low, high) in (
        (runs.target, runs.target_stride, target),
        (runs.source, runs.source_stride, source),
    ):
        first = max(first, (low - runs.count - start) // stride + 1)
        last = min(last, _ceil_div(high - start, stride) - 1)
    return first, last
