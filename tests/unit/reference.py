"""An independent resident reference: plain mixed precision with a torch optimizer.

Nothing here touches the code under test. bf16/fp16 params get fp32 mains
stepped by the torch optimizer and copied back; fp32 params are stepped directly.
"""

from __future__ import annotations

import torch

WEIGHT_LR, BIAS_LR = 1e-2, 5e-3
WEIGHT_DECAY = 0.1
LR_DROP_STEP, LR_DROP = 10, 0.3
WD_CHANGE_STEP, NEW_WEIGHT_DECAY = 15, 0.02


class Net(torch.nn.Module):
    """Three linear layers in ``dtype`` plus one fp32 vector (a router-bias-like param)."""

    def __init__(self, dtype: torch.dtype, fp32_extra: bool = True) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 16)
        ).to(dtype)
        self.scale = torch.nn.Parameter(torch.ones(16)) if fp32_extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers(x.to(self.layers[0].weight.dtype)).float()
        return y * self.scale if self.scale is not None else y


def groups(model: Net, tensors: list[torch.Tensor] | None = None) -> list[dict]:
    tensors = tensors if tensors is not None else list(model.parameters())
    pairs = list(zip(model.parameters(), tensors, strict=True))
    return [
        {"params": [t for p, t in pairs if p.dim() >= 2], "lr": WEIGHT_LR, "weight_decay": WEIGHT_DECAY},
        {"params": [t for p, t in pairs if p.dim() < 2], "lr": BIAS_LR, "weight_decay": 0.0},
    ]


def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < LR_DROP_STEP else LR_DROP)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)


def loss_fn(model: Net, step: int) -> torch.Tensor:
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in batch(step))
    return torch.nn.functional.mse_loss(model(x), y)


def between_steps(optimizer: torch.optim.Optimizer, scheduler, step: int) -> None:
    """Schedule changes both runs apply after ``step``: the LR scheduler, and a manual wd change."""
    scheduler.step()
    if step == WD_CHANGE_STEP:
        optimizer.param_groups[0]["weight_decay"] = NEW_WEIGHT_DECAY


def reference_run(opt_cls, dtype: torch.dtype, steps: int, fp32_extra: bool = True, device: str = "cpu"):
    """Train resident; return (params, [(main, exp_avg, exp_avg_sq)]) in model order."""
    model = Net(dtype, fp32_extra).to(device)
    params = list(model.parameters())
    mains = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in params]
    optimizer = opt_cls(groups(model, mains))
    scheduler = schedule(optimizer)
    for step in range(steps):
        loss_fn(model, step).backward()
        for p, main in zip(params, mains, strict=True):
            if main is not p:
                main.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for p, main in zip(params, mains, strict=True):
                if main is not p:
                    p.copy_(main)
        model.zero_grad(set_to_none=True)
        between_steps(optimizer, scheduler, step)
    state = [
        tuple(t.detach().cpu().clone() for t in (m, optimizer.state[m]["exp_avg"], optimizer.state[m]["exp_avg_sq"]))
        for m in mains
    ]
    return [p.detach().cpu().clone() for p in params], state


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def assert_same_training(reference, streamed) -> None:
    """Both are (params, [(main, exp_avg, exp_avg_sq)]) in model order; every byte must match."""
    (ref_params, ref_state), (params, state) = reference, streamed
    for a, b in zip(ref_params, params, strict=True):
        assert same_bytes(a, b)
    for ref, got in zip(ref_state, state, strict=True):
        for a, b in zip(ref, got, strict=True):
            assert same_bytes(a, b)
