"""GPU tier for the fused codec kernels (``formats/fused.py``): the bytes they store are
the CPU reference's, over entries long enough to take every kind of chunk (the scratch
chunk, then geometric ones), with zero, infinite and NaN values and rounding ties."""

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


# Three chunks: [0, S), [S, 4S) and the rest (S = fused.SCRATCH_ELEMENTS).
NUMEL = 5 * fused.SCRATCH_ELEMENTS + 77


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
    ties = torch.arange(0, numel, 4099)
    bits[ties] = (bits[ties] & ~0xFFFF) | 0x18000  # exact ties with an odd high half
    main[11:12] = float("nan")
    main[fused.SCRATCH_ELEMENTS + 5 : fused.SCRATCH_ELEMENTS + 6] = float("-inf")  # where the entry is that long
    return main, main.bfloat16()


def test_fused_remainder_low_bits_and_exceptions_are_the_cpu_reference():
    main, param = _mains(NUMEL)
    cpu, gpu = main.clone(), main.cuda()
    cpu_exceptions = remainder.encode_in_place(cpu, param)
    gpu_exceptions = remainder.encode_in_place(gpu, param.cuda())
    assert len(cpu_exceptions) > 1000
    assert torch.equal(cpu_exceptions.index, gpu_exceptions.index)
    assert torch.equal(cpu_exceptions.high, gpu_exceptions.high)
    assert torch.equal(cpu.view(torch.int16)[:NUMEL], gpu.view(torch.int16)[:NUMEL].cpu())
    remainder.decode_in_place(gpu, param.cuda(), gpu_exceptions)
    assert torch.equal(gpu.cpu().view(torch.int32), main.view(torch.int32))


def test_exceptions_past_the_device_slots_fall_back_and_stay_exact(monkeypatch):
    """A chunk with more exceptions than the kernel can collect (NaN mains) is found by the
    reference path, from fp32 bytes the kernel has not yet written over."""
    monkeypatch.setattr(fused, "_EXCEPTION_SLOTS", 64)
    main, param = _mains(NUMEL)
    main.view(torch.int32)[fused.SCRATCH_ELEMENTS : fused.SCRATCH_ELEMENTS + 5000] = 0x7FC01234  # NaN, payload
    param = main.bfloat16()
    gpu = main.cuda()
    exceptions = remainder.encode_in_place(gpu, param.cuda())
    assert len(exceptions) >= 5000
    remainder.decode_in_place(gpu, param.cuda(), exceptions)
    assert torch.equal(gpu.cpu().view(torch.int32), main.view(torch.int32))


def test_a_buckets_entries_converted_together_store_each_entrys_reference_bytes():
    """``*_many`` as the codec calls them for a bucket: biases and norms packed (two groups
    here), an entry of partial blocks and the long ones alone; every entry's stored
    bytes are the CPU reference's, and decode restores every fp32 bit."""
    sizes = [5120, 15360, 300, 2 * fused.SCRATCH_ELEMENTS + 77] + [fused.PACKED_MAX_ELEMENTS] * 5 + [256]
    singles, groups = fused.plan_packed([torch.empty(n, device="cuda") for n in sizes], unit=quant8.BLOCK)
    assert singles == [2, 3] and len(groups) == 2
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
