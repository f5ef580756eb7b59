"""Do compact moments train? A real Megatron GPT with fp32, bf16 and 8bit moments, same seed and data.

    torchrun --nproc-per-node=1 -m tests.gpu.moment_training [--steps 300] [--out bench-results/moment_training.json]
    python -m tests.gpu.moment_training --plot bench-results/moment_training.json      (needs matplotlib)

Needs CUDA and megatron-core. The model is the GPU tier's GPT
(``tests/gpu/megatron_tier.py``: 4 layers, hidden 512, 1024-token vocabulary,
DistributedOptimizer, LR warmup then cosine decay, grads clipped), streamed
through the real entry point (flags -> ``setup_optimizer_state_streaming``)
once per moment dtype. fp32 moments are bit-identical to resident training (the
GPU tier proves it), so that run is the reference.

The data has learnable structure and a known floor: a fixed Markov chain over
the vocabulary (``bench/corpus.py``, entropy 1.21 nats), a fresh batch of
``BATCH`` x 32 tokens each step, the same batches for every run. The final loss
of a run is the mean of its last ``TAIL`` steps. The JSON holds every curve,
the final losses, their distance from fp32 and the bytes each format stores per
param; ``--plot`` draws the curves into a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from bench.corpus import MarkovChain

MOMENT_DTYPES = ("fp32", "bf16", "8bit")
BATCH = 32
TAIL = 30
TARGET = 0.01  # 8bit's final loss within 1% of fp32's


def run(steps: int, directory: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from miles_plugins.optimizers.nvme_stream import setup_optimizer_state_streaming
    from tests.gpu.harness import megatron_tier as tier

    chain = MarkovChain(tier.VOCAB, seed=tier.SEED)

    def markov_batch(step: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(tier.SEED + 1000 * parallel_state.get_data_parallel_rank() + step)
        return tier.as_batch(chain.sample(BATCH, tier.SEQ + 1, g))

    torch.use_deterministic_algorithms(True)
    result = {"steps": steps, "batch": [BATCH, tier.SEQ], "loss_floor": chain.entropy, "runs": {}}
    for moment_dtype in MOMENT_DTYPES:
        if dist.get_rank() == 0:
            print(f"training with {moment_dtype} moments for {steps} steps", flush=True)
        ddp, opt, sched, baseline = tier.build(False, 1, warmup_steps=max(1, steps // 20), decay_steps=steps)
        bindings = setup_optimizer_state_streaming(tier.flags(directory, moment_dtype), opt)
        trained = tier.train(ddp, opt, sched, baseline, steps, batch_of=markov_batch)
        elements = sum(b.numel for binding in bindings for b in binding.store.buckets)
        result["runs"][moment_dtype] = {
            "losses": trained["losses"],
            "final_loss": sum(trained["losses"][-TAIL:]) / TAIL,
            "stored_bytes_per_param": sum(b.store.file_bytes_total for b in bindings) / elements,
        }
        for b in bindings:
            b.store.close()
        del ddp, opt, sched, bindings
        torch.cuda.empty_cache()
    reference = result["runs"]["fp32"]["final_loss"]
    for r in result["runs"].values():
        r["relative_to_fp32"] = r["final_loss"] / reference - 1
    result[f"8bit final loss within {TARGET:.0%} of fp32"] = abs(result["runs"]["8bit"]["relative_to_fp32"]) <= TARGET
    return result


def plot(path: str) -> str:
    """Draw the loss curves of ``path`` (this module's JSON) into a PNG beside it."""
    from bench.harness import pyplot

    plt = pyplot()

    with open(path) as f:
        result = json.load(f)
    figure, (axes, below) = plt.subplots(2, 1, figsize=(8, 6.5), dpi=120, sharex=True, height_ratios=(2, 1))
    reference = result["runs"]["fp32"]["losses"]
    for name, r in result["runs"].items():
        steps = range(1, len(r["losses"]) + 1)
        label = f"{name} moments (final {r['final_loss']:.4f}, {r['relative_to_fp32']:+.2%})"
        axes.plot(steps, r["losses"], label=label, linewidth=1)
        below.plot(steps, [(a - b) / b for a, b in zip(r["losses"], reference, strict=True)], linewidth=1)
    axes.axhline(result["loss_floor"], color="grey", linestyle=":", label=f"loss floor {result['loss_floor']:.3f}")
    axes.set_ylabel("lm loss (nats)")
    axes.set_ylim(result["loss_floor"] - 0.2, result["loss_floor"] + 3)
    axes.set_title(f"Megatron GPT on a Markov corpus, streamed moments ({result['steps']} steps)")
    axes.legend()
    below.set_ylabel("relative to fp32")
    below.set_xlabel("step")
    figure.tight_layout()
    png = os.path.splitext(path)[0] + ".png"
    figure.savefig(png)
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="bench-results/moment_training.json")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the stores' scratch goes")
    parser.add_argument("--plot", metavar="JSON", help="only draw the curves of an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.plot:
        print(f"wrote {plot(args.plot)}")
        return 0
    if args.steps < 2 * TAIL:
        parser.error(f"--steps must be >= {2 * TAIL}")

    import torch.distributed as dist

    from tests.gpu.harness import megatron_tier as tier

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    tier.init_distributed(1)
    result = run(args.steps, os.path.join(args.dir, "moment_training_scratch"))
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        for name, r in result["runs"].items():
            print(
                f"{name:>5} moments: final loss {r['final_loss']:.4f} ({r['relative_to_fp32']:+.2%} vs fp32), "
                f"{r['stored_bytes_per_param']:.2f} stored bytes per param"
            )
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
