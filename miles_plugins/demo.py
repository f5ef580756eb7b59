"""The demo: train a small model twice, resident and streamed, and compare bit for bit.

    python -m miles_plugins.demo [--steps N] [--moment-dtype fp32] [--main-storage fp32|remainder]
                                 [--tier disk|host] [--gpu-budget SIZE] [--host-budget SIZE]
                                 [--engine pipelined|sync] [--bucket-cap N] [--dir DIR]

It builds a small bf16 MLP language model in code, feeds it synthetic token
batches, and trains it for N steps twice from the same seed:

- *resident*: the usual mixed-precision loop, fp32 mains and AdamW state in memory;
- *streamed*: the same AdamW wrapped in ``StreamedOptimizer``, its state in
  bucket files in a scratch directory ``miles-demo-<pid>`` in each ``--dir``,
  which the store creates (before the resident run: a directory it cannot use
  is refused before any training) and removes (also on SIGTERM; what a SIGKILL
  leaves, ``python -m miles_plugins.optimizers.scratch purge DIR`` removes).

Both runs use two param groups (decayed weights, undecayed biases) and a
warmup-then-decay learning-rate schedule. The last line printed is one JSON
object; ``bit_identical`` compares the final params, mains and moments byte for
byte. Runs on CUDA when available, else on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile

import torch

from miles_plugins.demo_runs import DEMO_BUCKET_CAP, batches, build_streamed, compare, train_resident, train_streamed
from miles_plugins.optimizers import StreamConfig, StreamConfigError, StreamIOError
from miles_plugins.optimizers.config import AUTO, ENGINES, MAIN_STORAGES, MOMENT_DTYPES, TIERS, AutoBudget
from miles_plugins.optimizers.homes.fs import parse_size
from miles_plugins.optimizers.homes.scratch import DEMO_SCRATCH_PREFIX


def missing_dirs(path: str) -> list[str]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _bad_directories(parents: list[str]) -> str | None:
    """Why ``--dir``'s directories cannot hold scratch directories, or None (the same
    directory twice, or nested, is ``StreamConfig``'s to refuse, below)."""
    if not all(parents):
        return "an empty directory name (give one path, or several separated by commas)"
    return next((f"{p} is not a directory" for p in parents if os.path.exists(p) and not os.path.isdir(p)), None)


def _remove(created: list[str]) -> None:
    for directory in created:
        with contextlib.suppress(OSError):
            os.rmdir(directory)  # only if empty: never what was there before


def _budget(text: str) -> int | AutoBudget:
    if text == AutoBudget.WORD:
        return AUTO
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or {AUTO}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    # Not argparse choices: StreamConfig refuses the dtypes it no longer offers with the reason.
    parser.add_argument("--moment-dtype", default="fp32", help=f"moment storage dtype: {', '.join(MOMENT_DTYPES)}")
    parser.add_argument(
        "--bucket-cap", type=int, default=DEMO_BUCKET_CAP, help=f"elements per bucket (default {DEMO_BUCKET_CAP})"
    )
    parser.add_argument("--main-storage", default="fp32", choices=list(MAIN_STORAGES), help="how mains are stored")
    parser.add_argument("--tier", default="disk", choices=list(TIERS), help="where the state lives between steps")
    parser.add_argument(
        "--gpu-budget",
        type=_budget,
        default=0,
        metavar="SIZE",
        help="device memory for buckets kept there between steps, e.g. 3M, or auto: what the first step's "
        "peak left, less a margin (default 0)",
    )
    parser.add_argument(
        "--host-budget",
        type=_budget,
        default=0,
        metavar="SIZE",
        help="pinned host memory for buckets the GPU budget leaves, e.g. 2G, or auto (what the host has, less a "
        "margin); the rest go to the tier (default 0)",
    )
    parser.add_argument("--engine", default="pipelined", choices=list(ENGINES), help="how buckets move")
    parser.add_argument(
        "--dir",
        default=tempfile.gettempdir(),
        help="where the scratch directory is created; several, comma-separated: one in each, buckets spread over them",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("-v", "--verbose", action="store_true", help="log every streamed step")
    return parser


def _config(args: argparse.Namespace, parents: list[str]) -> StreamConfig:
    """The demo's settings, checked before anything is created. The store's scratch sits
    right in each --dir, named for this process, so that the store's own cleanup (close,
    exit, SIGTERM) removes all of it, and what a SIGKILL leaves is found by
    ``python -m miles_plugins.optimizers.scratch purge DIR``."""
    return StreamConfig(
        directory=",".join(parents),
        moment_dtype=args.moment_dtype,
        bucket_cap_elements=args.bucket_cap,
        main_storage=args.main_storage,
        tier=args.tier,
        engine=args.engine,
        gpu_budget_bytes=args.gpu_budget,
        host_budget_bytes=args.host_budget,
        name=f"{DEMO_SCRATCH_PREFIX}{os.getpid()}",
    )


def _run_both(args: argparse.Namespace, device: torch.device, config: StreamConfig) -> tuple[dict, dict]:
    """The resident run and the streamed run on the same batches."""
    data = batches(args.steps, device)
    model, streamed_optimizer = build_streamed(device, config)  # refuses a --dir it cannot use, before training
    with streamed_optimizer:
        print(
            f"training a {sum(p.numel() for p in model.parameters()):,}-param bf16 model on {device} for {args.steps} steps"
        )
        print("resident run (fp32 mains and AdamW state in memory)...", flush=True)
        resident = train_resident(device, data)
        where = streamed_optimizer.store.location
        if args.gpu_budget or args.host_budget:
            gpu, host = (b if b == AUTO else f"{b:,} bytes" for b in (args.gpu_budget, args.host_budget))
            where += f", up to {gpu} on the {device.type} and {host} in host memory"
        print(f"streamed run ({args.engine} engine, state in {where})...", flush=True)
        streamed = train_streamed(device, data, model, streamed_optimizer)
    return resident, streamed


def _report(
    args: argparse.Namespace, device: torch.device, config: StreamConfig, resident: dict, streamed: dict
) -> int:
    """Print the summary and its JSON line; the exit status (1: fp32 storage not bit-identical)."""
    identical = compare(resident, streamed)
    report = {
        "steps": args.steps,
        "device": str(device),
        "moment_dtype": args.moment_dtype,
        "main_storage": args.main_storage,
        "tier": args.tier,
        "placement": streamed["placement"],
        "engine": args.engine,
        "bit_identical": identical,
        "buckets": streamed["buckets"],
        "buckets_in_flight": config.max_in_flight,
        **{key: streamed[key] for key in _STREAMED_FIGURES},
        "seconds_resident": round(resident["seconds"], 4),
        "seconds_streamed": round(streamed["seconds"], 4),
        "final_loss_resident": resident["losses"][-1],
        "final_loss_streamed": streamed["losses"][-1],
    }
    print(
        f"loss {resident['losses'][0]:.4f} -> {resident['losses'][-1]:.4f} resident, "
        f"-> {streamed['losses'][-1]:.4f} streamed"
    )
    print(
        f"state: {report['state_bytes_total']:,} bytes in fp32 in {report['buckets']} buckets "
        f"(largest {report['bucket_bytes_max']:,}), stored as {report['file_bytes_total']:,} bytes; at most "
        f"{report['accounted_max_state_bytes']:,} materialized at once"
    )
    verdict = "bit-identical" if identical else "NOT bit-identical"
    expected = args.moment_dtype == "fp32"
    print(
        f"params, mains and moments: {verdict}" + ("" if expected else f" (expected with {args.moment_dtype} moments)")
    )
    print(json.dumps(report))
    return 0 if identical or not expected else 1


# What the streamed run reports as it measured or counted it, into the JSON line as is.
_STREAMED_FIGURES = (
    "state_bytes_total",
    "bucket_bytes_max",
    "accounted_max_state_bytes",
    "measured_step_peak_bytes",
    "step_device_bytes_bound",
    "file_bytes_total",
    "bytes_read",
    "bytes_written",
)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps <= 0:
        parser.error(f"--steps must be > 0, got {args.steps}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but this torch sees no CUDA device; use --device cpu or auto", file=sys.stderr)
        return 2
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    parents = [part.strip() for part in args.dir.split(",")]  # several: buckets spread over them
    problem = _bad_directories(parents)
    if problem:
        print(f"error: --dir {args.dir}: {problem}", file=sys.stderr)
        return 2
    try:
        config = _config(args, parents)
    except StreamConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The parents the demo creates (the store makes its directories), removed again at the
    # end when empty, deepest first.
    created = sorted({d for parent in parents for d in missing_dirs(parent)}, key=len, reverse=True)
    try:
        resident, streamed = _run_both(args, device, config)
    except (StreamConfigError, StreamIOError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the scratch directories are removed", file=sys.stderr)
        return 130
    finally:
        _remove(created)
    return _report(args, device, config, resident, streamed)


if __name__ == "__main__":
    sys.exit(main())
