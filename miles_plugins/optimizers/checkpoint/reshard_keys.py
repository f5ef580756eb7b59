"""The remap behind a load at another TP, PP or EP size: saved elements found by key and box.

At another tensor, pipeline or expert parallel size a rank's params are other
local tensors (other slices, other layers, other experts) than any saved rank's,
so param names do not match; the keys and global boxes Megatron checkpoints them
by do (``megatron/param_facts.py``). :class:`SavedBoxes` indexes every saved
entry's range by the boxes of its param's parts; :meth:`SavedBoxes.plan` finds,
for each of this rank's entries, the saved ranges that hold its elements, one
:class:`~miles_plugins.optimizers.checkpoint.reshard_plan.Copy` per pair of
boxes and pair of ranges (strided where a box is cut on another axis).

Only primary copies are read: parts whose ``replica_id`` names the first
pipeline and tensor-parallel copy (a TP-replicated layernorm, the tied output
layer of the last stage are copies of the primary's state); their ranges over
the data-parallel ranks are disjoint. Where a key allows another shape
(Megatron's vocabulary padding, ``allow_shape_mismatch``) the region both shapes
hold is copied and the rest stays zero: moments zero, mains zero (remainder
mains: the loaded param's own value), as Megatron's own load zero-fills it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from miles_plugins.optimizers.checkpoint.manifest import START_FRESH
from miles_plugins.optimizers.checkpoint.reshard_boxes import Box, Runs, clipped, shared_runs
from miles_plugins.optimizers.checkpoint.reshard_plan import Copy, Piece, RemapError

# Most problems a refusal lists.
_LISTED = 4


def is_primary(part: dict) -> bool:
    """Whether a part is the copy a save is read from (replica ids (pipeline copy, TP copy, DP rank))."""
    replica = part.get("replica_id") or [0]
    return all(r == 0 for r in replica[:2])


@dataclass
class _SavedBox:
    """One box of a key and the saved ranges of it: (start, end) in the part, location,
    offset of ``start`` in its saved entry; sorted, disjoint."""

    box: Box
    ranges: list[tuple[int, int, Hashable, int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)


@dataclass
class _SavedKey:
    """Every saved box of one key, by cell (layer and expert), and its total saved elements."""

    global_shape: tuple[int, ...]
    prepend: int
    allow_shape_mismatch: bool
    cells: dict[tuple[int, ...], dict[tuple, _SavedBox]] = field(default_factory=dict)
    saved: int = 0
    somewhere: Hashable | None = None  # a saved range's location: the key's step state


class SavedBoxes:
    """The saved ranges of every key, from ``sources``: (location, saved piece, the
    facts of its param as ``param_facts`` records them)."""

    def __init__(self, sources: Sequence[tuple[Hashable, Piece, dict]]) -> None:
        self.keys: dict[str, _SavedKey] = {}
        for location, piece, facts in sources:
            for part in facts["parts"]:
                if is_primary(part):
                    self._add(location, piece, part)
        for key, saved in self.keys.items():
            for cell in saved.cells.values():
                for box in cell.values():
                    _sort_disjoint(key, box)

    def _add(self, location: Hashable, piece: Piece, part: dict) -> None:
        box = Box.of(part)
        low, high = max(piece.start, box.start) - box.start, min(piece.end, box.start + box.numel) - box.start
        if high <= low:
            return
        saved = self.keys.setdefault(
            box.key, _SavedKey(box.global_shape, box.prepend, bool(part.get("allow_shape_mismatch")))
        )
        if saved.global_shape != box.global_shape or saved.prepend != box.prepend:
            raise RemapError(
                f"key {box.key!r} has global shape {list(saved.global_shape)} in one saved store and "
                f"{list(box.global_shape)} in another: the checkpoint mixes saves of different models"
            )
        cell = saved.cells.setdefault(box.cell, {})
        entry = cell.setdefault((box.corner, box.local_shape, box.start), _SavedBox(box))
        entry.ranges.append((low, high, location, low + box.start - piece.start))
        saved.saved += high - low
        saved.somewhere = saved.somewhere or location

    def plan(self, targets: Sequence[Piece], facts: dict[str, dict]) -> list[list[Copy]]:
        """Per target piece (a live entry: its param name, start, size), the copies that
        fill it; ``facts``: the live params' facts. Raises :class:`RemapError` naming
        what no saved store holds, a key of another shape, or elements held twice."""
        out, problems = [], []
        for target in targets:
            copies: list[Copy] = []
            for part in facts[target.key]["parts"]:
                problem = self._fill(target, Box.of(part), bool(part.get("allow_shape_mismatch")), copies)
                if problem:
                    problems.append(problem)
            if not copies and target.numel:  # all padding: only its step state is read
                saved = self.keys.get(Box.of(facts[target.key]["parts"][0]).key)
                if saved is not None and saved.somewhere is not None:
                    copies.append(Copy(saved.somewhere, 0, 0, 0))
            out.append(copies)
        if problems:
            unique = list(dict.fromkeys(problems))
            raise RemapError(
                "; ".join(unique[:_LISTED]) + (f"; and {len(unique) - _LISTED} more" if len(unique) > _LISTED else "")
            )
        return out

    def _fill(self, target: Piece, box: Box, mismatch_ok: bool, copies: list[Copy]) -> str | None:
        """Add the copies of ``target``'s elements in part ``box``; a problem, or None."""
        window = (max(target.start, box.start) - box.start, min(target.end, box.start + box.numel) - box.start)
        if window[1] <= window[0]:
            return None
        saved = self.keys.get(box.key)
        if saved is None:
            return f"no saved store holds key {box.key!r} (param {target.key}): the checkpoint is of another model: load it into that model, or {START_FRESH}"
        limit = _shared_shape(box, saved, mismatch_ok)
        if isinstance(limit, str):
            return limit
        if saved.saved != math.prod(saved.global_shape):
            return (
                f"the saved stores hold {saved.saved} of the {math.prod(saved.global_shape)} elements of key "
                f"{box.key!r}: a saved rank's store is missing (the checkpoint needs every saved rank's store)"
            )
        copied = 0
        for source in saved.cells.get(box.cell, {}).values():
            for runs in shared_runs(box, source.box, limit):
                copied += self._copies(target, box, window, runs, source, copies)
        needed = _held(box, window, limit)
        if copied != needed:
            what = "are in no saved store" if copied < needed else "are held by more than one saved store"
            return f"param {target.key} (key {box.key!r}): {abs(needed - copied)} of its {needed} elements {what}"
        return None

    @staticmethod
    def _copies(target: Piece, box: Box, window: tuple[int, int], runs: Runs, source: _SavedBox, out: list) -> int:
        """Add the copies of ``runs`` from each saved range of ``source`` it touches; their element count."""
        last = runs.source + (runs.rows - 1) * runs.source_stride + runs.count
        first = max(bisect.bisect_right(source.starts, runs.source) - 1, 0)
        copied = 0
        for low, high, location, offset in source.ranges[first:]:
            if low >= last:
                break
            for c in clipped(runs, window, (low, high)):
                out.append(
                    Copy(
                        location,
                        c.source - low + offset,
                        c.target + box.start - target.start,
                        c.count,
                        c.rows,
                        c.source_stride,
                        c.target_stride,
                    )
                )
                copied += c.numel
        return copied


def _sort_disjoint(key: str, box: _SavedBox) -> None:
    box.ranges.sort(key=lambda r: r[:2])
    for (_, a_end, a_loc, _), (b_start, _, b_loc, _) in zip(box.ranges, box.ranges[1:], strict=False):
        if b_start < a_end:
            raise RemapError(f"key {key!r}: saved ranges {a_loc} and {b_loc} overlap: the checkpoint mixes saves")
    box.starts = [r[0] for r in box.ranges]


def _shared_shape(box: Box, saved: _SavedKey, mismatch_ok: bool) -> tuple[int, ...] | None | str:
    """The local-axis extents both global shapes hold (None: the shapes are equal), or
    the problem of a key whose shape differs where it may not."""
    if box.prepend != saved.prepend or len(box.global_shape) != len(saved.global_shape):
        return f"key {box.key!r} is laid out differently in the checkpoint: it is of another model: load it into that model, or {START_FRESH}"
    if box.global_shape == saved.global_shape:
        return None
    if (
        not (mismatch_ok or saved.allow_shape_mismatch)
        or box.global_shape[: box.prepend] != saved.global_shape[: box.prepend]
    ):
        return (
            f"key {box.key!r} has global shape {list(saved.global_shape)} in the checkpoint and "
            f"{list(box.global_shape)} in this run: it is of another model: load it into that model, or {START_FRESH}"
        )
    return tuple(
        min(a, b) for a, b in zip(box.global_shape[box.prepend :], saved.global_shape[box.prepend :], strict=True)
    )


def _held(box: Box, window: tuple[int, int], limit: tuple[int, ...] | None) -> int:
    """How many elements of ``box``'s ``window`` lie inside ``limit`` (all of them without one)."""
    if limit is None:
        return window[1] - window[0]
    region = Box(box.key, 0, limit, box.global_shape, box.cell + (0,) * len(limit), box.prepend)
    return sum(c.numel for runs in shared_runs(box, region) for c in clipped(runs, window, (0, math.prod(limit))))
