"""The fused codec kernels (``formats/fused.py``): where they do not build, the reference
serves; and, run by Triton's interpreter on the CPU, against the reference formulations:
the same codes, scales, low bits and exceptions for a launch's entries (several, some
16-byte aligned and some not, over several tiles so that tiles wait on others),
and the exceptions past the device's slots converted by the host's fallback.

The interpreter executes the kernels' own code with numpy, one program after another
(so it checks their logic, not their ordering under concurrency, nor the compiled GPU
code: ``tests/gpu/test_fused_codec.py`` does that). Needs Triton (GPU machines have it;
the CPU venv does not install it: about 1 GB)."""

import importlib.util
import logging
import os
import subprocess
import sys
import types

import pytest
import torch

from miles_plugins.optimizers import formats
from miles_plugins.optimizers.formats import convert, fused, quant8, remainder

NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

# Tiles of 512 elements (two 8-bit blocks): entries below span up to 137 tiles, so waits
# chain (tile j on j // 4 ... on 0).
TILE = 512


def _moment(numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g) * 3) * 1e-3
    m[: quant8.BLOCK] = 0
    if numel >= 2 * quant8.BLOCK:  # a block of exact ties: scale 1, every midpoint itself
        m[quant8.BLOCK] = 1.0
        m[quant8.BLOCK + 1 : 2 * quant8.BLOCK] = quant8._tables(True, m.device)[1]
    if numel > 3000:
        m[2000], m[2600] = float("inf"), float("nan")
    return m


def _in_one_storage(values: list[torch.Tensor], skews: list[int], dtype=torch.float32) -> list[torch.Tensor]:
    """Copies of ``values`` side by side in one storage, entry k ``skews[k]`` elements after
    the previous one ends (an odd skew: not 16-byte aligned)."""
    storage = torch.zeros(sum(v.numel() for v in values) + sum(skews), dtype=dtype)
    out, at = [], 0
    for v, skew in zip(values, skews, strict=True):
        at += skew
        out.append(storage[at : at + v.numel()])
        out[-1].copy_(v)
        at += v.numel()
    return out


def _check_quant8(sizes: list[int], skews: list[int]) -> None:
    for name in quant8.MOMENT_FORMATS:
        signed, sqrt = quant8.MOMENT_FORMATS[name]
        xs = [_moment(n, seed) for seed, n in enumerate(sizes)]
        xs = [x.abs() if sqrt else x for x in xs]
        references, kernels = [x.clone() for x in xs], _in_one_storage(xs, skews)
        for r in references:
            quant8.narrow_in_place(r, signed, sqrt)
        scale_bytes = [quant8._codes_and_scales(k)[1] for k in kernels]
        fused.quant8_narrow(kernels, scale_bytes, quant8._search_guide(signed, xs[0].device), sqrt, quant8.BLOCK)
        for r, k in zip(references, kernels, strict=True):
            stored = quant8.stored_nbytes(k.numel())
            assert torch.equal(r.view(torch.uint8)[:stored], k.view(torch.uint8)[:stored]), (name, k.numel())
        fused.quant8_widen(kernels, scale_bytes, quant8._tables(signed, xs[0].device)[0], sqrt, quant8.BLOCK)
        for r, k in zip(references, kernels, strict=True):
            quant8.widen_in_place(r, signed, sqrt)
            assert torch.equal(r.view(torch.int32), k.view(torch.int32)), (name, k.numel())


def _mains(sizes: list[int], every: int = 97) -> list[torch.Tensor]:
    mains = []
    for n in sizes:
        main = torch.randn(n, generator=torch.Generator().manual_seed(n))
        ties = torch.arange(0, n, every)
        main.view(torch.int32)[ties] = (main.view(torch.int32)[ties] & ~0xFFFF) | 0x18000
        main[min(7, n - 1)], main[min(300, n - 1)] = float("nan"), float("inf")
        mains.append(main)
    return mains


def _check_remainder(mains: list[torch.Tensor], skews: list[int]) -> tuple[int, list]:
    """Encode and decode ``mains`` in one launch against the reference; the exceptions'
    count, and the ranges ``(entry length, s, e)`` the host's fallback converted."""
    params = [m.bfloat16() for m in mains]
    references = [m.clone() for m in mains]
    expected = [remainder.encode_in_place(r, p) for r, p in zip(references, params, strict=True)]
    kernels, kernel_params = _in_one_storage(mains, skews), _in_one_storage(params, skews[::-1], torch.bfloat16)
    fallback = []

    def reference(flat, param, s, e):
        fallback.append((flat.numel(), s, e))
        return remainder._encode_range(flat, param, s, e)

    found = fused.remainder_encode(kernels, kernel_params, reference)
    for r, k, e, (index, high) in zip(references, kernels, expected, found, strict=True):
        assert torch.equal(e.index, index) and torch.equal(e.high, high), k.numel()
        assert torch.equal(remainder.stored_view(r, torch.int16), k.view(torch.int16)[: k.numel()]), k.numel()
    fused.remainder_decode(kernels, kernel_params, found)
    for main, k in zip(mains, kernels, strict=True):
        assert torch.equal(main.view(torch.int32), k.view(torch.int32)), k.numel()
    return sum(len(e) for e in expected), fallback


def _check_exception_overflow() -> None:
    """Past the device's slots, what stood down is converted by the host's reference, and
    the bytes and exceptions are still the reference's: an entry of NaN mains (every
    tile stands down), a NaN run in the middle of one (its tile, and the tiles whose
    low bits land on it or on those), and an entry after it (once a reservation has
    failed, every later one does)."""
    fused._EXCEPTION_SLOTS = 4
    every = torch.empty(3000)
    every.view(torch.int32)[:] = 0x7FC01234  # NaN mains, every one an exception
    middle = torch.randn(20000, generator=torch.Generator().manual_seed(2))
    middle[[5, 1500, 19990]] = float("nan")
    middle.view(torch.int32)[2100:2120] = 0x7FC05678
    after = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    after[[10]] = float("nan")
    count, fallback = _check_remainder([every, middle, after], [0, 1, 3])
    assert count >= 3000 + 23 + 1 and (3000, 0, 3000) in fallback  # all of it, in one call
    count, fallback = _check_remainder([middle, after], [0, 0])
    # The run's tile [2048, 2560), tiles 8-9, 16-19, ... (their low bits land on it, or on
    # those: one call per run of tiles), and what needed a slot after it.
    assert count >= 23 + 1 and fallback[0] == (20000, 2048, 2560) and (20000, 4096, 5120) in fallback
    assert not any(n == 20000 and s <= 2560 < e for n, s, e in fallback)  # its neighbour fitted
    fused._EXCEPTION_SLOTS = 1 << 16


def _check_buckets_entries_together() -> None:
    """``*_many`` as the codec calls them for a bucket, the fused path forced on (on the
    CPU it never applies): an entry too small to quantize and an empty one among them;
    every entry's stored bytes are its reference's, and decode restores every bit."""
    sizes = [300, 512, 100, 0, 4096, 5000, 256]
    moments = _in_one_storage([_moment(n, n).abs() for n in sizes], [0, 1, 0, 0, 2, 0, 0])
    mains = _in_one_storage(_mains(sizes[:3], every=3) + [torch.empty(0)] + _mains(sizes[4:], every=3), [0] * 7)
    params = [m.bfloat16() for m in mains]
    expected_moments = [m.clone() for m in moments]
    quant8.narrow_many(expected_moments, signed=False, sqrt=True)  # the reference: CPU tensors
    widened = [m.clone() for m in expected_moments]
    quant8.widen_many(widened, signed=False, sqrt=True)
    expected_mains = [m.clone() for m in mains]
    expected_exceptions = remainder.encode_many(expected_mains, params)
    applies = fused.applies
    fused.applies = lambda t: True
    try:
        quant8.narrow_many(moments, signed=False, sqrt=True)
        for e, g in zip(expected_moments, moments, strict=True):
            assert torch.equal(torch.cat(quant8._codes_and_scales(e)), torch.cat(quant8._codes_and_scales(g)))
        quant8.widen_many(moments, signed=False, sqrt=True)
        for e, g in zip(widened, moments, strict=True):
            assert torch.equal(e.view(torch.int32), g.view(torch.int32))
        originals = [m.clone() for m in mains]
        found = remainder.encode_many(mains, params)
        for e, g, a, b in zip(expected_mains, mains, expected_exceptions, found, strict=True):
            assert torch.equal(remainder.stored_view(e, torch.int16), remainder.stored_view(g, torch.int16))
            assert torch.equal(a.index, b.index) and torch.equal(a.high, b.high)
        assert sum(len(e) for e in found) > 1000
        remainder.decode_many(mains, params, found)
        for main, g in zip(originals, mains, strict=True):
            assert torch.equal(main.view(torch.int32), g.view(torch.int32))
    finally:
        fused.applies = applies


def _guided_codes(v: torch.Tensor, signed: bool) -> torch.Tensor:
    """The quantize kernel's search (``triton_kernels.quantize``), restated in torch."""
    midpoints, guide = fused.search_guide(quant8._tables(signed, torch.device("cpu"))[1])
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
    values, midpoints = quant8._tables(signed, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    spread = torch.rand(1_000_000, generator=g) * 10 ** (-12 * torch.rand(1_000_000, generator=g))
    edges = torch.cat([midpoints, values, torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 2.0**-30, 1.5])])
    edges = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)])
    v = torch.cat([edges, spread])
    v = torch.cat([v, -v])
    assert torch.equal(_guided_codes(v, signed), torch.bucketize(v, midpoints))


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
    fused._checked_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=fused.__name__):
            assert fused.kernels() is None
        assert "fused codec kernels unavailable on cpu (RuntimeError: PTX assembly failed)" in caplog.text
    finally:
        fused._checked_kernels.cache_clear()


def test_a_launch_refuses_tensors_of_two_devices():
    """Offsets from one entry's pointer to another's mean nothing across devices (a
    caller's bug, not a bucket the codec builds): refused before anything is launched."""
    with pytest.raises(ValueError, match="one launch converts tensors of one device"):
        fused.Launch([torch.zeros(8), torch.zeros(8, device="meta")], [0, 0])


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
    assert fused.kernels() is not None  # built, and its self-test passed (the shipped tile sizes)
    fused._TILE = TILE
    convert.CHUNK_ELEMENTS = TILE  # the reference and the fallback in chunks too
    _check_quant8([256, 1000, TILE, 5000, 70001], [0, 1, 0, 3, 0])
    _check_quant8([70001], [0])
    assert _check_remainder(_mains([1, 256, 1000, TILE, 5000, 70001]), [0, 1, 0, 3, 0, 2])[1] == []
    assert _check_remainder(_mains([70001]), [0])[1] == []
    _check_exception_overflow()
    _check_buckets_entries_together()
    print("ok")
