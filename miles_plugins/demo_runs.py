"""The demo's model, data and its two training runs: resident (the reference) and streamed.

A small bf16 MLP language model built in code, synthetic token batches with a
learnable rule, two param groups (decayed weights, undecayed biases) and a
warmup-then-decay schedule; ``compare`` checks the final params, mains and
moments of the two runs byte for byte. The command is ``miles_plugins.demo``.
"""

from __future__ import annotations

import contextlib
import time

import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer

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
