"""How moment storage formats train: the demo's model on a Markov corpus, one run per format.

    python -m bench.moment_formats [--steps 200] [--out bench-results/moment_formats.json]

Each run is the plain mixed-precision loop (bf16 model, fp32 mains, torch
AdamW) from the same seed on the same batches; after every step each moment is
stored and read back in the run's format, as a streamed step does:

- ``fp32``: unchanged (the reference);
- ``bf16``: rounded to bf16;
- ``8bit``: the shipped blockwise format (``quant8.encode_in_place`` /
  ``decode_in_place``: signed map for exp_avg, sqrt(exp_avg_sq) on the unsigned map);
- ``8bit-direct-v``: as bitsandbytes stores exp_avg_sq: the value itself on the unsigned map;
- ``8bit-tensorwise``: one scale per tensor instead of per block of 256;
- ``8bit-unscaled``: no scale at all (the map applied to the raw values).

Also measured on the fp32 run's final moments: how far sqrt(exp_avg_sq), the
update's denominator, moves when stored each way. The loss of a run is the mean
of its last ``TAIL`` steps. Runs on the CPU in about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch

from bench.corpus import MarkovChain
from miles_plugins.demo_runs import LR, VOCAB, build_model, param_groups, schedule
from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
from miles_plugins.optimizers.formats import quant8

BATCH, SEQ = 16, 33
TAIL = 20
SEED = 7


def batches(steps: int) -> list[torch.Tensor]:
    chain, g = MarkovChain(VOCAB, seed=SEED), torch.Generator().manual_seed(SEED)
    return [chain.sample(BATCH, SEQ, g) for _ in range(steps)]


def roundtrip(x: torch.Tensor, signed: bool, sqrt: bool, scaling: str) -> torch.Tensor:
    """``x`` stored on the dynamic map and read back; ``scaling`` is ``block``
    (per BLOCK elements, as quant8), ``tensor`` (one absmax) or ``none``."""
    values = quant8.dynamic_map(signed)
    flat = x.reshape(-1).sqrt() if sqrt else x.reshape(-1)
    if scaling == "block":
        codes, scales = quant8.quantize_chunk(flat, signed)
        y = quant8.dequantize_chunk(codes, scales, signed)
    else:
        scale = flat.abs().max().clamp(min=1e-38) if scaling == "tensor" else torch.tensor(1.0)
        codes = torch.bucketize((flat / scale).clamp(-1, 1), (values[:-1] + values[1:]) / 2)
        y = values[codes] * scale
    return (y.square() if sqrt else y).view_as(x)


def store_8bit(name: str, t: torch.Tensor) -> None:
    """The shipped format, through the in-place code a streamed step runs."""
    quant8.encode_in_place(t, *quant8.MOMENT_FORMATS[name])
    quant8.decode_in_place(t, *quant8.MOMENT_FORMATS[name])


def _stored_as(signed_sqrt_scaling: Callable[[str], tuple[bool, bool, str]]) -> Callable[[str, torch.Tensor], None]:
    """A variant that stores entries of a block or more through :func:`roundtrip`
    (smaller ones stay fp32, as in the shipped format)."""

    def store(name: str, t: torch.Tensor) -> None:
        if quant8.quantizes(t.numel()):
            t.copy_(roundtrip(t, *signed_sqrt_scaling(name)))

    return store


VARIANTS = {
    "fp32": None,
    "bf16": lambda name, t: t.copy_(t.bfloat16().float()),
    "8bit": store_8bit,
    "8bit-direct-v": _stored_as(lambda name: (name == "exp_avg", False, "block")),
    "8bit-tensorwise": _stored_as(lambda name: (*quant8.MOMENT_FORMATS[name], "tensor")),
    "8bit-unscaled": _stored_as(lambda name: (*quant8.MOMENT_FORMATS[name], "none")),
}


def train(variant: str, data: list[torch.Tensor], streamed: StreamConfig | None = None) -> dict:
    """One run: its losses, final params and optimizer (its moments as stored).
    ``streamed``: the optimizer is wrapped in ``StreamedOptimizer`` with this
    config, which stores the moments itself (``variant`` must be its moment dtype)."""
    model = build_model(torch.device("cpu"))
    if streamed is None:
        store = VARIANTS[variant]
        mains = [p.detach().float().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(param_groups(model, mains), lr=LR)
    else:
        assert streamed.moment_dtype == variant, "a streamed run stores its moments as its config says"
        optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
        wrapper = StreamedOptimizer(optimizer, streamed)
    scheduler = schedule(optimizer, len(data))
    losses = []
    for tokens in data:
        logits = model(tokens[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        if streamed is None:
            for main, p in zip(mains, model.parameters(), strict=True):
                main.grad = p.grad.float()
        optimizer.step()
        scheduler.step()
        if streamed is None:
            with torch.no_grad():
                for main, p in zip(mains, model.parameters(), strict=True):
                    p.copy_(main)
                    if store is not None:
                        for name in ("exp_avg", "exp_avg_sq"):
                            store(name, optimizer.state[main][name])
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if streamed is not None:
        wrapper.close()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()], "optimizer": optimizer}


def final_loss(losses: list[float]) -> float:
    return sum(losses[-TAIL:]) / TAIL


def denominator_errors(optimizer: torch.optim.Optimizer) -> dict:
    """How sqrt(exp_avg_sq) moves when exp_avg_sq is stored as its square root
    (shipped) or as itself (bitsandbytes), over the blocks of every quantized tensor."""
    vs = [s["exp_avg_sq"].reshape(-1) for s in optimizer.state.values() if quant8.quantizes(s["exp_avg_sq"].numel())]
    v = torch.cat(vs)
    true = v.sqrt()
    out = {}
    for label, sqrt in (("sqrt (shipped)", True), ("direct (bitsandbytes)", False)):
        got = torch.cat([roundtrip(x, False, sqrt, "block") for x in vs]).sqrt()
        live = true > 0
        rel = ((got - true).abs() / true)[live]
        out[label] = {
            "median_rel_error": rel.median().item(),
            "p99_rel_error": rel.quantile(0.99).item() if rel.numel() < 2**24 else None,
            "max_rel_error": rel.max().item(),
            "zeroed_fraction": (got[live] == 0).float().mean().item(),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default="bench-results/moment_formats.json")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or args.steps < TAIL:
        parser.error(f"unknown variants {unknown}" if unknown else f"--steps must be >= {TAIL}")
    data = batches(args.steps)
    result = {"steps": args.steps, "loss_floor": MarkovChain(VOCAB).entropy, "runs": {}}
    for variant in ["fp32", *[v for v in variants if v != "fp32"]]:
        print(f"training with {variant} moments for {args.steps} steps", flush=True)
        run = train(variant, data)
        result["runs"][variant] = {"final_loss": final_loss(run["losses"]), "losses": run["losses"]}
        if variant == "fp32":
            result["denominator_errors"] = denominator_errors(run["optimizer"])
    reference = result["runs"]["fp32"]["final_loss"]
    print(f"{'moments':>16} {'final loss':>10} {'vs fp32':>8}")
    for variant, run in result["runs"].items():
        run["relative_to_fp32"] = run["final_loss"] / reference - 1
        print(f"{variant:>16} {run['final_loss']:10.4f} {run['relative_to_fp32']:+8.2%}")
    for label, errors in result["denominator_errors"].items():
        print(
            f"sqrt(exp_avg_sq) stored {label}: " + ", ".join(f"{k} {v:.3g}" for k, v in errors.items() if v is not None)
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
