"""The storage codecs at memory speed: encode + decode of a whole GPT's state on one GPU.

    python -m bench.codec [--layers 24] [--hidden 5120] [--samples 3] [--out bench-results/codec.json]

For every param of the scale tier's GPT shape (hidden 5120, vocab 8192, seq 1024;
24 layers = 7.6B params), one entry each, as the store converts them: the fp32 main
to remainder low bits and back (beside its bf16 param), both moments to 8-bit codes
and back (exp_avg signed, sqrt(exp_avg_sq) unsigned). The entries are grouped in
the store's buckets (64M elements, a param never split) and converted bucket by
bucket through the step's codec (``step.codec.Codec.encode`` / ``decode``: the
small entries packed, ``entry_codecs.plan_packed``): every entry of a bucket queued, then one device
synchronization per bucket and direction (the remainder encoder reads its
exceptions back once per bucket besides). Wall time of three formulations in one process: the
reference torch formulations (``quant8.py``, ``remainder.py``), the fused Triton
kernels (``fused.py``, ``fused_remainder.py``) launched eagerly, and the fused kernels through the codec's
CUDA graphs (``step/graphs.py``: a bucket's conversions captured once its tensors'
addresses repeat, then replayed; the decoder's exceptions are put eagerly after
it), timed after a sweep that captures them (reported as ``capture_sweep_s``,
with the graphs' count and their pool's bytes). The stored bytes of the largest
entry, and every entry's remainder exceptions, are compared with the reference's
(the GPU tier and the kernels' self-test compare every byte, edge cases included).
The buckets reuse one set of buffers; per formulation, after a warm-up,
``--samples`` sweeps (3) from the same values, the median's times reported
(within one call of 2026-12-02, one sample's time moved by up to 40% between
runs, and the host's speed by up to 80% between processes). So beside the wall
times it reports each formulation's device time (torch's profiler over one more
sweep, less the bench's own preparation of the bf16 params), which the host's
speed does not enter: 117.8 and 117.7 ms for the fused path in two processes of
one call whose wall times were 0.288 and 0.301 s (the fused total relative to
the reference's of its own process moved from 0.107 to 0.146: the reference is
the more host-bound, so that ratio does not cancel the drift).
Results before 2026-12-02 synchronized after every entry instead; before the
third call of that day they called the formats' bucket encoders directly, as
``Codec`` does; before
``codec-h200-2026-12-02-encoder-in-graphs.json`` the remainder encoder ran
eagerly after the graph, waiting on the device once per entry.

The bound is the bytes each param's conversions must move (reads + writes):
remainder main 8 + 8 (fp32 main, bf16 param, int16 low bits), each 8-bit moment
5 + 5 (fp32, one-byte code; scales 1/64 byte more), 36 bytes per param, at the
device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

from miles_plugins.optimizers.config import DEFAULT_BUCKET_CAP_ELEMENTS
from miles_plugins.optimizers.formats import kernels
from miles_plugins.optimizers.formats.layout import layout_store, plan_buckets
from miles_plugins.optimizers.step import graphs
from miles_plugins.optimizers.step.codec import Codec, stored_bytes

BYTES_PER_PARAM = 36


def gpt_entries(layers: int, hidden: int, vocab: int = 8192, seq: int = 1024) -> list[int]:
    """Element counts of the GPT's params (Megatron's local layer spec, untied output)."""
    per_layer = [3 * hidden * hidden, 3 * hidden, hidden * hidden, hidden, 4 * hidden * hidden, 4 * hidden]
    per_layer += [4 * hidden * hidden, hidden, hidden, hidden, hidden, hidden]  # fc2 and its bias, 2 norms
    return [vocab * hidden, seq * hidden] + per_layer * layers + [hidden, hidden, vocab * hidden]


def copy_bandwidth(numel: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    a, b = torch.empty(numel, device="cuda"), torch.empty(numel, device="cuda")
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 10 * 2 * a.numel() * 4 / (start.elapsed_time(end) / 1e3)


def layout(entries: list[int]) -> list:
    """The store's buckets of ``entries`` (remainder mains, 8-bit moments)."""
    return layout_store(
        [(i, n, 0, False) for i, n in enumerate(entries)], DEFAULT_BUCKET_CAP_ELEMENTS, torch.uint8, torch.int16, True
    )


def sweep(
    entries: list[int],
    buffers: dict[str, torch.Tensor],
    param: torch.Tensor,
    convert: bool = True,
    codec: Codec | None = None,
) -> dict:
    """Encode then decode every entry's main and moments through the store's codec
    (``Codec.encode`` / ``decode``; ``codec``, whose CUDA graphs outlive the sweep, or a
    new one), bucket by bucket as the store's walk does (its buckets' entries, one host
    wait per bucket and direction); seconds per direction. Without ``convert``, only
    the bench's own preparation (each bucket's bf16 params)."""
    timings = {"encode": 0.0, "decode": 0.0}
    stored = []
    buckets = layout(entries)
    codec = codec or Codec(buckets)
    for bucket in buckets:
        offsets = [0]
        for n in bucket.numels:
            offsets.append(offsets[-1] + n)
        items = [
            (bucket.segments[name], k, buffers[name][s:e], param[s:e])
            for k, (s, e) in enumerate(zip(offsets, offsets[1:], strict=False))
            for name in ("main", "exp_avg", "exp_avg_sq")
        ]
        for segment, _, main, p in items:
            if segment.name == "main":
                p.copy_(main)  # the bf16 param is the main rounded, as after a step
        if not convert:
            continue
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        codec.encode(bucket, items)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for segment, _, t, _ in items:
            if t.numel() == max(entries) and len(stored) < 3:
                stored.append(stored_bytes(t, segment).clone())
        t1_decode = time.perf_counter()  # the copy above is not the codec's
        codec.decode(bucket, items)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        timings["encode"] += t1 - t0
        timings["decode"] += t2 - t1_decode
    return {**timings, "stored": stored, "exceptions": codec.export()}


def device_seconds(run) -> float:
    """Seconds the device spent running kernels and copies during ``run()`` (torch's
    profiler; one stream, so nothing counted twice): the host's speed does not enter it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    return sum(event.self_device_time_total for event in prof.key_averages()) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument(
        "--samples", type=int, default=3, help="sweeps per formulation; the median's times are reported"
    )
    parser.add_argument("--out", default="bench-results/codec.json")
    args = parser.parse_args()
    if args.samples < 1:
        raise SystemExit("bench.codec: --samples must be 1 or more")
    if not torch.cuda.is_available():
        raise SystemExit("bench.codec: needs a CUDA device (the CPU path is the reference, not a target)")
    if kernels.for_device() is None:
        raise SystemExit("bench.codec: Triton is not installed; the fused kernels cannot run")
    entries = gpt_entries(args.layers, args.hidden)
    buckets = plan_buckets(entries, [0] * len(entries), DEFAULT_BUCKET_CAP_ELEMENTS)
    largest = max(sum(entries[i] for i in bucket) for bucket in buckets)
    g = torch.Generator(device="cuda").manual_seed(0)
    m = (
        torch.randn(largest, device="cuda", generator=g)
        * torch.exp(torch.randn(largest, device="cuda", generator=g) * 3)
        * 1e-3
    )
    base = {
        "main": torch.randn(largest, device="cuda", generator=g) * 0.02,
        "exp_avg": m,
        "exp_avg_sq": m * m,
    }
    bandwidth = copy_bandwidth(1 << 28)
    report = {
        "params": sum(entries),
        "entries": len(entries),
        "buckets": len(buckets),
        "host_waits": "one per bucket and direction (as the store's walk), besides the codec's own",
        "copy_bandwidth_gbs": round(bandwidth / 1e9, 1),
    }
    bound = sum(entries) * BYTES_PER_PARAM / bandwidth
    report["bound_s"] = round(bound, 4)
    stored = {}
    buffers = {k: torch.empty_like(t) for k, t in base.items()}  # at the same addresses every sweep

    def from_the_values(**kwargs) -> dict:
        for k, t in base.items():
            buffers[k].copy_(t)
        return sweep(entries, buffers, param, **kwargs)

    # The fused kernels eagerly, then through the codec's CUDA graphs: a bucket is captured
    # the second time its tensors are at the same addresses, as in the store's steps.
    for name, on, graphed in (("reference", False, False), ("fused", True, False), ("fused_graphs", True, True)):
        kernels.enabled, graphs.enabled = on, graphed
        param = torch.empty(largest, dtype=torch.bfloat16, device="cuda")
        sweep(entries[:4], {k: t.clone() for k, t in base.items()}, param)  # compile and warm the caches
        codec = Codec(layout(entries))
        extra = {}
        if graphed:
            from_the_values(codec=codec)  # first sight of each bucket's addresses: eager
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved()
            capturing = from_the_values(codec=codec)
            torch.cuda.empty_cache()
            extra = {
                "capture_sweep_s": round(capturing["encode"] + capturing["decode"], 4),
                "graphs": codec.graphs.captures,
                "graph_pool_bytes": torch.cuda.memory_reserved() - reserved,
                "exception_slots_bytes": codec.slots.nbytes(),
            }
        samples = []
        for _ in range(args.samples):  # each from the same values
            result = from_the_values(codec=codec)
            stored.setdefault(name, (result.pop("stored"), result.pop("exceptions")))
            samples.append({"encode": result["encode"], "decode": result["decode"]})
        result = sorted(samples, key=lambda r: r["encode"] + r["decode"])[(len(samples) - 1) // 2]
        total = result["encode"] + result["decode"]
        # One more sweep under the profiler, less one of the bench's own preparation alone.
        converting, preparing = (
            device_seconds(functools.partial(from_the_values, convert=convert, codec=codec))
            for convert in (True, False)
        )
        device = converting - preparing
        report[name] = {
            **{k: round(s, 4) for k, s in result.items()},
            "total_s": round(total, 4),
            "x_bound": round(total / bound, 2),
            "samples_total_s": [round(r["encode"] + r["decode"], 4) for r in samples],
            "device_busy_s": round(device, 4),
            "device_x_bound": round(device / bound, 2),
            **extra,
        }
        if graphed:
            report[name]["graph_replays"] = codec.graphs.replays
            if codec.graphs.captures != 2 * len(codec.exceptions):
                print(f"{name}: {codec.graphs.captures} graphs for {len(codec.exceptions)} buckets: partly eager")
            codec.release()
        print(
            f"{name}: encode {result['encode']:.3f} s, decode {result['decode']:.3f} s,"
            f" {total / bound:.1f}x the bound ({bound * 1e3:.1f} ms); the device busy"
            f" {device * 1e3:.1f} ms of it, {device / bound:.1f}x {extra}",
            flush=True,
        )
    reference_bytes, reference_exceptions = stored["reference"]
    for name in ("fused", "fused_graphs"):
        got_bytes, got_exceptions = stored[name]
        report[name]["same_stored_bytes"] = all(
            torch.equal(a, b) for a, b in zip(reference_bytes, got_bytes, strict=True)
        )
        report[name]["same_exceptions"] = reference_exceptions == got_exceptions  # every entry's remainder exceptions
    report["device"] = torch.cuda.get_device_name()
    print(json.dumps(report, indent=1))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
