"""GPU tier: Megatron-LM's own pretrain_gpt.py,
resident against streamed through the launcher, on a patched tree named by $MEGATRON_LM_DIR.

Each run goes through ``bench.pretrain_probe`` (records every iteration's losses and a
params hash). Cases per data-parallel size (1 and 2 GPUs):
- resident vs streamed, 12 iterations: every iteration byte-identical;
- streamed 6 iterations (--exit-interval 6, same schedule), then resumed to 12 from its
  torch_dist checkpoint: iterations 7-12 byte-identical to the uninterrupted streamed run;
- --no-load-optim from the resident checkpoint (written without streaming): the warning, and it trains on.
And at DP=2 the legacy --ckpt-step quirk: with --ckpt-format torch Megatron counts from the latest
checkpointed iteration while the params and the streamed state come from --ckpt-step's; the run refuses
and names both iterations.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
TREE = os.environ.get("MEGATRON_LM_DIR")
COMMON = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 8192 --transformer-impl local "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
    "--no-rope-fusion --no-persist-layer-norm --deterministic-mode --num-layers 4 --hidden-size 512 "
    "--num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 --micro-batch-size 4 "
    "--global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --lr-decay-iters 12 "
    "--bf16 --use-distributed-optimizer --log-interval 1 --eval-iters 0 --eval-interval 1000 --seed 1234 "
    "--ckpt-format torch_dist --save-interval 6 --train-iters 12"
).split()


def _run(tmp: Path, name: str, nproc: int, *extra: str, ok: bool = True) -> tuple[list[dict], str]:
    record = tmp / f"{name}.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PRETRAIN_PROBE_OUT": str(record),
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "NCCL_ALGO": "Ring",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"]
    cmd += ["-m", "bench.pretrain_probe", "pretrain_gpt.py", *COMMON, *extra]
    proc = subprocess.run(cmd, cwd=TREE, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, log[-6000:]
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else [], log


NEEDS_TREE = pytest.mark.skipif(
    not TREE, reason="set MEGATRON_LM_DIR to a patched Megatron-LM tree holding pretrain_gpt.py"
)


def _stream_flags(tmp_path: Path, nproc: int) -> list[str]:
    """The streaming flags of a run under ``tmp_path``; skips without ``nproc`` GPUs."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    return ["--stream-optimizer-state-to-disk", "--offload-train-disk-dir", str(tmp_path / "nvme")]


@NEEDS_TREE
@pytest.mark.parametrize("nproc", [1, 2])
def test_pretrain_gpt_streamed_through_the_launcher_is_byte_identical(tmp_path, nproc):
    stream = _stream_flags(tmp_path, nproc)
    resident, _ = _run(tmp_path, "resident", nproc, "--save", str(tmp_path / "ckpt_resident"))
    streamed, log = _run(tmp_path, "streamed", nproc, *stream)
    assert "optimizer-state streaming on" in log
    assert len(resident) == len(streamed) == 12
    assert [(r["losses"], r["params"]) for r in resident] == [(s["losses"], s["params"]) for s in streamed]

    first, _ = _run(tmp_path, "first", nproc, "--exit-interval", "6", "--save", str(tmp_path / "ckpt6"), *stream)
    resumed, _ = _run(tmp_path, "resumed", nproc, "--load", str(tmp_path / "ckpt6"), *stream)
    assert [(r["losses"], r["params"]) for r in first + resumed] == [(s["losses"], s["params"]) for s in streamed]

    fresh, log = _run(
        tmp_path,
        "fresh",
        nproc,
        "--load",
        str(tmp_path / "ckpt_resident"),
        "--no-load-optim",
        "--train-iters",
        "14",
        *stream,
    )
    assert "the optimizer state is not loaded from this checkpoint" in log
    assert len(fresh) == 2


@NEEDS_TREE
@pytest.mark.parametrize("nproc", [1, 2])
def test_legacy_ckpt_step_that_megatron_does_not_count_from_is_refused(tmp_path, nproc):
    stream = _stream_flags(tmp_path, nproc)
    legacy = ["--ckpt-format", "torch", "--save-interval", "3"]
    saved, _ = _run(
        tmp_path, "saved", nproc, "--exit-interval", "6", "--save", str(tmp_path / "ckpt"), *legacy, *stream
    )
    assert len(saved) == 6
    load = ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "3"]
    resumed, log = _run(tmp_path, "resumed", nproc, *load, *legacy, *stream, ok=False)
    assert resumed == []
    assert "loaded from iteration 3" in log and "continues from iteration 6" in log, log[-6000:]
