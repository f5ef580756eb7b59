"""The fused codec kernels (``formats/fused.py``, ``formats/fused_remainder.py``): where
they do not build, the reference serves; and, run by Triton's interpreter on the CPU,
against the reference formulations: the same codes, scales, low bits and exceptions, and
the in-place chunk order (scratch chunk, then geometric chunks) with a small scratch.

The interpreter executes the kernels' own code with numpy, so this checks their logic,
not the compiled GPU code (``tests/gpu/test_fused_codec.py`` does that). Needs Triton
(GPU machines have it; the CPU venv does not install it: about 1 GB)."""

import importlib.util
import logging
import os
import subprocess
import sys
import types

import pytest
import torch

from miles_plugins.optimizers import formats
from miles_plugins.optimizers.formats import convert, entry_codecs, fused, fused_remainder, kernels, quant8, remainder
from miles_plugins.optimizers.formats.convert import stored_view

NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

SCRATCH = 1024  # elements: entries below take several geometric chunks


def _kernels():
    """The interpreted kernels, as the registry gives them for the CPU."""
    return kernels.for_device(torch.device("cpu"))


def _moment(numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g) * 3) * 1e-3
    m[: quant8.BLOCK] = 0
    if numel >= 2 * quant8.BLOCK:  # a block of exact ties: scale 1, every midpoint itself
        m[quant8.BLOCK] = 1.0
        m[quant8.BLOCK + 1 : 2 * quant8.BLOCK] = quant8.tables(True, m.device)[1]
    if numel > 3000:
        m[2000], m[2600] = float("inf"), float("nan")
    return m


def _check_quant8(numel: int) -> None:
    for name, x in (("exp_avg", _moment(numel, 0)), ("exp_avg_sq", _moment(numel, 0) ** 2)):
        signed, sqrt = quant8.MOMENT_FORMATS[name]
        reference, kernel = x.clone(), x.clone()
        quant8.encode_in_place(reference, signed, sqrt)
        codes, scales_bytes = quant8.codes_and_scales(kernel)
        scales = torch.empty(-(-numel // quant8.BLOCK))
        guide = fused.quant8_guide(signed, x.device)
        fused.quant8_encode(kernel.view(-1), codes, scales, guide, sqrt, quant8.BLOCK, _kernels())
        scales_bytes.copy_(scales.view(torch.uint8))
        stored = quant8.stored_nbytes(numel)
        ref_bytes, kernel_bytes = reference.view(torch.uint8)[:stored], kernel.view(torch.uint8)[:stored]
        assert torch.equal(ref_bytes[:numel], kernel_bytes[:numel]), (numel, name)
        ref_scales, kernel_scales = ref_bytes[numel:].clone().view(torch.float32), scales
        nan = torch.isnan(ref_scales)
        assert torch.equal(nan, torch.isnan(kernel_scales))
        assert torch.equal(ref_scales[~nan].view(torch.int32), kernel_scales[~nan].view(torch.int32)), (numel, name)
        decoded = reference.clone()
        quant8.decode_in_place(reference, signed, sqrt)
        codes, scales_bytes = quant8.codes_and_scales(decoded)
        fused.quant8_decode(
            decoded.view(-1),
            codes,
            scales_bytes.clone().view(torch.float32),
            quant8.tables(signed, x.device)[0],
            sqrt,
            quant8.BLOCK,
            _kernels(),
        )
        assert torch.equal(reference.view(torch.int32), decoded.view(torch.int32)), (numel, name)


def _check_remainder(numel: int) -> None:
    g = torch.Generator().manual_seed(1)
    main = torch.randn(numel, generator=g)
    ties = torch.arange(0, numel, 97)
    main.view(torch.int32)[ties] = (main.view(torch.int32)[ties] & ~0xFFFF) | 0x18000
    main[min(7, numel - 1)], main[min(300, numel - 1)] = float("nan"), float("inf")
    param = main.bfloat16()
    reference = main.clone()
    exceptions = remainder.encode_in_place(reference, param)
    kernel = main.clone()
    low = stored_view(kernel, torch.int16)
    found = fused_remainder.remainder_encode(kernel, param, low, _kernels())
    assert len(exceptions) >= numel // 97
    assert torch.equal(found.index, exceptions.index) and torch.equal(found.high, exceptions.high)
    assert torch.equal(reference.view(torch.int16)[:numel], kernel.view(torch.int16)[:numel])
    fused.remainder_decode_by_rule(kernel.view(-1), param.view(-1), low, _kernels())
    remainder.put_exceptions(kernel, found)
    assert torch.equal(kernel.view(torch.int32), main.view(torch.int32))


def _check_exception_overflow() -> None:
    capacity, fused_remainder.exception_capacity = fused_remainder.exception_capacity, lambda n: 4
    every = torch.empty(3000)
    every.view(torch.int32)[:] = 0x7FC01234  # NaN mains, every one an exception: every chunk overflows
    # Chunks [0, 1024), [1024, 2048), [2048, 4096), [4096, 5000): only the third overflows;
    # the fourth stands down, then runs again after the third's fallback.
    middle = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    middle[[5, 1500, 4500, 4990]] = float("nan")
    middle.view(torch.int32)[2100:2120] = 0x7FC05678
    for main, expected in ((every, 3000), (middle, 24)):
        param = main.bfloat16()
        reference, kernel = main.clone(), main.clone()
        exceptions = remainder.encode_in_place(reference, param)
        low = stored_view(kernel, torch.int16)
        found = fused_remainder.remainder_encode(kernel, param, low, _kernels())
        assert len(found) == expected
        assert torch.equal(found.index, exceptions.index) and torch.equal(found.high, exceptions.high)
        assert torch.equal(reference.view(torch.int16)[: main.numel()], kernel.view(torch.int16)[: main.numel()])
        fused.remainder_decode_by_rule(kernel.view(-1), param.view(-1), low, _kernels())
        remainder.put_exceptions(kernel, found)
        assert torch.equal(kernel.view(torch.int32), main.view(torch.int32))
    fused_remainder.exception_capacity = capacity


def _guided_codes(v: torch.Tensor, signed: bool) -> torch.Tensor:
    """The quantize kernel's search (``triton_kernels.quantize``), restated in torch."""
    midpoints, guide = fused.search_guide(quant8.tables(signed, torch.device("cpu"))[1])
    bits = v.view(torch.int32)
    key = (((bits & 0x7FFFFFFF) >> fused.GUIDE_SHIFT) - fused.GUIDE_FIRST).clamp(0, fused.GUIDE_SLICES - 1)
    below = guide[(key + torch.where(bits < 0, fused.GUIDE_SLICES, 0)).long()].long()
    code = below + (midpoints[below] < v).long() + (midpoints[below + 1] < v).long()
    return torch.where(torch.isnan(v), 255, code)


@pytest.mark.parametrize("signed", [True, False])
def test_the_search_guide_counts_what_bucketize_counts(signed):
    """Every midpoint, its float neighbours, the map's values, +-0, +-inf, NaN, subnormals
    and a million quotients across the decades: the guide and two comparisons give
    ``torch.bucketize``'s code (the reference's), so the kernel needs no binary search."""
    values, midpoints = quant8.tables(signed, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    spread = torch.rand(1_000_000, generator=g) * 10 ** (-12 * torch.rand(1_000_000, generator=g))
    edges = torch.cat([midpoints, values, torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 2.0**-30, 1.5])])
    edges = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)])
    v = torch.cat([edges, spread])
    v = torch.cat([v, -v])
    assert torch.equal(_guided_codes(v, signed), torch.bucketize(v, midpoints))


def _check_packed() -> None:
    """Entries converted packed (``fused.*_packed`` and ``fused_remainder``'s groups, as
    ``entry_codecs`` calls them on CUDA) store each entry's own reference bytes."""
    sizes = [256, 5 * 256, 3 * 256]  # whole blocks, as plan_packed groups them
    for name in quant8.MOMENT_FORMATS:
        signed, sqrt = quant8.MOMENT_FORMATS[name]
        xs = [_moment(n, seed) for seed, n in enumerate(sizes)]
        xs[1][300] = float("nan")  # a NaN block in the middle entry only
        xs = [x.abs() if sqrt else x for x in xs]
        references, got = [x.clone() for x in xs], [x.clone() for x in xs]
        for r in references:
            quant8.encode_in_place(r, signed, sqrt)
        stored = [quant8.codes_and_scales(k) for k in got]
        guide = fused.quant8_guide(signed, xs[0].device)
        fused.quant8_encode_packed(got, stored, guide, sqrt, quant8.BLOCK, _kernels())
        for r, (codes, scale_bytes) in zip(references, stored, strict=True):
            assert torch.equal(torch.cat(quant8.codes_and_scales(r)), torch.cat([codes, scale_bytes])), name
        values = quant8.tables(signed, xs[0].device)[0]
        fused.quant8_decode_packed(got, stored, values, sqrt, quant8.BLOCK, _kernels())
        for r, k in zip(references, got, strict=True):
            quant8.decode_in_place(r, signed, sqrt)
            assert torch.equal(r.view(torch.int32), k.view(torch.int32)), name
    default = fused_remainder.exception_capacity
    for capacity in (default, lambda n: 4):  # 4: the group overflows them
        fused_remainder.exception_capacity = capacity
        mains = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (7, 1000, 333)]
        for main in mains:
            main.view(torch.int32)[::5] = (main.view(torch.int32)[::5] & ~0xFFFF) | 0x18000  # ties
        mains[1][[3, 999]] = float("nan")
        params = [m.bfloat16() for m in mains]
        references, got = [m.clone() for m in mains], [m.clone() for m in mains]
        expected = [remainder.encode_in_place(r, p) for r, p in zip(references, params, strict=True)]
        lows = [stored_view(k, torch.int16) for k in got]
        slots = fused_remainder.ExceptionSlots()
        encoding = fused_remainder.RemainderEncoding(
            got, params, lows, singles=[], groups=[[0, 1, 2]], slots=slots, kernels=_kernels()
        )
        encoding.launch()
        found = encoding.finish()
        for r, low, e, f in zip(references, lows, expected, found, strict=True):
            assert torch.equal(stored_view(r, torch.int16), low)
            assert torch.equal(e.index, f.index) and torch.equal(e.high, f.high)
        fused.remainder_decode_by_rule_packed(got, params, lows, _kernels())
        for k, f in zip(got, found, strict=True):
            remainder.put_exceptions(k, f)
        for main, k in zip(mains, got, strict=True):
            assert torch.equal(main.view(torch.int32), k.view(torch.int32))
    fused_remainder.exception_capacity = default


def _check_shared_slots_keep_earlier_exceptions() -> None:
    """As the codec encodes bucket after bucket into one ``ExceptionSlots``: the
    exceptions a bucket's encoding returned are its own, not views of the slots or of
    their host snapshot, so the next bucket's encoding (an overflow and its fallback
    included) leaves them as they were."""
    slots = fused_remainder.ExceptionSlots()

    def bucket(seed: int, sizes: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        mains = [torch.randn(n, generator=torch.Generator().manual_seed(seed + n)) for n in sizes]
        for main in mains:
            main.view(torch.int32)[::5] = (main.view(torch.int32)[::5] & ~0xFFFF) | 0x18000  # ties
        return mains, [m.bfloat16() for m in mains]

    serve, capacity = kernels.serve, fused_remainder.exception_capacity
    kernels.serve = lambda t: True
    try:
        mains_a, params_a = bucket(1, [4096, 300, 70001])
        expected = entry_codecs.remainder_encode_many([m.clone() for m in mains_a], params_a)
        encoding = entry_codecs.RemainderBucketEncoding([m.clone() for m in mains_a], params_a, slots)
        encoding.launch()
        found_a = encoding.finish()
        snapshot = [(e.index.clone(), e.high.clone()) for e in found_a]
        fused_remainder.exception_capacity = lambda n: 64  # bucket b overflows: its fallback reads back again
        mains_b, params_b = bucket(2, [4096, 300, 70001])
        encoding = entry_codecs.RemainderBucketEncoding([m.clone() for m in mains_b], params_b, slots)
        encoding.launch()
        encoding.finish()
    finally:
        kernels.serve, fused_remainder.exception_capacity = serve, capacity
    for e, a, (index, high) in zip(expected, found_a, snapshot, strict=True):
        assert len(e) > 0
        assert torch.equal(a.index, index) and torch.equal(a.high, high)
        assert torch.equal(a.index, e.index) and torch.equal(a.high, e.high)


def _check_buckets_entries_together() -> None:
    """``entry_codecs.*_many`` as the codec calls them for a bucket, the packing forced on
    (on the CPU the kernels never serve): entries of partial blocks alone, the others
    packed in two groups; every entry's stored bytes are its reference's, and decode
    restores every bit."""
    sizes = [300, 512, 1024, 256, 4096, 512, 256]  # packed: at most 512 each, 1024 a group
    moments = [_moment(n, n).abs() for n in sizes]
    mains = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in sizes]
    for main in mains:
        main.view(torch.int32)[::3] = (main.view(torch.int32)[::3] & ~0xFFFF) | 0x18000  # ties
    params = [m.bfloat16() for m in mains]
    expected_moments = [m.clone() for m in moments]
    entry_codecs.quant8_encode_many(expected_moments, signed=False, sqrt=True)  # the reference: CPU tensors
    decoded = [m.clone() for m in expected_moments]
    entry_codecs.quant8_decode_many(decoded, signed=False, sqrt=True)
    expected_mains = [m.clone() for m in mains]
    expected_exceptions = entry_codecs.remainder_encode_many(expected_mains, params)
    serve = kernels.serve
    kernels.serve = lambda t: True
    try:
        assert entry_codecs.plan_packed(moments, unit=quant8.BLOCK) == ([0, 2, 4], [[1, 3], [5, 6]])
        got = [m.clone() for m in moments]
        entry_codecs.quant8_encode_many(got, signed=False, sqrt=True)
        for e, g in zip(expected_moments, got, strict=True):
            assert torch.equal(torch.cat(quant8.codes_and_scales(e)), torch.cat(quant8.codes_and_scales(g)))
        entry_codecs.quant8_decode_many(got, signed=False, sqrt=True)
        for e, g in zip(decoded, got, strict=True):
            assert torch.equal(e.view(torch.int32), g.view(torch.int32))
        default = fused_remainder.exception_capacity
        # Every run within its slots; then every run over them but the longest entry's
        # first run, which overflows at its second chunk (342 exceptions per 1024 elements).
        for capacity in (default, lambda n: 400 if n >= 4096 else 64):
            fused_remainder.exception_capacity = capacity
            got = [m.clone() for m in mains]
            found = entry_codecs.remainder_encode_many(got, params)
            for e, g, a, b in zip(expected_mains, got, expected_exceptions, found, strict=True):
                assert torch.equal(stored_view(e, torch.int16), stored_view(g, torch.int16))
                assert torch.equal(a.index, b.index) and torch.equal(a.high, b.high)
            entry_codecs.remainder_decode_by_rule_many(got, params)
            for g, exceptions in zip(got, found, strict=True):
                remainder.put_exceptions(g, exceptions)
            for main, g in zip(mains, got, strict=True):
                assert torch.equal(main.view(torch.int32), g.view(torch.int32))
        fused_remainder.exception_capacity = default
    finally:
        kernels.serve = serve


def test_kernels_that_do_not_build_leave_the_reference_with_a_warning(monkeypatch, caplog):
    """A Triton that cannot compile here (no compiler, a read-only cache directory) shows
    when the kernels are first wanted, before any state is converted. The kernels module
    is a stand-in whose launch fails: no compile failure can be provoked for real here."""

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("PTX assembly failed")

    stand_in = types.ModuleType("triton_kernels")
    stand_in.quantize = stand_in.dequantize = stand_in.remainder_encode = stand_in.remainder_decode = Broken()
    monkeypatch.setitem(sys.modules, "miles_plugins.optimizers.formats.triton_kernels", stand_in)
    monkeypatch.setattr(formats, "triton_kernels", stand_in, raising=False)  # were it imported already
    kernels._checked.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=kernels.__name__):
            assert kernels.for_device() is None
        assert "fused codec kernels unavailable on cpu (RuntimeError: PTX assembly failed)" in caplog.text
    finally:
        kernels._checked.cache_clear()


@NEEDS_TRITON
def test_interpreted_kernels_store_the_reference_bytes():
    # The interpreter is chosen when the kernels are decorated: a process of its own.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "ok"


if __name__ == "__main__":
    fused.SCRATCH_ELEMENTS, fused.PACKED_MAX_ELEMENTS = SCRATCH, SCRATCH // 2
    convert.CHUNK_ELEMENTS = SCRATCH // 2  # the reference, the fallback and decode's exceptions in chunks too
    assert kernels.for_device() is not None  # built, and its self-test (lengths after the scratch's) passed
    for numel in (256, 1000, SCRATCH, 5000, 70001):
        _check_quant8(numel)
        _check_remainder(numel)
    _check_exception_overflow()
    _check_packed()
    _check_buckets_entries_together()
    _check_shared_slots_keep_earlier_exceptions()
    # Runs of two chunks: an entry of 8 chunks takes four runs, overflowing or not.
    fused_remainder._MAX_RUN_CHUNKS = 2
    _check_remainder(70001)
    _check_exception_overflow()
    print("ok")
