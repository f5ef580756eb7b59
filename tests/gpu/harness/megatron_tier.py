"""GPU tier: a small real Megatron GPT, resident vs streamed, through the real entry point.

Run under torchrun (one process per GPU; the data-parallel size is the world size)::

    torchrun --nproc-per-node=2 -m tests.gpu.harness.megatron_tier --out result.json [--moe --ep 2]

Needs CUDA and megatron-core (0.19.2 is what it was validated on). In one
process it trains the same model several times from the same seeds:

- resident twice (the control: if the two differ, no comparison means anything);
- streamed with fp32 moments, turned on the way a launcher does it (flags parsed
  by ``add_arguments`` -> ``setup_optimizer_state_streaming(args, optimizer)``);
- streamed with bf16 and with 8-bit moments;
- the other ways to store and move the state (``VARIANTS``: remainder mains,
  the host-RAM tier, the sync baseline engine, a placement over all three
  homes), each judged bit for bit against the resident run too.

The LR schedule is Megatron's ``OptimizerParamScheduler`` (warmup then cosine
decay, so the LR changes every step) and grads are clipped. Rank 0 writes one
JSON summary: bit identity of params, mains and moments per rank, loss curves,
GPU peak memory during the step, and every rank's streaming counters.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import tempfile

import torch
import torch.distributed as dist

SEED = 1234
VOCAB = 1024
SEQ = 32
MICRO_BATCH = 4
# Large enough that the optimizer state (~13M params, ~160 MB) shows in the GPU
# peak; DDP buckets small enough that each optimizer sees several.
HIDDEN = 512
LAYERS = 4
DDP_BUCKET_ELEMENTS = 1_000_000


def init_distributed(expert_parallel: int) -> None:
    from megatron.core import parallel_state

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=expert_parallel)


# What each build's get_megatron_optimizer added to the GPU memory allocated before it, at its peak.
OPTIMIZER_BUILD_PEAKS: list[int] = []


def build(
    moe: bool,
    expert_parallel: int,
    warmup_steps: int = 3,
    decay_steps: int = 12,
    stream_args: argparse.Namespace | None = None,
):
    """Model, DDP wrapper, optimizer and scheduler (LR warmup, then cosine decay),
    seeded identically every time, and the GPU bytes allocated before they were
    built (what earlier runs left). With ``stream_args`` the optimizer is built as
    the launcher builds it for streaming (``build_without_mains``: no fp32 mains on
    the device until the store fills them); stream it before using it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    # The local spec's expert MLP adds its bias in place on an autograd view: no biases with MoE.
    # Experts get their own optimizer in the chain only when expert-parallel (EP > 1).
    experts = (
        dict(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_aux_loss_coeff=0.0,
            add_bias_linear=False,
            expert_model_parallel_size=expert_parallel,
        )
        if moe
        else {}
    )
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=4 * HIDDEN,
        num_attention_heads=8,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        **experts,
    )
    spec = get_gpt_layer_local_spec(num_experts=4 if moe else None)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ).cuda()
    model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        use_distributed_optimizer=True,
        bucket_size=DDP_BUCKET_ELEMENTS,
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        min_lr=1e-4,
        weight_decay=0.1,
        adam_beta2=0.95,
        clip_grad=1.0,
        bf16=True,
        use_distributed_optimizer=True,
    )
    from miles_plugins.optimizers.nvme_stream import build_without_mains

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with build_without_mains(stream_args) if stream_args is not None else contextlib.nullcontext():
        optimizer = get_megatron_optimizer(opt_config, [ddp])
    torch.cuda.synchronize()
    OPTIMIZER_BUILD_PEAKS.append(torch.cuda.max_memory_allocated() - before)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style="cosine",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return ddp, optimizer, scheduler, baseline


def batch(step: int) -> tuple[torch.Tensor, ...]:
    """Seeded by the data-parallel rank and the step: ranks see different data."""
    from megatron.core import parallel_state

    g = torch.Generator().manual_seed(SEED + 1000 * parallel_state.get_data_parallel_rank() + step)
    return as_batch(torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g))


def as_batch(tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GPTModel's inputs and labels for ``tokens`` of shape (batch, SEQ + 1), on the GPU."""
    tokens = tokens.cuda()
    position_ids = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(tokens.shape[0], -1)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device="cuda"), diagonal=1)
    return tokens[:, :-1], position_ids, mask, tokens[:, 1:]


def train(
    ddp, optimizer, scheduler, baseline: int, steps: int, start: int = 0, batch_of=batch, reset_peaks: bool = True
) -> dict:
    """Train steps ``start`` .. ``start + steps - 1`` on ``batch_of(step)``; per step, the GPU peak during
    ``optimizer.step()`` above ``baseline`` (model, grads, optimizer state and the
    step's temporaries), and what the step added to the memory allocated right
    before it (measured by the allocator, immune to what earlier runs left)."""
    losses, peaks, added, lrs = [], [], [], []
    for step in range(start, start + steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        tokens, position_ids, mask, labels = batch_of(step)
        loss = ddp(tokens, position_ids, mask, labels=labels).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if reset_peaks:  # not under an auto GPU budget: it resets them itself, and reads them first
            torch.cuda.reset_peak_memory_stats()
        success, _, _ = optimizer.step()
        torch.cuda.synchronize()
        assert success, f"step {step} was skipped"
        peaks.append(torch.cuda.max_memory_allocated() - baseline)
        added.append(torch.cuda.max_memory_allocated() - before)
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
        losses.append(loss.item())
    return {"losses": losses, "peaks": peaks, "added": added, "lrs": lrs, "baseline": baseline}


def step_bound(bindings) -> int:
    """What the stores say a step may add on the device (``step_device_bytes_bound``),
    summed: a chain prepares (prefetches) every store before the first one steps."""
    return sum(b.store.step_device_bytes_bound for b in bindings)


def resident_state(optimizer) -> list[tuple[torch.Tensor, ...]]:
    """(main, exp_avg, exp_avg_sq) per shard, in the binding's entry order."""
    out = []
    for member in optimizer.chained_optimizers:
        for main_groups in (member.shard_fp32_from_float16_groups, member.shard_fp32_groups):
            for group in main_groups:
                for main in group:
                    state = member.optimizer.state[main]
                    out.append(tuple(t.detach().cpu().clone() for t in (main, state["exp_avg"], state["exp_avg_sq"])))
    return out


def streamed_state(bindings) -> list[tuple[torch.Tensor, ...]]:
    """The same, read back from the stores (which yield bucket by bucket), in entry order."""
    out = []
    for b in bindings:
        by_entry = {id(entry): (main, m, v) for entry, main, m, v in b.iter_state()}
        out += [by_entry[id(entry)] for entry in b.entries]
    return out


def params_of(ddp) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in ddp.module.parameters()]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def all_same(xs, ys) -> bool:
    return len(xs) == len(ys) and all(same_bytes(x, y) for x, y in zip(xs, ys, strict=True))


# Streamed runs beyond the default (disk tier, pipelined engine, fp32 mains): extra flags.
VARIANTS = {
    "remainder_mains": ["--stream-optimizer-state-main-storage", "remainder"],
    "host_tier_remainder": [
        "--stream-optimizer-state-tier",
        "host",
        "--stream-optimizer-state-main-storage",
        "remainder",
    ],
    "sync_engine": ["--stream-optimizer-state-engine", "sync"],
    # A few buckets kept on the GPU, a few in host memory, the rest on disk (buckets here
    # are a few MB: 10 and 20 MiB budgets leave some in every home).
    "gpu_host_disk": [
        "--stream-optimizer-state-gpu-budget-gb",
        "0.01",
        "--stream-optimizer-state-host-budget-gb",
        "0.02",
    ],
    # Overlap windows: the whole state held across the step boundary (host), and a few
    # buckets of it (disk; buckets here are a few MB): writes land during the next forward,
    # then the next step's first buckets are read (the forward pre-hook's progress()).
    "overlap_host": ["--stream-optimizer-state-tier", "host", "--stream-optimizer-state-overlap-gb", "4"],
    "overlap_disk": ["--stream-optimizer-state-overlap-gb", "0.01"],
    # The GPU budget measured after the first step: on an H200 the device has room for every
    # bucket, so they move there mid-run, from host memory and (O_DIRECT) from disk.
    "auto_budgets": [
        "--stream-optimizer-state-gpu-budget-gb",
        "auto",
        "--stream-optimizer-state-host-budget-gb",
        "0.02",
    ],
}


def flags(directory: str, moment_dtype: str, extra: list[str] = ()) -> argparse.Namespace:
    """What a launcher's parser produces for the streaming flags, plus the Megatron fields it checks."""
    from miles_plugins.optimizers.megatron.args import add_arguments

    args = add_arguments(argparse.ArgumentParser()).parse_args(
        [
            "--stream-optimizer-state-to-disk",
            "--offload-train-disk-dir",
            directory,
            "--stream-optimizer-state-moment-dtype",
            moment_dtype,
            *extra,
        ]
    )
    args.use_distributed_optimizer = True
    args.optimizer = "adam"
    args.bf16 = True
    return args


def run(steps: int, moe: bool, expert_parallel: int, directory: str) -> dict:
    from megatron_hooks.contract import STORE_ATTR
    from miles_plugins.optimizers.nvme_stream import setup_optimizer_state_streaming

    torch.use_deterministic_algorithms(True)
    rank = dist.get_rank()

    ddp, opt, sched, baseline = build(moe, expert_parallel)
    resident = train(ddp, opt, sched, baseline, steps)
    resident_params, resident_opt = params_of(ddp), resident_state(opt)
    del ddp, opt, sched
    torch.cuda.empty_cache()

    ddp, opt, sched, baseline = build(moe, expert_parallel)
    control = train(ddp, opt, sched, baseline, steps)
    control_identical = (
        control["losses"] == resident["losses"]
        and all_same(params_of(ddp), resident_params)
        and all(all_same(a, b) for a, b in zip(resident_state(opt), resident_opt, strict=True))
    )
    del ddp, opt, sched
    torch.cuda.empty_cache()

    args = flags(directory, "fp32")
    ddp, opt, sched, baseline = build(moe, expert_parallel, stream_args=args)
    bindings = setup_optimizer_state_streaming(args, opt)
    streamed = train(ddp, opt, sched, baseline, steps)
    streamed_opt = streamed_state(bindings)
    result = {
        "chain_length": len(opt.chained_optimizers),
        "streamed_optimizers": len(bindings),
        "stores_attached": sum(hasattr(m, STORE_ATTR) for m in opt.chained_optimizers),
        "control_identical": control_identical,
        "params_identical": all_same(params_of(ddp), resident_params),
        "mains_identical": all_same([s[0] for s in streamed_opt], [s[0] for s in resident_opt]),
        "moments_identical": all(all_same(s[1:], r[1:]) for s, r in zip(streamed_opt, resident_opt, strict=True))
        and len(streamed_opt) == len(resident_opt),
        "losses_identical": streamed["losses"] == resident["losses"],
        "lrs": resident["lrs"],
        "losses_resident": resident["losses"],
        "losses_streamed": streamed["losses"],
        "step_peak_bytes_resident": max(resident["peaks"]),
        "step_peak_bytes_streamed": max(streamed["peaks"]),
        "step_added_bytes_resident": max(resident["added"]),
        "step_added_bytes_streamed": max(streamed["added"]),
        "step_device_bytes_bound": step_bound(bindings),
        "baselines": [resident["baseline"], control["baseline"], streamed["baseline"]],
        "state_bytes_total": sum(b.store.state_bytes_total for b in bindings),
        # The first build is resident, the third the streamed one (built without mains).
        "optimizer_build_peak_resident": OPTIMIZER_BUILD_PEAKS[0],
        "optimizer_build_peak_streamed": OPTIMIZER_BUILD_PEAKS[2],
        "bucket_bytes_max": max(b.store.bucket_bytes_max for b in bindings),
        "accounted_max_state_bytes": max(b.store.accounted_max_state_bytes for b in bindings),
        "accounted_max_state_bytes_per_store": [b.store.accounted_max_state_bytes for b in bindings],
        "bucket_bytes_max_per_store": [b.store.bucket_bytes_max for b in bindings],
        "buckets": sum(len(b.store.buckets) for b in bindings),
        "buckets_in_flight": bindings[0].store.config.max_in_flight,
    }
    # Evidence per rank: the counters of every store, and that the state dict
    # family answers without touching evicted storage.
    counters = [
        {"name": b.store.config.name, "steps": b.store.steps_taken, "bytes_read": b.store.total.bytes_read}
        for b in bindings
    ]
    state_dicts = opt.state_dict()
    state_dicts = state_dicts if isinstance(state_dicts, list) else [state_dicts]
    result["state_dict_has_param_state"] = any("param_state" in sd for sd in state_dicts)
    sharded = opt.sharded_state_dict({}, is_loading=False)
    result["sharded_state_dict_keys"] = sorted(str(k) for k in sharded)
    # reload_model_params rebuilds the mains from the (bf16) params; moments stay.
    opt.reload_model_params()
    reloaded = streamed_state(bindings)
    result["reload_mains_from_params"] = all(
        same_bytes(main, binding_entry.param.detach().cpu().float())
        for b in bindings
        for (binding_entry, main, _, _) in b.iter_state()
    )
    result["reload_kept_moments"] = all(all_same(r[1:], s[1:]) for r, s in zip(reloaded, streamed_opt, strict=True))
    for b in bindings:
        b.store.close()
    del ddp, opt, sched, bindings
    torch.cuda.empty_cache()

    # Compact moments are storage formats: judged by how far the loss curve moves.
    result["compact_moments"] = {}
    for moment_dtype in ("bf16", "8bit"):
        args = flags(directory, moment_dtype)
        ddp, opt, sched, baseline = build(moe, expert_parallel, stream_args=args)
        bindings = setup_optimizer_state_streaming(args, opt)
        compact = train(ddp, opt, sched, baseline, steps)
        result["compact_moments"][moment_dtype] = {
            "losses": compact["losses"],
            "max_rel_loss_diff": max(
                abs(a - b) / abs(b) for a, b in zip(compact["losses"], resident["losses"], strict=True)
            ),
            "mains_differ": not all_same([s[0] for s in streamed_state(bindings)], [s[0] for s in resident_opt]),
            "file_bytes_total": sum(b.store.file_bytes_total for b in bindings),
            "step_added_bytes": max(compact["added"]),
            "step_added_bytes_per_step": compact["added"],
            "step_device_bytes_bound": step_bound(bindings),
        }
        for b in bindings:
            b.store.close()
        del ddp, opt, sched, bindings
        torch.cuda.empty_cache()

    result["variants"] = {}
    for name, extra in VARIANTS.items():
        args = flags(directory, "fp32", extra)
        ddp, opt, sched, baseline = build(moe, expert_parallel, stream_args=args)
        bindings = setup_optimizer_state_streaming(args, opt)
        variant = train(ddp, opt, sched, baseline, steps, reset_peaks=name != "auto_budgets")
        state = streamed_state(bindings)
        result["variants"][name] = {
            "identical": variant["losses"] == resident["losses"]
            and all_same(params_of(ddp), resident_params)
            and len(state) == len(resident_opt)
            and all(all_same(s, r) for s, r in zip(state, resident_opt, strict=True)),
            "bytes_read": sum(b.store.total.bytes_read for b in bindings),
            "step_peak_bytes": max(variant["peaks"]),
            "step_added_bytes": max(variant["added"]),
            "step_device_bytes_bound": step_bound(bindings),
            "placement": {home: sum(b.store.placement[home] for b in bindings) for home in ("gpu", "host", "disk")},
            "gpu_home_bytes": sum(b.store.home_bytes["gpu"] for b in bindings),
            "carried_peak_bytes": sum(b.store.carried_peak_bytes for b in bindings),
            "overlap_bytes_bound": sum(b.store.overlap_bytes_bound for b in bindings),
        }
        for b in bindings:
            b.store.close()
        del ddp, opt, sched, bindings
        torch.cuda.empty_cache()

    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"rank": rank, **result, "counters": counters})
    return {
        "world_size": dist.get_world_size(),
        "moe": moe,
        "expert_parallel": expert_parallel,
        "steps": steps,
        "ranks": per_rank,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--moe", action="store_true", help="4 experts, top-2, in every layer")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --moe)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the ranks' shared scratch directory goes")
    args = parser.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    init_distributed(args.ep)
    # One directory for all ranks, as on a node: per-rank subdirectories keep them apart.
    summary = run(args.steps, args.moe, args.ep, os.path.join(args.dir, "megatron_tier_scratch"))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
