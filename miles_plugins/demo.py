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
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time

import torch

from miles_plugins.optimizers import StreamConfig, StreamConfigError, StreamedOptimizer, StreamIOError
from miles_plugins.optimizers.config import AUTO, ENGINES, MAIN_STORAGES, MOMENT_DTYPES, TIERS, AutoBudget
from miles_plugins.optimizers.homes.fs import parse_size
from miles_plugins.optimizers.homes.scratch import DEMO_SCRATCH_PREFIX

VOCAB = 512
WIDTH = 128
BLOCKS = 4
BATCH, SEQ = 8, 32
LR, WEIGHT_DECAY = 3e-3, 0.1
# With the demo's model (~0.66M params) this cap cuts the state into ~10 buckets.
DEMO_BUCKET_CAP = 65_536


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def build_model(device: torch.device) -> TinyLM:
    torch.manual_seed(1234)
    return TinyLM().to(device=device, dtype=torch.bfloat16)


def param_groups(model: torch.nn.Module, params: list[torch.Tensor] | None = None) -> list[dict]:
    """Decayed matrices, undecayed vectors; ``params`` substitutes tensors in model order."""
    params = params if params is not None else list(model.parameters())
    decay = [t for (_, p), t in zip(model.named_parameters(), params, strict=True) if p.dim() >= 2]
    no_decay = [t for (_, p), t in zip(model.named_parameters(), params, strict=True) if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0, "lr": LR / 2},
    ]


def schedule(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = max(1, steps // 4)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else max(0.1, 1 - (s - warmup) / steps)
    )


def batches(steps: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic next-token data with a learnable rule: target = (7 * token + 3) mod VOCAB."""
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((tokens.to(device), ((7 * tokens + 3) % VOCAB).to(device)))
    return out


def loss_of(model: TinyLM, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(tokens).float().view(-1, VOCAB), targets.view(-1))


def train_resident(device: torch.device, data: list) -> dict:
    """The reference: plain mixed precision, fp32 mains and AdamW state in memory."""
    model = build_model(device)
    mains = [p.detach().float().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(param_groups(model, mains), lr=LR)
    scheduler = schedule(optimizer, len(data))
    losses = []
    start = time.perf_counter()
    for tokens, targets in data:
        loss = loss_of(model, tokens, targets)
        loss.backward()
        for main, p in zip(mains, model.parameters(), strict=True):
            main.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for main, p in zip(mains, model.parameters(), strict=True):
                p.copy_(main)
        model.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    state = [
        (main.cpu(), optimizer.state[main]["exp_avg"].cpu(), optimizer.state[main]["exp_avg_sq"].cpu())
        for main in mains
    ]
    return {
        "params": [p.detach().cpu() for p in model.parameters()],
        "state": state,
        "losses": losses,
        "seconds": seconds,
    }


def build_streamed(device: torch.device, config: StreamConfig) -> tuple[TinyLM, StreamedOptimizer]:
    """The streamed run's model and optimizer. Building the store checks its
    directories (free space included) and writes the initial mains, so the demo
    does it before any training."""
    model = build_model(device)
    return model, StreamedOptimizer(torch.optim.AdamW(param_groups(model), lr=LR), config)


def train_streamed(device: torch.device, data: list, model: TinyLM, streamed: StreamedOptimizer) -> dict:
    optimizer = streamed.optimizer
    losses, step_peaks = [], []
    # After wrapping: the scheduler then wraps the streamed step.
    scheduler = schedule(optimizer, len(data))
    start = time.perf_counter()
    for step, (tokens, targets) in enumerate(data, 1):
        loss = loss_of(model, tokens, targets)
        loss.backward()
        with measured_step_peak(device, step_peaks, reset=streamed.store.auto_gpu is None):
            optimizer.step()  # the streamed step: StreamedOptimizer rebinds it
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
        if step % max(1, len(data) // 10) == 0 or step == len(data):
            print(f"  streamed step {step}/{len(data)}: loss {losses[-1]:.4f}", flush=True)
    seconds = time.perf_counter() - start
    by_param = {id(p): (main, m, v) for p, main, m, v in streamed.iter_state()}
    store = streamed.store
    return {
        "params": [p.detach().cpu() for p in model.parameters()],
        "state": [by_param[id(p)] for p in model.parameters()],
        "losses": losses,
        "seconds": seconds,
        "buckets": len(store.buckets),
        "placement": store.placement,
        "state_bytes_total": store.state_bytes_total,
        "bucket_bytes_max": store.bucket_bytes_max,
        "accounted_max_state_bytes": store.accounted_max_state_bytes,
        "measured_step_peak_bytes": max(step_peaks) if step_peaks else None,
        "step_device_bytes_bound": store.step_device_bytes_bound,
        "file_bytes_total": store.file_bytes_total,
        "bytes_read": store.total.bytes_read,
        "bytes_written": store.total.bytes_written,
    }


@contextlib.contextmanager
def measured_step_peak(device: torch.device, peaks: list[int], reset: bool = True):
    """On CUDA, append what the allocator saw the step add to what was allocated
    before it (a measurement, beside the store's own accounting). Not with an auto
    GPU budget (``reset`` False): resetting the peak would hide the forward/backward
    peak it sizes the device home by."""
    if device.type != "cuda" or not reset:
        yield
        return
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield
    torch.cuda.synchronize(device)
    peaks.append(torch.cuda.max_memory_allocated(device) - before)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def compare(resident: dict, streamed: dict) -> bool:
    params_equal = all(same_bytes(a, b) for a, b in zip(resident["params"], streamed["params"], strict=True))
    state_equal = all(
        same_bytes(x, y)
        for r, s in zip(resident["state"], streamed["state"], strict=True)
        for x, y in zip(r, s, strict=True)
    )
    return params_equal and state_equal


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


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
    if args.steps <= 0:
        parser.error(f"--steps must be > 0, got {args.steps}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but this torch sees no CUDA device; use --device cpu or auto", file=sys.stderr)
        return 2
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)

    parents = [part.strip() for part in args.dir.split(",")]  # several: buckets spread over them
    problem = _bad_directories(parents)
    if problem:
        print(f"error: --dir {args.dir}: {problem}", file=sys.stderr)
        return 2
    try:  # checked before anything is created; the scratch directories replace the parents below
        config = StreamConfig(
            directory=",".join(parents),
            moment_dtype=args.moment_dtype,
            bucket_cap_elements=args.bucket_cap,
            main_storage=args.main_storage,
            tier=args.tier,
            engine=args.engine,
            gpu_budget_bytes=args.gpu_budget,
            host_budget_bytes=args.host_budget,
        )
    except StreamConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The parents the demo creates (the store makes its directories), removed again at the
    # end when empty, deepest first.
    created = sorted({d for parent in parents for d in missing_dirs(parent)}, key=len, reverse=True)
    # The store's scratch sits right in each --dir, named for this process, so that the
    # store's own cleanup (close, exit, SIGTERM) removes all of it, and what a SIGKILL
    # leaves is found by `python -m miles_plugins.optimizers.scratch purge DIR`.
    config = dataclasses.replace(config, name=f"{DEMO_SCRATCH_PREFIX}{os.getpid()}")
    try:
        data = batches(args.steps, device)
        model, streamed_optimizer = build_streamed(device, config)  # refuses a --dir it cannot use, before training
        with streamed_optimizer:
            print(
                f"training a {sum(p.numel() for p in model.parameters()):,}-param bf16 model on {device} for "
                f"{args.steps} steps"
            )
            print("resident run (fp32 mains and AdamW state in memory)...", flush=True)
            resident = train_resident(device, data)
            where = streamed_optimizer.store.location
            if args.gpu_budget or args.host_budget:
                gpu, host = (b if b == AUTO else f"{b:,} bytes" for b in (args.gpu_budget, args.host_budget))
                where += f", up to {gpu} on the {device.type} and {host} in host memory"
            print(f"streamed run ({args.engine} engine, state in {where})...", flush=True)
            streamed = train_streamed(device, data, model, streamed_optimizer)
    except (StreamConfigError, StreamIOError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the scratch directories are removed", file=sys.stderr)
        return 130
    finally:
        _remove(created)

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
        "buckets_in_flight": config.depth,
        "state_bytes_total": streamed["state_bytes_total"],
        "bucket_bytes_max": streamed["bucket_bytes_max"],
        "accounted_max_state_bytes": streamed["accounted_max_state_bytes"],
        "measured_step_peak_bytes": streamed["measured_step_peak_bytes"],
        "step_device_bytes_bound": streamed["step_device_bytes_bound"],
        "file_bytes_total": streamed["file_bytes_total"],
        "bytes_read": streamed["bytes_read"],
        "bytes_written": streamed["bytes_written"],
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


if __name__ == "__main__":
    sys.exit(main())
