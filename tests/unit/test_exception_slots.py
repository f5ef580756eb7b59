"""The remainder encoder's exception slots (``fused_remainder.ExceptionSlots``): what the codec
reserves up front covers every bucket's encoding, so the slots' addresses (in the
CUDA graphs' keys) stay put after the first encode; and a reservation that grows
changes the key, so no graph replays into slots that moved. On the CPU: the plan and
the reservation are host logic (the kernels are not launched here; the GPU tier and
the interpreted tests run them)."""

import random

import pytest
import torch

from miles_plugins.optimizers.formats import fused, fused_remainder


def _encoding(sizes: list[int], slots: fused_remainder.ExceptionSlots) -> fused_remainder.RemainderEncoding:
    flats = [torch.empty(n) for n in sizes]
    lows = [f.view(torch.int16)[: f.numel()] for f in flats]
    params = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    singles, groups = fused.plan_sizes(sizes, 1)  # as plan_packed where the kernels serve
    return fused_remainder.RemainderEncoding(
        flats, params, lows, singles=singles, groups=groups, slots=slots, kernels=object()
    )


def test_the_codecs_reservation_covers_every_encoding_of_those_sizes():
    rng = random.Random(3)
    small, large = fused.PACKED_MAX_ELEMENTS, 3 * fused.SCRATCH_ELEMENTS
    for _ in range(200):
        sizes = [rng.choice([0, 1, 300, small, small + 1, rng.randrange(1, large)]) for _ in range(rng.randrange(1, 9))]
        slots = fused_remainder.ExceptionSlots()
        rows, total = fused_remainder.slots_needed(sizes)
        slots.reserve(rows, total, torch.device("cpu"))
        key = slots.key()
        encoding = _encoding(sizes, slots)
        assert (rows, total) == (len(encoding.capacities), sum(encoding.capacities)), sizes
        assert slots.key() == key, sizes  # nothing reallocated: the graphs' keys hold


def test_slots_that_grow_change_the_key_and_never_shrink():
    slots = fused_remainder.ExceptionSlots()
    assert slots.key() is None and slots.nbytes() == 0
    slots.reserve(2, 2048, torch.device("cpu"))
    first = slots.key()
    slots.reserve(1, 1024, torch.device("cpu"))  # within: kept
    assert slots.key() == first
    slots.reserve(3, 1024, torch.device("cpu"))  # more runs: larger, elsewhere
    assert slots.key() != first and slots.counts.shape[0] == 3 and slots.found.numel() == 2048
    assert slots.nbytes() == 3 * 32 * 4 + 2048 * 8
    slots.release()
    assert slots.key() is None


def test_counts_and_slots_share_one_buffer_without_overlap_and_read_back_together(monkeypatch):
    for width in (32, 3):  # the kernels' rows, and an odd width (a row then ends mid-word)
        monkeypatch.setattr(fused_remainder, "_MAX_RUN_CHUNKS", width)
        slots = fused_remainder.ExceptionSlots()
        slots.reserve(3, 100, torch.device("cpu"))
        slots.found.fill_(7)
        slots.counts.fill_(-1)  # every count of every row: the slots must not change
        slots.counts[2, width - 1] = 5
        assert slots.counts.shape == (3, width) and slots.found.numel() == 100
        assert bool((slots.found == 7).all())
        counts, found = slots.read_back(40)
        assert counts.tolist() == slots.counts.tolist() and counts[2, width - 1] == 5
        assert found.numel() == 40 and bool((found == 7).all())
        slots.counts.zero_()  # later launches: the snapshot stays as read
        slots.found.zero_()
        assert counts[2, width - 1] == 5 and bool((found == 7).all())
        with pytest.raises(ValueError, match="101 slots read back from 100"):
            slots.read_back(101)
