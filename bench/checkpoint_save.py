"""Checkpoint save time of the streamed state: synchronous, in the background, and a
plain file copy of the same bytes.

    python -m bench.checkpoint_save [--elements N] [--tier disk|host] [--forward-backward-s S]
                                    [--dir D] [--out bench-results/checkpoint_save.json]

Builds a store of N fp32-main elements (bf16 params, fp32 moments after one
step), then, side by side in one run and one directory: ``save_to`` (copy with
CRC-32, fsync per file, manifest, atomic rename), ``shutil.copyfile`` of the
same bucket files followed by an fsync (disk tier), and ``save_to(...,
asynchronous=True)`` followed by two steps while it runs, each after
``--forward-backward-s`` seconds of other work (a sleep standing in for an
iteration's forward and backward; 0: the steps follow at once, the worst case):
what the save blocks the caller for (the call itself, and the waits of those
steps for bytes it had not copied yet: ``BackgroundSave.waited_s``) against the
synchronous save. The
ratios are the numbers to look at, absolute times only on the machine that matters.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer


def plain_copy(sources: list[str], dest: str) -> float:
    os.makedirs(dest)
    start = time.perf_counter()
    for src in sources:
        target = os.path.join(dest, os.path.basename(src))
        shutil.copyfile(src, target)
        fd = os.open(target, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - start


def _one_run(streamed, step, work: str, i: int, tier: str, forward_backward_s: float) -> dict:
    """One synchronous save, one plain copy (disk tier), one background save beside two steps."""
    start = time.perf_counter()
    streamed.save_to(os.path.join(work, f"ckpt{i}"))
    row = {"save_to_s": time.perf_counter() - start}
    if tier == "disk":
        files = [streamed.store._backing.file_backing(b).path(b) for b in streamed.store.buckets]
        row["plain_copy_s"] = plain_copy(files, os.path.join(work, f"copy{i}"))
        row["ratio"] = row["save_to_s"] / row["plain_copy_s"]
    start = time.perf_counter()
    pending = streamed.save_to(os.path.join(work, f"background{i}"), asynchronous=True)
    row["background_call_s"] = time.perf_counter() - start
    for _ in range(2):
        time.sleep(forward_backward_s)
        step()
    pending.wait()
    row["background_total_s"] = time.perf_counter() - start
    row["background_step_waits_s"] = pending.waited_s
    row["blocked_over_sync"] = (row["background_call_s"] + pending.waited_s) / row["save_to_s"]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=20_000_000)
    parser.add_argument("--tier", choices=["disk", "host"], default="disk")
    parser.add_argument("--forward-backward-s", type=float, default=0.0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench-results/checkpoint_save.json")
    args = parser.parse_args(argv)

    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    try:
        params = [torch.randn(args.elements // 4, dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        config = StreamConfig(
            directory=os.path.join(work, "scratch"), bucket_cap_elements=args.elements // 8, tier=args.tier
        )
        with StreamedOptimizer(optimizer, config) as streamed:

            def step() -> None:
                for p in params:
                    p.grad = torch.randn_like(p)
                streamed.step()

            step()
            nbytes = streamed.store.file_bytes_total
            rows = [_one_run(streamed, step, work, i, args.tier, args.forward_backward_s) for i in range(args.repeats)]
        result = {
            "elements": args.elements,
            "tier": args.tier,
            "forward_backward_s": args.forward_backward_s,
            "bytes": nbytes,
            "directory": args.dir,
            "runs": rows,
            "best_save_to_GBps": nbytes / 1e9 / min(r["save_to_s"] for r in rows),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{nbytes / 1e9:.2f} GB of streamed state ({args.tier} tier); seconds:")
    print(f"{'run':>4} {'save_to':>8} {'copy':>8} {'bg call':>8} {'bg waits':>9} {'bg total':>9} {'blocked/sync':>13}")
    for i, r in enumerate(rows):
        copy = f"{r['plain_copy_s']:>8.3f}" if "plain_copy_s" in r else f"{'-':>8}"
        print(
            f"{i:>4} {r['save_to_s']:>8.3f} {copy} {r['background_call_s']:>8.3f} {r['background_step_waits_s']:>9.3f} "
            f"{r['background_total_s']:>9.3f} {r['blocked_over_sync']:>13.3f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
