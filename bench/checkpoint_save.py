"""Checkpoint save time of the streamed state against a plain file copy of the same bytes.

    python -m bench.checkpoint_save [--elements N] [--dir D] [--out bench-results/checkpoint_save.json]

Builds a store of N fp32-main elements (bf16 params, fp32 moments after one
step), then, side by side in one run and one directory: ``save_to`` (copy with
CRC-32, fsync per file, manifest, atomic rename) and ``shutil.copyfile`` of the
same bucket files followed by an fsync. Both read through the page cache the
scratch files are in; the ratio is the number to look at, absolute times only on
the machine that matters.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=20_000_000)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench-results/checkpoint_save.json")
    args = parser.parse_args()

    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    try:
        params = [torch.randn(args.elements // 4, dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        config = StreamConfig(directory=os.path.join(work, "scratch"), bucket_cap_elements=args.elements // 8)
        with StreamedOptimizer(optimizer, config) as streamed:
            for p in params:
                p.grad = torch.randn_like(p)
            streamed.step()
            files = [streamed.store._backing.file_backing(b).path(b) for b in streamed.store.buckets]
            nbytes = sum(os.path.getsize(f) for f in files)
            rows = []
            for i in range(args.repeats):
                start = time.perf_counter()
                streamed.save_to(os.path.join(work, f"ckpt{i}"))
                save = time.perf_counter() - start
                copy = plain_copy(files, os.path.join(work, f"copy{i}"))
                rows.append({"save_to_s": save, "plain_copy_s": copy, "ratio": save / copy})
        result = {
            "elements": args.elements,
            "bytes": nbytes,
            "directory": args.dir,
            "runs": rows,
            "best_save_to_GBps": nbytes / 1e9 / min(r["save_to_s"] for r in rows),
            "best_plain_copy_GBps": nbytes / 1e9 / min(r["plain_copy_s"] for r in rows),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{nbytes / 1e9:.2f} GB of streamed state; save_to vs a plain copy of the same files:")
    print(f"{'run':>4} {'save_to s':>10} {'copy s':>8} {'ratio':>6}")
    for i, r in enumerate(rows):
        print(f"{i:>4} {r['save_to_s']:>10.3f} {r['plain_copy_s']:>8.3f} {r['ratio']:>6.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
