"""Bucket planning edges and the on-disk layout, checked against the real files."""

import os

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
from miles_plugins.optimizers.formats.layout import ALIGNMENT, SEGMENTS, layout_bucket, plan_buckets


def test_buckets_respect_the_cap_and_keep_order():
    assert plan_buckets([4, 4, 4, 4], [None] * 4, cap_elements=8) == [[0, 1], [2, 3]]
    assert plan_buckets([3, 3, 3], [None] * 3, cap_elements=8) == [[0, 1], [2]]


def test_an_entry_larger_than_the_cap_gets_its_own_bucket():
    assert plan_buckets([2, 50, 2, 2], [None] * 4, cap_elements=8) == [[0], [1], [2, 3]]


def test_buckets_never_mix_keys_and_group_by_first_appearance():
    keys = ["a", "b", "a", "b", "a"]
    assert plan_buckets([1, 1, 1, 1, 1], keys, cap_elements=100) == [[0, 2, 4], [1, 3]]


def test_empty_entries_are_dropped():
    assert plan_buckets([0, 5, 0], [None] * 3, cap_elements=10) == [[1]]


def test_non_positive_cap_is_refused_by_the_planner():
    with pytest.raises(ValueError, match="cap"):
        plan_buckets([1], [None], cap_elements=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_every_slice_is_aligned_and_segments_do_not_overlap(dtype):
    layout = layout_bucket(0, [0, 1, 2], [1, 1025, 3000], dtype)
    spans = []
    for name in SEGMENTS:
        segment = layout.segments[name]
        assert segment.dtype == (torch.float32 if name == "main" else dtype)
        for offset, nbytes, numel in zip(segment.entry_offsets, segment.entry_nbytes, layout.numels, strict=True):
            assert offset % ALIGNMENT == 0
            assert nbytes == numel * segment.dtype.itemsize
            spans.append((offset, offset + nbytes))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert layout.file_size % ALIGNMENT == 0 and layout.file_size >= spans[-1][1]


def _train(model, optimizer, steps):
    for step in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_bucket_files_hold_the_state_at_the_layout_offsets(tmp_path, moment_dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.Linear(300, 8)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = StreamConfig(directory=str(tmp_path), bucket_cap_elements=2000, moment_dtype=moment_dtype)
    with StreamedOptimizer(optimizer, config) as streamed:
        _train(model, optimizer, 3)
        store = streamed.store
        expected = {index: (main, m, v) for index, main, m, v in store.iter_state()}
        for bucket in store.buckets:
            path = store._backing.file_backing(bucket).path(bucket)
            assert os.path.getsize(path) == bucket.file_size
            raw = open(path, "rb").read()
            for k, index in enumerate(bucket.entry_indices):
                for s, name in enumerate(SEGMENTS):
                    segment = bucket.segments[name]
                    start = segment.entry_offsets[k]
                    stored = torch.frombuffer(
                        bytearray(raw[start : start + segment.entry_nbytes[k]]), dtype=segment.dtype
                    )
                    want = expected[index][s].reshape(-1)
                    if name == "main" or moment_dtype == "fp32":
                        assert torch.equal(stored, want)
                    else:
                        assert torch.equal(stored.float(), want)


def test_bf16_moments_take_two_bytes_per_element_on_disk(tmp_path):
    model = torch.nn.Linear(1024, 1024, bias=False).to(torch.bfloat16)
    sizes = {}
    for dtype in ("fp32", "bf16"):
        optimizer = torch.optim.AdamW(model.parameters())
        config = StreamConfig(directory=str(tmp_path / dtype), moment_dtype=dtype)
        with StreamedOptimizer(optimizer, config) as streamed:
            (bucket,) = streamed.store.buckets
            sizes[dtype] = os.path.getsize(streamed.store._backing.file_backing(bucket).path(bucket))
    n = 1024 * 1024
    assert sizes["fp32"] == n * (4 + 4 + 4)
    assert sizes["bf16"] == n * (4 + 2 + 2)
