"""Where a store step's time goes on the GPU: one step's timeline, per stream and kind.

    python -m bench.step_timeline [--layers 20] [--hidden 2048] [--vocab 50304] [--seq 2048]
        [--tier host] [--gpu-budget-gb 6.4] [--window-gb 1.75] [--buckets-in-flight 3] [--bucket-cap N] [--steps 7]
        [--pause-s 1.9] [--out bench-results/step_timeline.json] [--trace FILE.json.gz]

The store's own step, without Megatron: the params of a GPT of the given shape
(``bench.codec.gpt_entries``: Megatron's local layer spec, untied output; the
defaults are the 1.2B of issue 26's whole iterations), fp32 mains and moments,
torch's AdamW (foreach: what Megatron's optimizer is without TE or apex), the
grads fixed on the device. Between two steps a pause with ``progress()`` calls
stands in for forward and backward (the overlap window's writes land and its
reads run then), then ``prefetch()``, as the Megatron binding calls it before the
grad-norm reduction. The defaults place the state as issue 26's comparison with
Megatron dev at offload fraction 0.5 does: a 6.4 GiB gpu home, the rest in host
memory, a 1.75 GiB window.

Reports every step's wall time, then one more step under torch's profiler: per
CUDA stream and kind (kernels, and copies host-to-device, device-to-host,
device-to-device) the busy time, when its first and last event ran (from the
step's first device event), the bytes, and the longest gaps. The profiler slows
the host, so the profiled step is longer than the others; the timeline's shape
is the point. ``--trace`` keeps the profiler's Chrome trace (gzipped JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import tempfile
import time
from collections import defaultdict

import torch

from bench.codec import gpt_entries
from miles_plugins.optimizers.config import DEFAULT_BUCKET_CAP_ELEMENTS, StreamConfig
from miles_plugins.optimizers.step.adam import backend_for
from miles_plugins.optimizers.step.entries import Entry
from miles_plugins.optimizers.store.streaming_store import StreamingStore

GIB = 1 << 30
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_REPORTED_US = 500  # gaps shorter than this are not listed


def streamed_store(params: list[torch.Tensor], grads: list[torch.Tensor], config, **adamw) -> StreamingStore:
    """A ``StreamingStore`` over bf16 ``params`` with their fixed fp32 ``grads``: one entry
    each, its main released until the store fills it from the param, stepped by
    AdamW(``adamw``)."""
    entries = []
    for p in params:
        main = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        main.untyped_storage().resize_(0)
        entries.append(Entry(param=p, main=main, group_index=0))
    grad_of = {id(e.main): g for e, g in zip(entries, grads, strict=True)}
    master = torch.optim.AdamW([e.main for e in entries], **adamw)
    return StreamingStore(
        entries,
        backend_for(master),
        config,
        grad_fn=lambda e: grad_of[id(e.main)],
        copy_to_model=lambda e: e.param.copy_(e.main),
        init_main=lambda p, m: m.copy_(p),
    )


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def summarize(events: list[dict], gaps: int = 8) -> list[dict]:
    """Per (stream, kind) of the device events of a Chrome trace (``traceEvents`` of
    torch's profiler): count, busy ms, first start and last end (ms from the first
    device event), GB moved and GB/s while busy (copies), and the ``gaps`` longest
    gaps between two of its events (ms, and where the gap starts), longest first."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    if not device:
        return []
    origin = min(e["ts"] for e in device)
    lanes: dict[tuple, list[tuple[float, float, int]]] = defaultdict(list)
    for e in device:
        # A copy's name reads "Memcpy HtoD (Pinned -> Device)": its kind is the second word.
        kind = e["name"].split(" ")[1] if e["cat"] == "gpu_memcpy" else e["cat"]
        nbytes = int(e.get("args", {}).get("bytes") or 0)
        lanes[(e.get("args", {}).get("stream"), kind)].append((e["ts"] - origin, e["dur"], nbytes))
    rows = []
    for (stream, kind), spans in sorted(lanes.items(), key=lambda item: str(item[0])):
        spans.sort()
        busy = sum(d for _, d, _ in spans)
        nbytes = sum(b for *_, b in spans)
        between = [(b[0] - (a[0] + a[1]), a[0] + a[1]) for a, b in zip(spans, spans[1:], strict=False)]
        longest = sorted((g for g in between if g[0] >= GAP_REPORTED_US), reverse=True)[:gaps]
        rows.append(
            {
                "stream": stream,
                "kind": kind,
                "count": len(spans),
                "busy_ms": round(busy / 1e3, 2),
                "first_ms": round(spans[0][0] / 1e3, 2),
                "last_ms": round((spans[-1][0] + spans[-1][1]) / 1e3, 2),
                "gb": round(nbytes / 1e9, 3),
                "gb_per_s_busy": round(nbytes / busy / 1e3, 1) if nbytes and busy else None,
                "gaps_ms_at_ms": [[round(g / 1e3, 2), round(at / 1e3, 2)] for g, at in longest],
            }
        )
    return rows


def _store(args: argparse.Namespace, directory: str, device: torch.device) -> tuple[StreamingStore, int]:
    sizes = gpt_entries(args.layers, args.hidden, vocab=args.vocab, seq=args.seq)
    g = torch.Generator(device=device).manual_seed(0)
    params, grads = [], []
    for n in sizes:
        params.append((torch.randn(n, generator=g, device=device) * 0.02).bfloat16())
        grads.append(torch.randn(n, generator=g, device=device) * 1e-3)
    config = StreamConfig(
        directory=directory,
        name="timeline",
        tier=args.tier,
        gpu_budget_bytes=int(args.gpu_budget_gb * GIB),
        overlap_bytes=int(args.window_gb * GIB),
        buckets_in_flight=args.buckets_in_flight,
        bucket_cap_elements=args.bucket_cap,
    )
    return streamed_store(params, grads, config, lr=1e-4), sum(sizes)


def timeline(args: argparse.Namespace, device: torch.device) -> tuple[dict, dict]:
    """``--steps`` timed steps, then a profiled one, on ``device`` (the CPU only for the
    tests: no device events there); returns the report and the profiler's trace."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        store, params = _store(args, directory, device)
        try:
            print(
                f"[timeline] {params / 1e9:.3f}B params in {len(store.buckets)} buckets, placement "
                f"{store.placement}, window {args.window_gb} GiB, {args.buckets_in_flight} in flight",
                flush=True,
            )
            steps = []
            for i in range(args.steps + 1):
                profiled = i == args.steps
                sync_device(device)
                start = time.perf_counter()
                with profile(activities=activities) if profiled else contextlib.nullcontext() as prof:
                    stats = store.step()
                    sync_device(device)
                seconds = time.perf_counter() - start
                steps.append(
                    {
                        "seconds": round(seconds, 4),
                        "read_gb": round(stats.bytes_read / 1e9, 3),
                        "written_gb": round(stats.bytes_written / 1e9, 3),
                    }
                )
                print(f"[timeline] step {i}{' (profiled)' if profiled else ''}: {seconds * 1e3:.1f} ms", flush=True)
                if not profiled:  # forward and backward, as far as the store sees them
                    pause = time.perf_counter()
                    while time.perf_counter() - pause < args.pause_s:
                        store.progress()
                        time.sleep(0.05)
                    store.prefetch()
            placement = store.placement
        finally:
            store.close()
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    report = {
        "params": params,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "placement": placement,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "trace", "dir")},
        "steps": steps,
        "timeline": summarize(trace["traceEvents"]),
    }
    return report, trace


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--tier", choices=("host", "disk"), default="host")
    parser.add_argument("--gpu-budget-gb", type=float, default=6.4, help="GiB of stored state in the gpu home")
    parser.add_argument("--window-gb", type=float, default=1.75, help="the overlap window, GiB (0: none)")
    parser.add_argument("--buckets-in-flight", type=int, default=3, help="buckets in flight")
    parser.add_argument("--bucket-cap", type=int, default=DEFAULT_BUCKET_CAP_ELEMENTS, help="elements per bucket")
    parser.add_argument("--steps", type=int, default=7, help="timed steps before the profiled one")
    parser.add_argument("--pause-s", type=float, default=1.9, help="between steps, standing in for fwd+bwd")
    parser.add_argument("--dir", default=None, help="where the state directory goes (default: the system's temp)")
    parser.add_argument("--out", default="bench-results/step_timeline.json")
    parser.add_argument("--trace", default=None, help="also keep the profiler's Chrome trace here (.json.gz)")
    args = parser.parse_args(argv)
    if (
        min(args.steps, args.buckets_in_flight, args.bucket_cap) < 1
        or min(args.pause_s, args.gpu_budget_gb, args.window_gb) < 0
    ):
        raise SystemExit(
            "bench.step_timeline: --steps, --buckets-in-flight and --bucket-cap must be 1 or more; budgets and pause not negative"
        )
    if not torch.cuda.is_available():
        raise SystemExit("bench.step_timeline: needs a CUDA device (the timeline is of its streams)")
    report, trace = timeline(args, torch.device("cuda"))
    for row in report["timeline"]:
        print(
            f"[timeline] stream {row['stream']} {row['kind']}: {row['count']} events, busy {row['busy_ms']} ms "
            f"from {row['first_ms']} to {row['last_ms']} ms, {row['gb']} GB; gaps (ms, at ms) {row['gaps_ms_at_ms']}"
        )
    if args.trace:
        with gzip.open(args.trace, "wt") as f:
            json.dump(trace, f)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"[timeline] wrote {args.out}")


if __name__ == "__main__":
    main()
