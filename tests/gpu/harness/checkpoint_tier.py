"""GPU tier: streamed optimizer state through Megatron's own save_checkpoint / load_checkpoint.

Each phase runs in its own process (torchrun), against a Megatron tree the patch
series was applied to::

    torchrun --nproc-per-node=1 -m tests.gpu.harness.checkpoint_tier --phase reference --work W
    torchrun --nproc-per-node=1 -m tests.gpu.harness.checkpoint_tier --phase save --work W --format torch_dist
    torchrun --nproc-per-node=1 -m tests.gpu.harness.checkpoint_tier --phase resume --work W --format torch_dist
    torchrun --nproc-per-node=1 -m tests.gpu.harness.checkpoint_tier --phase refuse --work W

- ``reference``: an uninterrupted *resident* run of 2K steps (the independent
  reference), and a checkpoint saved at step K without streaming.
- ``save``: streamed K steps, then ``save_checkpoint``.
- ``resume``: a new process streams, ``load_checkpoint``s, trains K more steps;
  params, mains, moments and losses must equal the reference byte for byte.
- ``refuse``: loads that must be refused, each with its reason: another moment
  dtype, a checkpoint written without streaming, a truncated bucket file.
- ``reshard-save`` / ``reshard-resume`` (``--mode resident|streamed``, ``--moe``):
  K steps and a save at one DP size, a resume and K more steps at another; the
  resident run (Megatron's own reshard of its default ``dp_reshardable`` optimizer
  state) is the reference.

Every phase writes ``<work>/<phase>[-<format>].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

from tests.gpu.harness.megatron_tier import (
    all_same,
    build,
    flags,
    init_distributed,
    params_of,
    resident_state,
    streamed_state,
    train,
)

K = 6


def megatron_args(work: str, ckpt_format: str, save: str, extra: tuple[str, ...] = ()) -> argparse.Namespace:
    """Megatron's own parsed and validated arguments (its checkpoint code reads them globally)."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    dp = dist.get_world_size()
    argv = [
        "checkpoint_tier",
        *("--num-layers 4 --hidden-size 512 --ffn-hidden-size 2048 --num-attention-heads 8").split(),
        *("--seq-length 32 --max-position-embeddings 32 --micro-batch-size 4").split(),
        *f"--global-batch-size {4 * dp} --train-iters 100 --save-interval 1000 --lr 1e-3 --min-lr 1e-4".split(),
        *"--bf16 --use-distributed-optimizer --vocab-size 1024 --tokenizer-type NullTokenizer".split(),
        *"--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm".split(),
        *f"--save {save} --load {save} --ckpt-format {ckpt_format}".split(),
        *extra,
    ]
    saved_argv, sys.argv = sys.argv, argv
    try:
        args = parse_args()
    finally:
        sys.argv = saved_argv
    validate_args(args, {})
    set_global_variables(args, build_tokenizer=False)
    return args


def streamed(work: str, scratch: str, moment_dtype: str = "fp32", moe: bool = False):
    from miles_plugins.optimizers.nvme_stream import setup_optimizer_state_streaming

    ddp, opt, sched, baseline = build(moe, 1)
    bindings = setup_optimizer_state_streaming(flags(os.path.join(work, scratch), moment_dtype), opt)
    return ddp, opt, sched, baseline, bindings


def phase_reference(work: str, moe: bool) -> dict:
    from megatron.training.checkpointing import save_checkpoint

    megatron_args(work, "torch_dist", os.path.join(work, "ckpt_unstreamed"))
    ddp, opt, sched, baseline = build(moe, 1)
    first = train(ddp, opt, sched, baseline, K)
    save_checkpoint(K, [ddp], opt, sched, 0)
    second = train(ddp, opt, sched, baseline, K, start=K)
    torch.save(
        {"params": params_of(ddp), "state": resident_state(opt), "losses": first["losses"] + second["losses"]},
        os.path.join(work, f"reference-rank{dist.get_rank()}.pt"),
    )
    return {"losses": first["losses"] + second["losses"]}


def phase_save(work: str, ckpt_format: str) -> dict:
    from megatron.training.checkpointing import save_checkpoint

    megatron_args(work, ckpt_format, os.path.join(work, f"ckpt_{ckpt_format}"))
    ddp, opt, sched, baseline, bindings = streamed(work, "scratch_save")
    first = train(ddp, opt, sched, baseline, K)
    save_checkpoint(K, [ddp], opt, sched, 0)
    iteration_dir = os.path.join(work, f"ckpt_{ckpt_format}", f"iter_{K:07d}")
    return {"losses": first["losses"], "iteration_dir": sorted(os.listdir(iteration_dir))}


def phase_resume(work: str, ckpt_format: str) -> dict:
    from megatron.training.checkpointing import load_checkpoint

    megatron_args(work, ckpt_format, os.path.join(work, f"ckpt_{ckpt_format}"))
    ddp, opt, sched, baseline, bindings = streamed(work, "scratch_resume")
    iteration, _ = load_checkpoint([ddp], opt, sched)
    steps_after_load = [b.store.steps_taken for b in bindings]
    second = train(ddp, opt, sched, baseline, K, start=K)
    reference = torch.load(os.path.join(work, f"reference-rank{dist.get_rank()}.pt"))
    state = streamed_state(bindings)
    return {
        "iteration": iteration,
        "steps_after_load": steps_after_load,
        "losses_identical": second["losses"] == reference["losses"][K:],
        "losses": second["losses"],
        "reference_losses": reference["losses"][K:],
        "params_identical": all_same(params_of(ddp), reference["params"]),
        "mains_identical": all_same([s[0] for s in state], [s[0] for s in reference["state"]]),
        "moments_identical": len(state) == len(reference["state"])
        and all(all_same(s[1:], r[1:]) for s, r in zip(state, reference["state"], strict=True)),
    }


def _reshard_model(work: str, mode: str, moe: bool, scratch: str):
    # Megatron's default sharding of its own optimizer state (dp_reshardable) reshards across
    # DP. Not --dist-ckpt-optim-fully-reshardable: core 0.19.2 cannot load that into torch
    # Adam: KeyError 'step' in _set_main_param_and_optimizer_states.
    megatron_args(work, "torch_dist", os.path.join(work, f"reshard_{mode}"))
    if mode == "resident":
        return (*build(moe, 1), None)
    return streamed(work, scratch, moe=moe)


def _resident_load(ddp, opt, sched) -> int:
    """Megatron's own resident load (its reshard of dp_reshardable state), with three defects
    of core 0.19.2's torch-Adam fallback (used where apex and TE are absent) worked around;
    none touches the resharded mains or moments:

    1. ``DistributedOptimizer.state_dict`` asserts one step count over a state that a fresh
       torch Adam has not built yet: the state is built first by Megatron's own
       ``_init_optimizer_states_with_dummy_values`` (the load overwrites mains and moments).
    2. The per-param ``step`` the load leaves is the dummy step's: the saved count reaches
       only the param groups (``load_state_dict``), and the param-state load then copies the
       live step captured before the load back over it.
    3. ``load_state_dict`` hands every param one shared ``step`` tensor, which torch Adam's
       foreach update would advance once per param per step.

    So each param gets its group's saved count as a tensor of its own."""
    from megatron.training.checkpointing import load_checkpoint

    for member in opt.chained_optimizers:
        member._init_optimizer_states_with_dummy_values()
    iteration, _ = load_checkpoint([ddp], opt, sched)
    for member in opt.chained_optimizers:
        for group in member.optimizer.param_groups:
            assert group["step"] == iteration, (group["step"], iteration)  # the save's count
            for main in group["params"]:
                if "step" in member.optimizer.state[main]:  # empty shards have no state
                    member.optimizer.state[main]["step"] = torch.tensor(float(group["step"]))
    return iteration


def phase_reshard_save(work: str, mode: str, moe: bool) -> dict:
    """K steps at this world's DP size, resident or streamed, then save_checkpoint."""
    from megatron.training.checkpointing import save_checkpoint

    ddp, opt, sched, baseline, _ = _reshard_model(work, mode, moe, "scratch_reshard_save")
    first = train(ddp, opt, sched, baseline, K)
    save_checkpoint(K, [ddp], opt, sched, 0)
    return {"losses": first["losses"]}


def phase_reshard_resume(work: str, mode: str, moe: bool) -> dict:
    """load_checkpoint at this world's DP size (another than the save's), K more steps;
    each rank's params, mains, moments and losses go to reshard-<mode>-rank<r>.pt."""
    from megatron.training.checkpointing import load_checkpoint

    ddp, opt, sched, baseline, bindings = _reshard_model(work, mode, moe, "scratch_reshard_resume")
    if bindings is None:
        iteration = _resident_load(ddp, opt, sched)
    else:
        iteration, _ = load_checkpoint([ddp], opt, sched)
    second = train(ddp, opt, sched, baseline, K, start=K)
    state = resident_state(opt) if bindings is None else streamed_state(bindings)
    record = {"params": params_of(ddp), "state": state, "losses": second["losses"]}
    torch.save(record, os.path.join(work, f"reshard-{mode}-rank{dist.get_rank()}.pt"))
    return {"iteration": iteration, "losses": second["losses"]}


def refused(work: str, case: str, load_dir: str, moment_dtype: str = "fp32") -> str:
    """Build a streamed optimizer, load ``load_dir``; return the refusal's message."""
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.global_vars import get_args

    get_args().load = load_dir
    ddp, opt, sched, baseline, bindings = streamed(work, f"scratch_{case}", moment_dtype)
    try:
        load_checkpoint([ddp], opt, sched)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        for b in bindings:
            b.store.close()
    return "NOT REFUSED"


def fresh_without_optimizer_state(work: str) -> dict:
    """--no-load-optim on a checkpoint written without streaming: Megatron loads no
    optimizer state dict and rebuilds the mains from the loaded params; the load
    hook must say that Adam starts fresh, and training must go on from there."""
    import logging

    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.global_vars import get_args

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("miles_plugins.optimizers.megatron.binding").addHandler(handler)
    args = get_args()
    args.load, args.no_load_optim = os.path.join(work, "ckpt_unstreamed"), True
    ddp, opt, sched, baseline, bindings = streamed(work, "scratch_no_load_optim")
    try:
        iteration, _ = load_checkpoint([ddp], opt, sched)
        mains_are_params = all(
            all_same([main], [entry.param.detach().cpu().float()])
            for b in bindings
            for entry, main, _, _ in b.iter_state()
        )
        moments_fresh = all(m is None for b in bindings for _, _, m, _ in b.iter_state())
        steps_after_load = [b.store.steps_taken for b in bindings]
        after = train(ddp, opt, sched, baseline, 2, start=K)
    finally:
        for b in bindings:
            b.store.close()
        args.no_load_optim = False
        logging.getLogger("miles_plugins.optimizers.megatron.binding").removeHandler(handler)
    return {
        "iteration": iteration,
        "warned": [m for m in messages if "Adam starts fresh from the loaded params" in m],
        "mains_are_loaded_params": mains_are_params,
        "moments_fresh": moments_fresh,
        "steps_after_load": steps_after_load,
        "losses_after": after["losses"],
    }


def phase_refuse(work: str) -> dict:
    megatron_args(work, "torch_dist", os.path.join(work, "ckpt_torch_dist"))
    truncated = os.path.join(work, "ckpt_truncated")
    shutil.rmtree(truncated, ignore_errors=True)
    shutil.copytree(os.path.join(work, "ckpt_torch_dist"), truncated)
    bucket = os.path.join(truncated, f"iter_{K:07d}", "streamed_optimizer_state", "rank0.opt0", "bucket_00003.bin")
    os.truncate(bucket, os.path.getsize(bucket) - 4096)
    return {
        "moment_dtype": refused(work, "dtype", os.path.join(work, "ckpt_torch_dist"), "bf16"),
        "unstreamed": refused(work, "unstreamed", os.path.join(work, "ckpt_unstreamed")),
        "truncated": refused(work, "truncated", truncated),
        "no_load_optim": fresh_without_optimizer_state(work),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--phase", required=True, choices=["reference", "save", "resume", "refuse", "reshard-save", "reshard-resume"]
    )
    parser.add_argument("--work", required=True)
    parser.add_argument("--format", default="torch_dist", choices=["torch_dist", "torch"])
    parser.add_argument("--mode", default="streamed", choices=["resident", "streamed"], help="reshard phases")
    parser.add_argument("--moe", action="store_true", help="reference and reshard phases: a MoE GPT (EP=1)")
    args = parser.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.makedirs(args.work, exist_ok=True)
    init_distributed(1)
    torch.use_deterministic_algorithms(True)
    run = {
        "reference": lambda: phase_reference(args.work, args.moe),
        "save": lambda: phase_save(args.work, args.format),
        "resume": lambda: phase_resume(args.work, args.format),
        "refuse": lambda: phase_refuse(args.work),
        "reshard-save": lambda: phase_reshard_save(args.work, args.mode, args.moe),
        "reshard-resume": lambda: phase_reshard_resume(args.work, args.mode, args.moe),
    }[args.phase]
    result = run()
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, result)
    if dist.get_rank() == 0:
        suffix = f"-{args.format}" if args.phase in ("save", "resume") else ""
        suffix = f"-{args.mode}" if args.phase.startswith("reshard") else suffix
        with open(os.path.join(args.work, f"{args.phase}{suffix}.json"), "w") as f:
            json.dump(per_rank, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
