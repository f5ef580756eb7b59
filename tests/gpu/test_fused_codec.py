"""GPU tier for the fused codec kernels (``formats/fused.py``): the bytes they store are
the CPU reference's, over entries of several tiles (which wait on each other),
with zero, infinite and NaN values and rounding ties; a bucket's entries in separate
allocations, converted in one launch; and a long entry, whose thousands of programs run
concurrently, against the torch reference on the same device."""

import importlib.util

import pytest
import torch

from miles_plugins.optimizers.formats import fused, quant8, remainder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs CUDA and Triton"
    ),
]


def test_the_kernels_build_and_pass_their_self_test():
    """Where Triton is installed, kernels that do not build or store other bytes fail here,
    not skip: ``fused.kernels()`` is None then (the reference serves, with a warning)."""
    assert fused.kernels() is not None


# Six tiles, the last partial.
NUMEL = 5 * fused._TILE + 77


def _moments(numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    m = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g) * 3) * 1e-3
    m[: 2 * quant8.BLOCK] = 0  # all-zero blocks (scale 0)
    m[5 * quant8.BLOCK + 3 : 5 * quant8.BLOCK + 4] = float("inf")  # where the entry is that long
    m[9 * quant8.BLOCK + 7 : 9 * quant8.BLOCK + 8] = float("nan")
    # exp_avg_sq not a square: its root is rounded (correctly, on both sides).
    return {"exp_avg": m, "exp_avg_sq": m.abs()}


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
def test_fused_8bit_codes_and_values_are_the_cpu_reference(moment):
    x = _moments(NUMEL)[moment]
    signed, sqrt = quant8.MOMENT_FORMATS[moment]
    cpu, gpu = x.clone(), x.cuda()
    assert fused.applies(gpu)
    quant8.narrow_in_place(cpu, signed, sqrt)
    quant8.narrow_in_place(gpu, signed, sqrt)
    n, stored = x.numel(), quant8.stored_nbytes(x.numel())
    cpu_bytes, gpu_bytes = cpu.view(torch.uint8)[:stored], gpu.view(torch.uint8)[:stored].cpu()
    assert torch.equal(cpu_bytes[:n], gpu_bytes[:n])  # every code, the non-finite blocks' included
    cpu_scales, gpu_scales = cpu_bytes[n:].clone().view(torch.float32), gpu_bytes[n:].clone().view(torch.float32)
    nan = torch.isnan(cpu_scales)
    assert nan.sum() == 1 and torch.equal(nan, torch.isnan(gpu_scales))  # a NaN, whatever its bits
    differ = (cpu_scales.view(torch.int32) != gpu_scales.view(torch.int32)) & ~nan
    assert not differ.any(), [
        (i, cpu_scales[i].item(), gpu_scales[i].item()) for i in differ.nonzero()[:5].view(-1).tolist()
    ]
    gpu.view(torch.uint8)[n:stored].copy_(cpu_bytes[n:])  # the same stored form on both sides
    quant8.widen_in_place(cpu, signed, sqrt)
    quant8.widen_in_place(gpu, signed, sqrt)
    gpu = gpu.cpu()
    nan = torch.isnan(cpu)  # the non-finite blocks decode to NaN; NaN bits differ by device
    assert torch.equal(nan, torch.isnan(gpu))
    assert torch.equal(cpu[~nan].view(torch.int32), gpu[~nan].view(torch.int32))


def _mains(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    main = torch.randn(numel, generator=g)
    bits = main.view(torch.int32)
    ties = torch.arange(0, numel, 59)
    bits[ties] = (bits[ties] & ~0xFFFF) | 0x18000  # exact ties with an odd high half
    main[11:12] = float("nan")
    main[fused._TILE + 5 : fused._TILE + 6] = float("-inf")  # where the entry is that long
    return main, main.bfloat16()


def test_fused_remainder_low_bits_and_exceptions_are_the_cpu_reference():
    main, param = _mains(NUMEL)
    cpu, gpu = main.clone(), main.cuda()
    cpu_exceptions = remainder.encode_in_place(cpu, param)
    gpu_exceptions = remainder.encode_in_place(gpu, param.cuda())
    assert len(cpu_exceptions) > NUMEL // 100
    assert torch.equal(cpu_exceptions.index, gpu_exceptions.index)
    assert torch.equal(cpu_exceptions.high, gpu_exceptions.high)
    assert torch.equal(cpu.view(torch.int16)[:NUMEL], gpu.view(torch.int16)[:NUMEL].cpu())
    remainder.decode_in_place(gpu, param.cuda(), gpu_exceptions)
    assert torch.equal(gpu.cpu().view(torch.int32), main.view(torch.int32))


def test_exceptions_past_the_device_slots_fall_back_and_stay_exact(monkeypatch):
    """Tiles with more exceptions than the kernel can collect (NaN mains) stand down, and
    the reference path converts them, from fp32 bytes the kernel has not written over:
    the CPU reference's low bits and exceptions, and every fp32 bit back."""
    monkeypatch.setattr(fused, "_EXCEPTION_SLOTS", 64)
    main, param = _mains(NUMEL)
    main.view(torch.int32)[fused._TILE : fused._TILE + 5000] = 0x7FC01234  # NaN, payload
    param = main.bfloat16()
    cpu, gpu = main.clone(), main.cuda()
    expected = remainder.encode_in_place(cpu, param)
    exceptions = remainder.encode_in_place(gpu, param.cuda())
    assert len(exceptions) >= 5000
    assert torch.equal(expected.index, exceptions.index) and torch.equal(expected.high, exceptions.high)
    assert torch.equal(cpu.view(torch.int16)[:NUMEL], gpu.view(torch.int16)[:NUMEL].cpu())
    remainder.decode_in_place(gpu, param.cuda(), exceptions)
    assert torch.equal(gpu.cpu().view(torch.int32), main.view(torch.int32))


def test_stand_downs_under_full_concurrency_match_the_reference(monkeypatch):
    """Thousands of tiles in flight and a slot budget spent early: entries of 40M and 20M
    elements in separate allocations (and two small ones), exact ties throughout and a
    run of 300K NaN mains, 4096 slots. Whatever stood down, the bytes and exceptions are
    those of the torch reference on the same device, and decode restores every bit.
    (Written from the session's hostile review.)"""
    monkeypatch.setattr(fused, "_EXCEPTION_SLOTS", 4096)
    g = torch.Generator(device="cuda").manual_seed(1)
    mains = [torch.randn(n, device="cuda", generator=g) for n in ((40 << 20) + 5, 3, (20 << 20) + 4097, 300_000)]
    for i, main in enumerate(mains):
        bits = main.view(torch.int32)
        bits[i::997] = (bits[i::997] & ~0xFFFF) | 0x18000
    mains[0].view(torch.int32)[5_000_000:5_300_000] = 0x7FC01234
    params = [m.bfloat16() for m in mains]
    results = {}
    for on in (False, True):
        monkeypatch.setattr(fused, "enabled", on)
        encoded = [m.clone() for m in mains]
        results[on] = (encoded, remainder.encode_many(encoded, params))
    for a, e, b, f in zip(*results[False], *results[True], strict=True):
        assert torch.equal(a.view(torch.int16)[: a.numel()], b.view(torch.int16)[: b.numel()])
        assert torch.equal(e.index, f.index) and torch.equal(e.high, f.high)
    assert sum(len(e) for e in results[True][1]) > 300_000 + 4096
    encoded, exceptions = results[True]
    remainder.decode_many(encoded, params, exceptions)
    for main, got in zip(mains, encoded, strict=True):
        assert torch.equal(main.view(torch.int32), got.view(torch.int32))


def test_a_buckets_entries_converted_together_store_each_entrys_reference_bytes():
    """``*_many`` as the codec calls them for a bucket, its entries in separate allocations:
    biases and norms, an entry of partial blocks and long ones, in one launch per kind;
    every entry's stored bytes are the CPU reference's, and decode restores every fp32 bit."""
    sizes = [5120, 15360, 300, 2 * fused._TILE + 77] + [4096] * 5 + [256]
    for moment in quant8.MOMENT_FORMATS:
        signed, sqrt = quant8.MOMENT_FORMATS[moment]
        xs = [_moments(n)[moment].roll(seed) for seed, n in enumerate(sizes)]
        cpus, gpus = [x.clone() for x in xs], [x.cuda() for x in xs]
        quant8.narrow_many(cpus, signed, sqrt)
        quant8.narrow_many(gpus, signed, sqrt)
        for cpu, gpu in zip(cpus, gpus, strict=True):
            stored = quant8.stored_nbytes(cpu.numel())
            # Codes exact; scales as bytes where not NaN (a NaN block's NaN bits may differ).
            a, b = cpu.view(torch.uint8)[:stored], gpu.view(torch.uint8)[:stored].cpu()
            assert torch.equal(a[: cpu.numel()], b[: cpu.numel()]), (moment, cpu.numel())
            if quant8.quantizes(cpu.numel()):
                sa, sb = a[cpu.numel() :].clone().view(torch.float32), b[cpu.numel() :].clone().view(torch.float32)
                nan = torch.isnan(sa)
                assert torch.equal(nan, torch.isnan(sb)) and torch.equal(sa[~nan], sb[~nan])
            gpu.view(torch.uint8)[:stored].copy_(a)  # the same stored form on both sides
        quant8.widen_many(cpus, signed, sqrt)
        quant8.widen_many(gpus, signed, sqrt)
        for cpu, gpu in zip(cpus, gpus, strict=True):
            gpu = gpu.cpu()
            nan = torch.isnan(cpu)
            assert torch.equal(nan, torch.isnan(gpu)) and torch.equal(cpu[~nan], gpu[~nan])
    mains = [_mains(n)[0].roll(k) for k, n in enumerate(sizes)]
    params = [m.bfloat16() for m in mains]
    cpus, gpus = [m.clone() for m in mains], [m.cuda() for m in mains]
    cpu_found = remainder.encode_many(cpus, params)
    gpu_found = remainder.encode_many(gpus, [p.cuda() for p in params])
    assert sum(len(e) for e in cpu_found) > 100
    for cpu, gpu, a, b in zip(cpus, gpus, cpu_found, gpu_found, strict=True):
        assert torch.equal(a.index, b.index) and torch.equal(a.high, b.high)
        assert torch.equal(cpu.view(torch.int16)[: cpu.numel()], gpu.view(torch.int16)[: gpu.numel()].cpu())
    remainder.decode_many(gpus, [p.cuda() for p in params], gpu_found)
    for main, gpu in zip(mains, gpus, strict=True):
        assert torch.equal(main.view(torch.int32), gpu.cpu().view(torch.int32))


def test_a_long_entry_under_full_concurrency_matches_the_reference(monkeypatch):
    """64M elements (16384 tiles, thousands of programs in flight, each waiting on
    the tiles its stores land on): the fused bytes are those of the torch reference
    formulations on the same device, and decode restores every bit."""
    numel = 64 * 1024 * 1024
    g = torch.Generator(device="cuda").manual_seed(7)
    m = torch.randn(numel, device="cuda", generator=g) * torch.exp(torch.randn(numel, device="cuda", generator=g) * 3)
    main = torch.randn(numel, device="cuda", generator=g)
    main.view(torch.int32)[::4099] = (main.view(torch.int32)[::4099] & ~0xFFFF) | 0x18000  # ties
    param = main.bfloat16()
    results = {}
    for on in (False, True):
        monkeypatch.setattr(fused, "enabled", on)
        moments = {name: (m if name == "exp_avg" else m.abs()).clone() for name in quant8.MOMENT_FORMATS}
        for name, t in moments.items():
            quant8.narrow_many([t], *quant8.MOMENT_FORMATS[name])
        low = main.clone()
        (exceptions,) = remainder.encode_many([low], [param])
        results[on] = (moments, low, exceptions)
    (ref_moments, ref_low, ref_exceptions), (moments, low, exceptions) = results[False], results[True]
    for name, t in moments.items():
        stored = quant8.stored_nbytes(numel)
        a, b = ref_moments[name].view(torch.uint8)[:stored], t.view(torch.uint8)[:stored]
        assert torch.equal(a, b), (name, (a != b).sum().item())
        for on, widened in ((False, ref_moments[name]), (True, t)):
            monkeypatch.setattr(fused, "enabled", on)
            quant8.widen_many([widened], *quant8.MOMENT_FORMATS[name])
        nan = torch.isnan(ref_moments[name])  # inf blocks decode to NaN, whose bits may differ
        assert torch.equal(nan, torch.isnan(t)), name
        assert torch.equal(t[~nan].view(torch.int32), ref_moments[name][~nan].view(torch.int32)), name
    assert len(exceptions) > 10_000
    assert torch.equal(exceptions.index, ref_exceptions.index) and torch.equal(exceptions.high, ref_exceptions.high)
    assert torch.equal(low.view(torch.int16)[:numel], ref_low.view(torch.int16)[:numel])
    remainder.decode_many([low], [param], [exceptions])
    assert torch.equal(low.view(torch.int32), main.view(torch.int32))
