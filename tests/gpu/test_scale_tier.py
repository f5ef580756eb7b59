"""Scale tier: Megatron-LM's own pretrain_gpt.py through the launcher, at sizes whose
optimizer state does not fit resident on one H200 (139.8 GiB), on a patched tree named by
$MEGATRON_LM_DIR. Each run goes through ``bench.pretrain_probe`` (losses, a params hash,
iteration and step seconds, the step's own device peak against ``step_device_bytes_bound``,
where the state lives); this process samples the host's MemAvailable while it runs.

GPT shape (as the scale issue measured it): hidden 5120, 40 heads, seq 1024, micro-batch 1,
global batch 8, ``--transformer-impl local``, mock data, Megatron's default two DataLoader
workers (forked after the optimizer is built). Layers set the size: 16 = 5.1B, 24 = 7.7B,
40 = 12.7B, 50 = 15.8B, 57 = 18.0B parameters (at 64, 20.2B, Megatron's DDP build, bf16
params + bf16 param buffer + fp32 grads = 8 bytes per param, runs out of device memory before the
optimizer exists).

Each case writes a JSON summary into $SCALE_TIER_RESULTS (when set) and prints one line.
The largest sizes are set by $SCALE_EXACT_LAYERS and $SCALE_8BIT_LAYERS.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.harness import HostSampler

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
TREE = os.environ.get("MEGATRON_LM_DIR")
HIDDEN = 5120
GPT = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 8192 --transformer-impl local "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
    f"--no-rope-fusion --no-persist-layer-norm --hidden-size {HIDDEN} --num-attention-heads 40 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 "
    "--lr-decay-style cosine --lr-warmup-iters 1 --lr-decay-iters 100 --bf16 --use-distributed-optimizer "
    "--log-interval 1 --eval-iters 0 --eval-interval 100000 --seed 1234 --ckpt-format torch_dist"
).split()
EXACT = ["--deterministic-mode"]  # for the byte-identity cases: same kernels every run
# Where activations, not the state, are what no longer fits (the largest sizes).
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
AUTO = ["--stream-optimizer-state-gpu-budget-gb", "auto", "--stream-optimizer-state-host-budget-gb", "auto"]
FORMATS = {
    "fp32": [],
    "exact10": ["--stream-optimizer-state-main-storage", "remainder"],  # 10 bytes/param stored, exact
    "8bit": ["--stream-optimizer-state-main-storage", "remainder", "--stream-optimizer-state-moment-dtype", "8bit"],
}
AUTO_HOST_MARGIN = 16 << 30  # config.DEFAULT_AUTO_HOST_MARGIN_BYTES, what auto leaves the node
RUN_TIMEOUT_S = 560

NEEDS_TREE = pytest.mark.skipif(
    not TREE or not torch.cuda.is_available(), reason="needs CUDA and MEGATRON_LM_DIR (a patched Megatron-LM tree)"
)


def _params(layers: int) -> float:
    """Parameters of the GPT shape above (12 h^2 per layer, embeddings and output untied)."""
    return layers * (12 * HIDDEN**2 + 13 * HIDDEN) + 2 * 8192 * HIDDEN + 1024 * HIDDEN


def _run(tmp: Path, name: str, layers: int, iters: int, *extra: str, hashing: bool = False) -> dict:
    record = tmp / f"{name}.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PRETRAIN_PROBE_OUT": str(record),
        "PRETRAIN_PROBE_HASH": "1" if hashing else "0",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "NCCL_ALGO": "Ring",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone"]
    cmd += ["-m", "bench.pretrain_probe", "pretrain_gpt.py", *GPT, "--num-layers", str(layers)]
    cmd += ["--train-iters", str(iters), *extra]
    start = time.perf_counter()
    with HostSampler() as host:
        proc = subprocess.run(cmd, cwd=TREE, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    iterations = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    summary = {
        "name": name,
        "layers": layers,
        "params_billion": round(_params(layers) / 1e9, 2),
        "returncode": proc.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
        "mem_available_start_gb": round(host.samples[0] / 1e9, 1),
        "mem_available_min_gb": round(min(host.samples) / 1e9, 1),
        "iterations": iterations,
        "log_lines": [
            line
            for line in log.splitlines()
            if "auto host budget" in line
            or "auto GPU budget" in line
            or "one slot" in line
            or "streaming on for" in line
            or "OutOfMemoryError" in line
            or "CUDA out of memory" in line
        ][:20],
        "log_tail": log[-3000:] if proc.returncode else "",
    }
    results = os.environ.get("SCALE_TIER_RESULTS")
    if results:
        Path(results).mkdir(parents=True, exist_ok=True)
        (Path(results) / f"{name}.json").write_text(json.dumps(summary, indent=1))
    seconds = [round(i["seconds"], 2) for i in iterations]
    print(
        f"\n[scale] {name}: {summary['params_billion']}B rc={proc.returncode} wall={summary['wall_s']}s "
        f"s/iter={seconds} MemAvailable min {summary['mem_available_min_gb']} GB "
        f"placement={iterations[-1].get('placement') if iterations else None}",
        file=sys.stderr,
    )
    return summary


def _loss(record: dict) -> float:
    return float.fromhex(record["losses"]["lm loss"])


def _check_streamed_run(summary: dict, iters: int) -> None:
    """What every streamed scale run must show: it trained, the loss fell, the host kept the
    auto margin, and each measured step stayed within the stores' stated bound."""
    iterations = summary["iterations"]
    assert summary["returncode"] == 0 and len(iterations) == iters, summary["log_tail"]
    assert _loss(iterations[-1]) < _loss(iterations[0]), [_loss(i) for i in iterations]
    # The margin is what auto leaves to the rest of the node; Megatron's DataLoader workers
    # (forked after setup) and the process's own growth take part of it: at least half stays.
    assert summary["mem_available_min_gb"] * 1e9 >= AUTO_HOST_MARGIN / 2, summary["mem_available_min_gb"]
    measured = [i for i in iterations if i.get("step_added_bytes") is not None]
    assert measured, "no step's peak was measured"
    for i in measured:
        assert i["step_added_bytes"] <= i["step_device_bytes_bound"], i


@NEEDS_TREE
def test_7b_resident_runs_out_of_device_memory(tmp_path):
    """The point of the tier: without streaming this GPT does not train on one H200."""
    summary = _run(tmp_path, "7b-resident", 24, 2)
    assert summary["returncode"] != 0 and not summary["iterations"]
    assert any("out of memory" in line.lower() or "OutOfMemoryError" in line for line in summary["log_lines"])


@NEEDS_TREE
def test_7b_streamed_auto_fp32_trains_within_its_bounds(tmp_path):
    stream = ["--stream-optimizer-state-to-disk", "--offload-train-disk-dir", str(tmp_path / "nvme"), *AUTO]
    _check_streamed_run(_run(tmp_path, "7b-auto-fp32", 24, 6, *stream), 6)


@NEEDS_TREE
def test_7b_streamed_auto_8bit_trains_and_resumes_byte_identical(tmp_path):
    stream = ["--stream-optimizer-state-to-disk", "--offload-train-disk-dir", str(tmp_path / "nvme"), *AUTO]
    stream += FORMATS["8bit"]
    ckpt = tmp_path / "ckpt"
    try:
        whole = _run(tmp_path, "7b-auto-8bit", 24, 6, *stream, *EXACT, hashing=True)
        _check_streamed_run(whole, 6)
        first = _run(
            tmp_path,
            "7b-auto-8bit-first",
            24,
            6,
            "--exit-interval",
            "3",
            "--save-interval",
            "3",
            "--save",
            str(ckpt),
            *stream,
            *EXACT,
        )
        assert first["returncode"] == 0 and len(first["iterations"]) == 3, first["log_tail"]
        resumed = _run(tmp_path, "7b-auto-8bit-resumed", 24, 6, "--load", str(ckpt), *stream, *EXACT, hashing=True)
        assert resumed["returncode"] == 0 and len(resumed["iterations"]) == 3, resumed["log_tail"]
        assert [(r["losses"], r["params"]) for r in resumed["iterations"]] == [
            (w["losses"], w["params"]) for w in whole["iterations"][3:]
        ]
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)  # 46 GB: the next case needs the disk


@NEEDS_TREE
def test_5b_streamed_auto_is_byte_identical_to_resident(tmp_path):
    """The largest size where resident still fits: every iteration's loss and params hash."""
    stream = ["--stream-optimizer-state-to-disk", "--offload-train-disk-dir", str(tmp_path / "nvme"), *AUTO]
    resident = _run(tmp_path, "5b-resident", 16, 6, *EXACT, hashing=True)
    streamed = _run(tmp_path, "5b-auto-fp32", 16, 6, *stream, *EXACT, hashing=True)
    assert resident["returncode"] == 0 and len(resident["iterations"]) == 6, resident["log_tail"]
    _check_streamed_run(streamed, 6)
    assert [(r["losses"], r["params"]) for r in resident["iterations"]] == [
        (s["losses"], s["params"]) for s in streamed["iterations"]
    ]


@NEEDS_TREE
@pytest.mark.parametrize("storage", ["exact10", "8bit"])
def test_the_largest_gpt_trains_streamed(tmp_path, storage):
    """The largest size found per mode: remainder mains with fp32 moments (exact, 10 bytes per
    param stored) and with 8-bit moments (about 4), activations recomputed."""
    layers = int(os.environ.get("SCALE_EXACT_LAYERS" if storage == "exact10" else "SCALE_8BIT_LAYERS", 0))
    layers = layers or (50 if storage == "exact10" else 57)
    stream = ["--stream-optimizer-state-to-disk", "--offload-train-disk-dir", str(tmp_path / "nvme"), *AUTO]
    stream += [*FORMATS[storage], *RECOMPUTE]
    summary = _run(tmp_path, f"largest-{storage}-{layers}l", layers, 4, *stream)
    _check_streamed_run(summary, 4)
