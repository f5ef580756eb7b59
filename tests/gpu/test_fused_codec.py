"""GPU tier for the fused codec kernels (``formats/fused.py``, ``formats/fused_remainder.py``,
as ``formats/entry_codecs.py`` calls them): the bytes they store are the CPU reference's,
over entries long enough to take every kind of chunk (the scratch chunk, then geometric
ones), with zero, infinite and NaN values and rounding ties."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from miles_plugins.optimizers.formats import entry_codecs, fused, fused_remainder, kernels, quant8, remainder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs CUDA and Triton"
    ),
]


def test_the_kernels_build_and_pass_their_self_test():
    """Where Triton is installed, kernels that do not build or store other bytes fail here,
    not skip: ``kernels.for_device()`` is None then (the reference serves, with a warning)."""
    assert kernels.for_device() is not None


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
    assert kernels.serve(gpu)
    quant8.encode_in_place(cpu, signed, sqrt)
    entry_codecs.quant8_encode(gpu, signed, sqrt)
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
    quant8.decode_in_place(cpu, signed, sqrt)
    entry_codecs.quant8_decode(gpu, signed, sqrt)
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


def _encode(main: torch.Tensor, param: torch.Tensor) -> remainder.Exceptions:
    """One main encoded as the store's codec encodes it (by the fused encoder on CUDA)."""
    return entry_codecs.remainder_encode_many([main], [param])[0]


def _decode(main: torch.Tensor, param: torch.Tensor, exceptions: remainder.Exceptions) -> None:
    """One main decoded as the store's codec decodes it: by the rule, then its exceptions."""
    entry_codecs.remainder_decode_by_rule_many([main], [param])
    remainder.put_exceptions(main, exceptions)


def test_fused_remainder_low_bits_and_exceptions_are_the_cpu_reference():
    main, param = _mains(NUMEL)
    cpu, gpu = main.clone(), main.cuda()
    assert kernels.serve(gpu)
    cpu_exceptions = remainder.encode_in_place(cpu, param)
    gpu_exceptions = _encode(gpu, param.cuda())
    assert len(cpu_exceptions) > 1000
    assert torch.equal(cpu_exceptions.index, gpu_exceptions.index)
    assert torch.equal(cpu_exceptions.high, gpu_exceptions.high)
    assert torch.equal(cpu.view(torch.int16)[:NUMEL], gpu.view(torch.int16)[:NUMEL].cpu())
    _decode(gpu, param.cuda(), gpu_exceptions)
    assert torch.equal(gpu.cpu().view(torch.int32), main.view(torch.int32))


def test_exceptions_past_the_device_slots_fall_back_and_stay_exact(monkeypatch):
    """A chunk with more exceptions than the kernel can collect (NaN mains) is found by the
    reference path, from fp32 bytes the kernel has not yet written over."""
    monkeypatch.setattr(fused_remainder, "exception_capacity", lambda n: 64)
    main, param = _mains(NUMEL)
    main.view(torch.int32)[fused.SCRATCH_ELEMENTS : fused.SCRATCH_ELEMENTS + 5000] = 0x7FC01234  # NaN, payload
    param = main.bfloat16()
    gpu = main.cuda()
    exceptions = _encode(gpu, param.cuda())
    assert len(exceptions) >= 5000
    _decode(gpu, param.cuda(), exceptions)
    assert torch.equal(gpu.cpu().view(torch.int32), main.view(torch.int32))


def test_a_buckets_entries_converted_together_store_each_entrys_reference_bytes():
    """``entry_codecs.*_many`` as the codec calls them for a bucket: biases and norms packed (two groups
    here), an entry of partial blocks and the long ones alone; every entry's stored
    bytes are the CPU reference's, and decode restores every fp32 bit."""
    sizes = [5120, 15360, 300, 2 * fused.SCRATCH_ELEMENTS + 77] + [fused.PACKED_MAX_ELEMENTS] * 5 + [256]
    singles, groups = entry_codecs.plan_packed([torch.empty(n, device="cuda") for n in sizes], unit=quant8.BLOCK)
    assert singles == [2, 3] and len(groups) == 2
    for moment in quant8.MOMENT_FORMATS:
        signed, sqrt = quant8.MOMENT_FORMATS[moment]
        xs = [_moments(n)[moment].roll(seed) for seed, n in enumerate(sizes)]
        cpus, gpus = [x.clone() for x in xs], [x.cuda() for x in xs]
        entry_codecs.quant8_encode_many(cpus, signed, sqrt)
        entry_codecs.quant8_encode_many(gpus, signed, sqrt)
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
        entry_codecs.quant8_decode_many(cpus, signed, sqrt)
        entry_codecs.quant8_decode_many(gpus, signed, sqrt)
        for cpu, gpu in zip(cpus, gpus, strict=True):
            gpu = gpu.cpu()
            nan = torch.isnan(cpu)
            assert torch.equal(nan, torch.isnan(gpu)) and torch.equal(cpu[~nan], gpu[~nan])
    mains = [_mains(n)[0].roll(k) for k, n in enumerate(sizes)]
    params = [m.bfloat16() for m in mains]
    cpus, gpus = [m.clone() for m in mains], [m.cuda() for m in mains]
    cpu_found = entry_codecs.remainder_encode_many(cpus, params)
    gpu_found = entry_codecs.remainder_encode_many(gpus, [p.cuda() for p in params])
    assert sum(len(e) for e in cpu_found) > 100
    for cpu, gpu, a, b in zip(cpus, gpus, cpu_found, gpu_found, strict=True):
        assert torch.equal(a.index, b.index) and torch.equal(a.high, b.high)
        assert torch.equal(cpu.view(torch.int16)[: cpu.numel()], gpu.view(torch.int16)[: gpu.numel()].cpu())
    entry_codecs.remainder_decode_by_rule_many(gpus, [p.cuda() for p in params])
    for gpu, exceptions in zip(gpus, gpu_found, strict=True):
        remainder.put_exceptions(gpu, exceptions)
    for main, gpu in zip(mains, gpus, strict=True):
        assert torch.equal(main.view(torch.int32), gpu.cpu().view(torch.int32))


def test_the_codecs_cuda_graphs_store_and_restore_the_cpu_references_bytes(monkeypatch):
    """``Codec`` as the store calls it, step after step, other values every step: eager
    the first time a bucket's tensors are at their addresses, captured the second,
    replayed after; eager again when they move, captured again once the new ones
    repeat. Every round's stored bytes and exceptions are the CPU reference's for that
    round's values, and decode gives the reference's fp32 values (the mains' every bit)."""
    from miles_plugins.optimizers.formats.layout import layout_store
    from miles_plugins.optimizers.step import graphs
    from miles_plugins.optimizers.step.codec import Codec, stored_bytes

    monkeypatch.setattr(graphs, "enabled", True)
    hidden = 512
    entries = [hidden, 3 * hidden * hidden, 3 * hidden, fused.SCRATCH_ELEMENTS + 4 * hidden + 9, 300, hidden, hidden]
    buckets = layout_store([(i, n, 0, False) for i, n in enumerate(entries)], 1 << 22, torch.uint8, torch.int16, True)
    assert len(buckets) >= 2
    main, _ = _mains(sum(entries))
    base = {"main": main, **_moments(sum(entries))}

    def items_of(bucket, state, params):
        starts = [sum(entries[:i]) for i in bucket.entry_indices]
        return [
            (bucket.segments[name], k, state[name][s : s + n], params[s : s + n])
            for k, (s, n) in enumerate(zip(starts, bucket.numels, strict=True))
            for name in ("main", "exp_avg", "exp_avg_sq")
        ]

    def reference(values, param):
        """The CPU codec's stored bytes and exceptions per bucket, and the values decoded."""
        state, cpu_codec, stored = {k: v.clone() for k, v in values.items()}, Codec(buckets), []
        for bucket in buckets:
            items = items_of(bucket, state, param)
            cpu_codec.encode(bucket, items)
            stored.append([stored_bytes(t, segment).clone() for segment, _, t, _ in items])
            cpu_codec.decode(bucket, items)
        return stored, cpu_codec.exceptions, state

    codec = Codec(buckets)
    first = {k: torch.empty_like(v, device="cuda") for k, v in base.items()}
    moved = {k: torch.empty_like(v, device="cuda") for k, v in base.items()}
    gpu_param = torch.empty(main.numel(), dtype=torch.bfloat16, device="cuda")
    rounds = [first, first, first, moved, moved, first]
    captures = [0, 2, 2, 2, 4, 4]  # per bucket: the decode's graph and the encode's
    long = sum(entries[:3])  # where the long entry starts
    for shift, (state, captured) in enumerate(zip(rounds, captures, strict=True)):
        values = {k: v.roll(1000 * shift) for k, v in base.items()}
        if shift == 2:  # replayed: runs whose exceptions overflow the slots (NaN mains)
            nan = values["main"].view(torch.int32)
            nan[hidden + 1000 : hidden + 3000] = 0x7FC01234  # a packed group's
            nan[long + 100 : long + 5100] = 0x7FC05678  # the long entry's first chunk
            s = long + fused.SCRATCH_ELEMENTS + 10  # its second chunk (2057 elements): over its 1024
            nan[s : s + 1500] = 0x7FC09ABC  # slots too when resumed
        param = values["main"].bfloat16()
        expected, exceptions, decoded = reference(values, param)
        for k in state:
            state[k].copy_(values[k])
        gpu_param.copy_(param)
        for bucket, stored in zip(buckets, expected, strict=True):
            items = items_of(bucket, state, gpu_param)
            codec.encode(bucket, items)
            for (segment, k, t, _), want in zip(items, stored, strict=True):
                got = stored_bytes(t, segment).cpu()
                if segment.blockwise and quant8.quantizes(t.numel()):  # a NaN block's scale: any NaN
                    n = t.numel()
                    a, b = want[n:].clone().view(torch.float32), got[n:].clone().view(torch.float32)
                    assert torch.equal(want[:n], got[:n]) and torch.equal(a.isnan(), b.isnan())
                    assert torch.equal(a[~a.isnan()], b[~b.isnan()])
                else:
                    assert torch.equal(want, got), (shift, bucket.index, segment.name, k)
            for k, (a, b) in enumerate(zip(exceptions[bucket.index], codec.exceptions[bucket.index], strict=True)):
                assert torch.equal(a.index, b.index) and torch.equal(a.high, b.high), (shift, bucket.index, k)
            codec.decode(bucket, items)
        assert codec.graphs.captures == captured * len(buckets)
        assert torch.equal(state["main"].cpu().view(torch.int32), values["main"].view(torch.int32))  # every bit
        for name in ("exp_avg", "exp_avg_sq"):
            a, b = decoded[name], state[name].cpu()
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), (shift, name)
        assert sum(len(e) for bucket in codec.exceptions for e in bucket) > 100
    assert codec.graphs.replays == 6 * len(buckets)  # rounds 2, 3 and 5, both directions
    codec.release()


def test_a_capture_that_fails_raises_naming_the_switch_with_the_tensors_untouched():
    """A conversion that reads on the host cannot be captured: the error names
    ``MILES_CODEC_GRAPHS=0``, the tensors are as before (a capture runs nothing), and
    the allocator is out of its capture mode (its ``empty_cache`` asserts otherwise).
    In a process of its own: torch leaves the device's random generator mid-capture."""
    script = textwrap.dedent(
        """
        import torch
        from miles_plugins.optimizers.step import graphs

        graphs.enabled = True
        cache = graphs.BucketGraphs()
        x = torch.randn(1 << 20, device="cuda")
        start = x.clone()

        def convert():
            x.mul_(2)
            float(x[0])  # a host read: refused while the stream is capturing

        cache.run(("encode", 0), "key", x.device, convert)  # eager
        x.copy_(start)
        try:
            cache.run(("encode", 0), "key", x.device, convert)
        except RuntimeError as exc:
            assert "MILES_CODEC_GRAPHS=0" in str(exc), exc
            assert torch.equal(x, start), "the failed capture changed the tensor"
            assert not torch.cuda.is_current_stream_capturing()
            torch.cuda.empty_cache()
            print("raised as expected")
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert "raised as expected" in done.stdout, done.stderr[-3000:]


def test_a_stores_steps_replay_graphs_and_give_the_eager_steps_bytes(monkeypatch, tmp_path):
    """The store's own walk (the gpu home, remainder mains and 8-bit moments): its
    buckets' tensors come back to their addresses from step to step, so the graphs
    replay, and every step's params are those of the same steps run eagerly."""
    from miles_plugins.optimizers.config import StreamConfig
    from miles_plugins.optimizers.step import graphs
    from miles_plugins.optimizers.step.adam import backend_for
    from miles_plugins.optimizers.step.entries import Entry
    from miles_plugins.optimizers.store.streaming_store import StreamingStore

    g = torch.Generator(device="cuda").manual_seed(5)
    shapes = [(2048, 2048), (2048,), (4096, 2048), (300,), (2048, 4096), (2048,)] * 3
    start = [torch.randn(s, device="cuda", generator=g).bfloat16() for s in shapes]
    grads = [[torch.randn(s, device="cuda", generator=g) * 1e-2 for s in shapes] for _ in range(6)]

    def run(graphed: bool) -> tuple[list[list[torch.Tensor]], StreamingStore]:
        monkeypatch.setattr(graphs, "enabled", graphed)
        params = [p.clone() for p in start]
        entries = []
        for p in params:
            main = torch.empty(p.shape, dtype=torch.float32, device="cuda")
            main.untyped_storage().resize_(0)
            entries.append(Entry(param=p, main=main, group_index=0))
        index = {id(e.main): k for k, e in enumerate(entries)}
        step = [0]
        master = torch.optim.AdamW([e.main for e in entries], lr=1e-3)
        config = StreamConfig(
            directory=str(tmp_path),
            name=f"graphs-{graphed}",
            bucket_cap_elements=1 << 23,
            gpu_budget_bytes=1 << 34,
            main_storage="remainder",
            moment_dtype="8bit",
        )
        store = StreamingStore(
            entries,
            backend_for(master),
            config,
            grad_fn=lambda e: grads[step[0]][index[id(e.main)]],
            copy_to_model=lambda e: e.param.copy_(e.main),
            init_main=lambda p, m: m.copy_(p),
        )
        history = []
        with torch.no_grad():
            for step[0] in range(len(grads)):
                store.step()
                history.append([p.cpu() for p in params])  # not on the device: its allocations stay as a step's
        return history, store

    eager, eager_store = run(False)
    replayed, store = run(True)
    try:
        codec = store._pipeline.codec
        assert eager_store._pipeline.codec.graphs.replays == 0
        assert codec.graphs.captures == 2 * len(store.buckets), (codec.graphs.captures, codec.graphs.replays)
        assert codec.graphs.replays >= 2 * len(store.buckets) * (len(grads) - 3), codec.graphs.replays
        # What the steps report (StepStats): the last step all replayed; with graphs off, all eager.
        conversions = 2 * len(store.buckets)
        assert (store.last_step.conversions_replayed, store.last_step.conversions_eager) == (conversions, 0)
        assert store.total.conversions_replayed == codec.graphs.replays
        assert store.total.conversions_replayed + store.total.conversions_eager == len(grads) * conversions
        last = eager_store.last_step
        assert (last.conversions_replayed, last.conversions_eager) == (0, conversions)
        assert store.last_step.eager_slots == ()  # and which: none, then every bucket's two
        assert sorted(last.eager_slots) == sorted((d, b.index) for d in ("decode", "encode") for b in store.buckets)
        for k, (a, b) in enumerate(zip(eager, replayed, strict=True)):
            assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b, strict=True)), k
    finally:
        store.close()
        eager_store.close()
