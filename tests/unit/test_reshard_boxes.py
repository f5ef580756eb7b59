"""The shared elements of two parts of one global tensor (``reshard_boxes``), against brute force.

Each case cuts a random global tensor two ways (as two TP/PP/EP layouts would),
each part a random flat window (a DP shard), and compares the runs with the
element pairs found by mapping every local element to its global index.
"""

import itertools
import math
import random

import pytest

from miles_plugins.optimizers.checkpoint.reshard_boxes import Box, Runs, clipped, shared_runs


def _global_index(box: Box, local: int) -> tuple[int, ...]:
    """The global multi-index of element ``local`` (part-local, row-major) of ``box``."""
    index = []
    for extent in reversed(box.local_shape):
        local, i = divmod(local, extent)
        index.append(i)
    return box.cell + tuple(c + i for c, i in zip(box.corner, reversed(index), strict=True))


def _pairs(runs: list[Runs]) -> set[tuple[int, int]]:
    out = set()
    for run in runs:
        for r in range(run.rows):
            t, s = run.row(r)
            for i in range(run.count if run.rows > 1 else run.numel):
                pair = (t + i, s + i)
                assert pair not in out, "an element copied twice"
                out.add(pair)
    return out


def _split(extent: int, rng: random.Random) -> list[tuple[int, int]]:
    """A random cut of [0, extent) into consecutive ranges."""
    cuts = sorted(rng.sample(range(1, extent), rng.randint(0, min(3, extent - 1)))) if extent > 1 else []
    edges = [0, *cuts, extent]
    return list(zip(edges, edges[1:], strict=False))


def _boxes(shape: tuple[int, ...], prepend: int, rng: random.Random) -> list[Box]:
    cuts = [[(i, i + 1) for i in range(e)] if d < prepend else _split(e, rng) for d, e in enumerate(shape)]
    return [
        Box("k", 0, tuple(hi - lo for lo, hi in ranges[prepend:]), shape, tuple(lo for lo, _ in ranges), prepend)
        for ranges in itertools.product(*cuts)
    ]


@pytest.mark.parametrize("seed", range(60))
def test_shared_runs_clipped_to_two_windows_are_exactly_the_shared_elements(seed):
    rng = random.Random(seed)
    prepend = rng.randint(0, 2)
    shape = tuple(rng.randint(1, 3) for _ in range(prepend)) + tuple(
        rng.randint(1, 9) for _ in range(rng.randint(1, 3))
    )
    targets, sources = _boxes(shape, prepend, rng), _boxes(shape, prepend, rng)
    for target in rng.sample(targets, min(4, len(targets))):
        for source in rng.sample(sources, min(4, len(sources))):
            t_window = sorted(rng.sample(range(target.numel + 1), 2))
            s_window = sorted(rng.sample(range(source.numel + 1), 2))
            runs = [c for r in shared_runs(target, source) for c in clipped(r, tuple(t_window), tuple(s_window))]
            at = {_global_index(source, s): s for s in range(*s_window)}
            expected = {(t, at[g]) for t in range(*t_window) if (g := _global_index(target, t)) in at}
            assert _pairs(runs) == expected
            assert len(runs) <= max(1, math.prod(target.local_shape[:-2])) + 4 * max(1, math.prod(shape[prepend:-2]))


def test_a_row_parallel_weight_split_the_other_way_is_one_strided_copy_not_one_per_row():
    """TP 2 -> 1 of a weight split on its last axis: 4096 rows, one Runs per saved half."""
    whole = Box("w", 0, (4096, 8192), (4096, 8192), (0, 0), 0)
    half = Box("w", 0, (4096, 4096), (4096, 8192), (0, 4096), 0)
    runs = list(shared_runs(whole, half))
    assert runs == [Runs(4096, 0, 4096, 4096, 8192, 4096)]
    assert clipped(runs[0], (0, whole.numel), (0, half.numel)) == runs


def test_a_limit_keeps_only_the_region_both_global_shapes_hold():
    """Vocabulary padding: a saved 64-row embedding read into a 60-row one."""
    target = Box("e", 0, (60, 16), (60, 16), (0, 0), 0)
    source = Box("e", 0, (32, 16), (64, 16), (32, 0), 0)
    assert list(shared_runs(target, source, limit=(60, 16))) == [Runs(32 * 16, 0, 28 * 16)]


def test_a_strided_copy_maps_each_saved_element_it_takes_and_no_other():
    """Where remainder exceptions of a saved entry land (``Copy.target_of``)."""
    from miles_plugins.optimizers.checkpoint.reshard_plan import Copy

    copy = Copy("saved", source_offset=5, target_offset=3, count=4, rows=3, source_stride=10, target_stride=6)
    expected = {5 + 10 * r + i: 3 + 6 * r + i for r in range(3) for i in range(4)}
    assert {i: copy.target_of(i) for i in range(40) if copy.target_of(i) is not None} == expected
    single = Copy("saved", source_offset=2, target_offset=7, count=3)
    assert [single.target_of(i) for i in range(6)] == [None, None, 7, 8, 9, None]
