"""Whole iterations of Megatron-LM's own ``pretrain_gpt.py`` on one GPU: every placement of
the optimizer state side by side, and Megatron dev's chunked optimizer-state offload beside
them (issue 26's measurement).

    MEGATRON_LM_DIR=/patched/Megatron-LM [MEGATRON_DEV_DIR=/Megatron-LM-dev] \\
        python -m bench.iteration [--modes resident,auto,host,...] [--dev-fractions 0.25,1] \\
        [--iters 6] [--disk-dir /nvme/bench] [--out bench-results/iteration.json] [--plot]

The GPT of issue 26: 20 layers, hidden 2048, 16 heads, seq 2048, micro-batch 4, global
batch 32, ``--transformer-impl local``, mock data, bf16, the distributed optimizer: 1.15B
params, 13.7 GB of fp32 optimizer state. Ours run through the GPU tier's harness
(``tests.gpu.pretrain_probe``: each iteration's step seconds and where the state lives) and
the launcher; dev's run its own ``pretrain_gpt.py`` from ``$MEGATRON_DEV_DIR`` with
``--chunked-optimizer-state-offload --optimizer-state-offload-fraction F`` (chunks of
``bench.megatron_dev.DEV_CHUNK_MB``). Every run is timed the same way, from Megatron's own
log: ``elapsed time per iteration (ms)`` (the median after the first iteration), and the
``max reserved`` device memory it reports after the first iteration (MB; for ours the
probe's peak over the whole run too).

Per run the report gives s/iter, its ratio to resident's, and, for ours, the step's seconds
and the share of the state's transfers hidden behind forward/backward: the step's time
beyond resident's step is what the transfers cost inside the step; what the iteration grew
beyond resident's is what they cost the iteration; hidden = 1 - grown / step beyond
(0 while every transfer sits inside ``optimizer.step()``). The runs go one after another in
one process (ratios from one call); a run that fails is reported with its log's tail.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import megatron_dev

REPO = Path(__file__).resolve().parents[1]
GPT = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 32768 --transformer-impl local "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
    "--no-rope-fusion --no-persist-layer-norm --num-layers 20 --hidden-size 2048 --num-attention-heads 16 "
    "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 32 --lr 3e-4 "
    "--min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 1 --lr-decay-iters 100 --bf16 "
    "--use-distributed-optimizer --log-interval 1 --eval-iters 0 --eval-interval 100000 --seed 1234 "
    "--ckpt-format torch_dist"
).split()
STREAM = ["--stream-optimizer-state-to-disk"]
# Our placements (flags after the disk directory's). "gpu+host": half the state's stored
# bytes (13.7 GB fp32) in the gpu home, the rest in host memory.
MODES = {
    "resident": [],
    "auto": [
        *STREAM,
        "--stream-optimizer-state-gpu-budget-gb",
        "auto",
        "--stream-optimizer-state-host-budget-gb",
        "auto",
    ],
    "host": [*STREAM, "--stream-optimizer-state-tier", "host"],
    "gpu+host": [*STREAM, "--stream-optimizer-state-tier", "host", "--stream-optimizer-state-gpu-budget-gb", "6.4"],
    "disk": [*STREAM, "--stream-optimizer-state-tier", "disk"],
    "disk-8bit": [
        *STREAM,
        "--stream-optimizer-state-tier",
        "disk",
        "--stream-optimizer-state-main-storage",
        "remainder",
        "--stream-optimizer-state-moment-dtype",
        "8bit",
    ],
}
RUN_TIMEOUT_S = 900
ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
MAX_RESERVED = re.compile(r"max reserved: ([0-9.]+)")


def dev_flags(fraction: float) -> list[str]:
    """Megatron dev's chunked optimizer-state offload of ``fraction`` of the state (dev d48bd6be)."""
    return [
        "--chunked-optimizer-state-offload",
        "--optimizer-state-offload-fraction",
        str(fraction),
        "--optimizer-state-offload-chunk-size-mb",
        str(megatron_dev.DEV_CHUNK_MB),
    ]


def timings_from_log(log: str) -> dict:
    """Seconds of every iteration Megatron logged, and its first ``max reserved`` (MB)."""
    seconds = [float(ms) / 1e3 for ms in ELAPSED.findall(log)]
    reserved = MAX_RESERVED.search(log)
    return {"seconds": seconds, "max_reserved_mb_first_iteration": float(reserved.group(1)) if reserved else None}


def summarize(runs: dict[str, dict]) -> dict[str, dict]:
    """Per run: s/iter (median after the first), x resident, and for ours the step's seconds
    and the share of its transfers hidden (module docstring)."""
    out: dict[str, dict] = {}
    for name, run in runs.items():
        seconds = run["seconds"][1:]
        steps = [r["step_seconds"] for r in run.get("probe", [])[1:]]
        out[name] = {
            "ok": run["returncode"] == 0 and bool(seconds),
            "s_per_iter": statistics.median(seconds) if seconds else None,
            "step_s": statistics.median(steps) if steps else None,
            "max_reserved_mb_first_iteration": run["max_reserved_mb_first_iteration"],
            "max_reserved_mb": round(run["probe"][-1]["max_reserved_bytes"] / 2**20) if run.get("probe") else None,
            "placement": run["probe"][-1].get("placement") if run.get("probe") else None,
        }
    base = out.get("resident", {})
    for row in out.values():
        if not (row["ok"] and base.get("ok")):
            continue
        row["x_resident"] = round(row["s_per_iter"] / base["s_per_iter"], 3)
        if row["step_s"] is not None and base["step_s"] is not None:
            in_step = row["step_s"] - base["step_s"]
            grown = row["s_per_iter"] - base["s_per_iter"]
            row["hidden"] = round(min(1.0, max(0.0, 1 - grown / in_step)), 3) if in_step > 0 else None
    return out


def _run(name: str, cmd: list[str], cwd: str, env: dict, probe_out: Path | None) -> dict:
    print(f"[iteration] {name}: {' '.join(cmd[-12:])}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        returncode, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as timeout:
        returncode, log = -1, f"timed out after {RUN_TIMEOUT_S} s\n{timeout.stdout or ''}{timeout.stderr or ''}"
    run = {"returncode": returncode, **timings_from_log(log)}
    if probe_out is not None and probe_out.exists():
        run["probe"] = [json.loads(line) for line in probe_out.read_text().splitlines()]
    if returncode != 0:
        run["log_tail"] = log[-3000:]
    print(f"[iteration] {name}: rc={returncode} s/iter={[round(s, 2) for s in run['seconds']]}", file=sys.stderr)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument("--dev-fractions", default="0.25,0.5,0.75,1.0", help="dev's offload fractions ('' for none)")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--disk-dir", default=None, help="our disk tier's directory (a temporary one if not given)")
    parser.add_argument("--out", default="bench-results/iteration.json")
    parser.add_argument("--plot", action="store_true", help="also write the runs' s/iter as a PNG beside --out")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"bench.iteration: unknown modes {unknown}; known: {', '.join(MODES)}")
    tree = os.environ.get("MEGATRON_LM_DIR")
    if not tree or not os.path.isfile(os.path.join(tree, "pretrain_gpt.py")):
        raise SystemExit("bench.iteration: needs MEGATRON_LM_DIR, a patched Megatron-LM tree holding pretrain_gpt.py")
    fractions = [float(f) for f in args.dev_fractions.split(",") if f]
    missing = megatron_dev.checkout_missing() if fractions else None
    if missing:
        raise SystemExit(f"bench.iteration: {missing} (or --dev-fractions '')")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone"]
    common = [*GPT, "--train-iters", str(args.iters)]
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-iteration-") as tmp:
        disk = args.disk_dir or os.path.join(tmp, "nvme")
        for mode in modes:
            probe_out = Path(tmp) / f"{mode}.jsonl"
            env = {**os.environ, "PYTHONPATH": str(REPO), "PRETRAIN_PROBE_OUT": str(probe_out)}
            env["PRETRAIN_PROBE_HASH"] = "0"
            flags = ["--offload-train-disk-dir", disk, *MODES[mode]] if MODES[mode] else []
            cmd = [*torchrun, "-m", "tests.gpu.pretrain_probe", "pretrain_gpt.py", *common, *flags]
            runs[mode] = _run(mode, cmd, tree, env, probe_out)
        dev = os.environ.get(megatron_dev.DEV_DIR_ENV, "")
        for fraction in fractions:
            cmd = [*torchrun, "pretrain_gpt.py", *common, *dev_flags(fraction)]
            runs[f"megatron-dev-chunked@{fraction:g}"] = _run(
                f"megatron-dev-chunked@{fraction:g}", cmd, dev, {**os.environ, "PYTHONPATH": dev}, None
            )
    report = {"gpt": " ".join(GPT), "iters": args.iters, "summary": summarize(runs), "runs": runs}
    print(json.dumps(report["summary"], indent=1))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    if args.plot:
        _plot(report["summary"], os.path.splitext(args.out)[0] + ".png")


def _plot(summary: dict, path: str) -> None:
    from bench.plotting import pyplot

    plt = pyplot()
    names = [n for n, row in summary.items() if row["ok"]]
    fig, ax = plt.subplots(figsize=(max(6, len(names)), 4))
    ax.bar(names, [summary[n]["s_per_iter"] for n in names])
    ax.set_ylabel("s / iteration (median after the first)")
    ax.set_title("pretrain_gpt.py, 1.15B GPT, one GPU")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
