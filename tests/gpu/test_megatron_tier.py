"""GPU tier for the Megatron binding: a real GPT under DistributedOptimizer, resident vs streamed.

Each case launches ``tests/gpu/harness/megatron_tier.py`` under torchrun (a fresh process
group per case) and checks its JSON summary. Needs CUDA and megatron-core; the
two-GPU cases need two GPUs (``nvidia-h200-x2`` on the GPU machine).
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
STEPS = 12
# Compact moments (bf16, 8bit) are storage formats: the loss curve may move, within
# this much (relative, every step) of the fp32 run over STEPS steps.
COMPACT_LOSS_TOLERANCE = 2e-2


def _megatron_missing() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return True
    return False


# (GPUs, MoE, expert-parallel size). With EP=1 Megatron optimizes experts with the
# dense params; EP=2 gives the chain its expert DistributedOptimizer.
CASES = [
    pytest.param(1, False, 1, id="1gpu-dense"),
    pytest.param(1, True, 1, id="1gpu-moe"),
    pytest.param(2, False, 1, id="dp2-dense"),
    pytest.param(2, True, 2, id="dp2-moe-ep2"),
]


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    cache = {}

    def run(nproc: int, moe: bool, ep: int) -> dict:
        if (nproc, moe, ep) not in cache:
            out = tmp_path_factory.mktemp("tier") / "summary.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"]
            cmd += ["-m", "tests.gpu.harness.megatron_tier", "--out", str(out), "--steps", str(STEPS)]
            cmd += ["--dir", str(out.parent), "--ep", str(ep)] + (["--moe"] if moe else [])
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
            assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
            cache[(nproc, moe, ep)] = json.loads(out.read_text())
            print(json.dumps(cache[(nproc, moe, ep)], indent=1))
        return cache[(nproc, moe, ep)]

    return run


@pytest.mark.parametrize("nproc,moe,ep", CASES)
def test_streamed_megatron_training_is_byte_identical_to_resident(summaries, nproc, moe, ep):
    if _megatron_missing():
        pytest.skip("megatron-core is not installed (carry its wheel to the GPU machine)")
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs, this machine has {torch.cuda.device_count()}")
    summary = summaries(nproc, moe, ep)
    assert summary["world_size"] == nproc
    lrs = summary["ranks"][0]["lrs"]
    assert len(set(lrs)) > STEPS // 2, f"the LR schedule did not change the LR: {lrs}"
    for rank in summary["ranks"]:
        where = f"rank {rank['rank']}"
        assert rank["control_identical"], f"{where}: two resident runs differ; no comparison is meaningful"
        # Every member of the chain (dense, and expert with MoE) streamed, on every rank.
        assert rank["streamed_optimizers"] == rank["chain_length"] == rank["stores_attached"], where
        assert rank["chain_length"] == (2 if ep > 1 else 1), where
        for counter in rank["counters"]:
            assert counter["steps"] == STEPS and counter["bytes_read"] > 0, f"{where}: {counter}"
        assert rank["buckets"] > rank["chain_length"], f"{where}: expected several buckets per optimizer"
        assert rank["params_identical"] and rank["mains_identical"] and rank["moments_identical"], where
        assert rank["losses_identical"], where
        for accounted, largest in zip(
            rank["accounted_max_state_bytes_per_store"], rank["bucket_bytes_max_per_store"], strict=True
        ):
            assert accounted <= rank["buckets_in_flight"] * largest, where
        # Measured by the allocator: the step adds no more than the stores' stated bound
        # (buckets in flight, Adam's one-bucket temporary, the conversion scratch).
        assert rank["step_added_bytes_streamed"] <= rank["step_device_bytes_bound"], where
        assert not rank["state_dict_has_param_state"], where
        # Built for streaming, the optimizer allocated no fp32 mains (4 of the state's 12 bytes
        # per element; slack for the one param's main the build makes and drops at a time).
        mains_bytes = rank["state_bytes_total"] // 3
        saved_at_build = rank["optimizer_build_peak_resident"] - rank["optimizer_build_peak_streamed"]
        assert saved_at_build >= 0.9 * mains_bytes, (where, saved_at_build, mains_bytes)
        assert rank["reload_mains_from_params"] and rank["reload_kept_moments"], where
        for dtype, compact in rank["compact_moments"].items():
            assert compact["mains_differ"], f"{where}: {dtype} moments left no trace; was the dtype applied?"
            assert compact["max_rel_loss_diff"] <= COMPACT_LOSS_TOLERANCE, f"{where}, {dtype}"
            assert compact["step_added_bytes"] <= compact["step_device_bytes_bound"], f"{where}, {dtype}"
        eight_bit, bf16 = rank["compact_moments"]["8bit"], rank["compact_moments"]["bf16"]
        assert eight_bit["file_bytes_total"] < bf16["file_bytes_total"], f"{where}: 8bit stored no fewer bytes"
        # The step's GPU peak drops by at least the state minus the buckets in flight
        # (and a quarter of the state for slack: the resident step also has temporaries).
        saved = rank["step_peak_bytes_resident"] - rank["step_peak_bytes_streamed"]
        in_flight = rank["buckets_in_flight"] * rank["bucket_bytes_max"]
        assert saved >= 0.75 * rank["state_bytes_total"] - in_flight, where
        for name, variant in rank["variants"].items():
            assert variant["identical"], f"{where}: {name} is not byte-identical to the resident run"
            # Under an auto GPU budget the harness leaves the peak statistics alone (auto reads
            # them), so what a step adds is not measured there.
            if name != "auto_budgets":
                assert variant["step_added_bytes"] <= variant["step_device_bytes_bound"], f"{where}: {name}"
        # Overlap windows held state across the step boundary, within their bound.
        for name in ("overlap_host", "overlap_disk"):
            variant = rank["variants"][name]
            assert 0 < variant["carried_peak_bytes"] <= variant["overlap_bytes_bound"], f"{where}: {name}"
        # Budgets placed buckets in every home. The gpu home's stored bytes are allocated
        # before the step (so the added-bytes bound above holds without them) but count in
        # the step's peak: the saving is the one above less what the gpu home keeps.
        placed = rank["variants"]["gpu_host_disk"]
        assert min(placed["placement"].values()) >= 1, where
        saved_placed = rank["step_peak_bytes_resident"] - placed["step_peak_bytes"]
        assert saved_placed >= 0.75 * rank["state_bytes_total"] - in_flight - placed["gpu_home_bytes"], where
        assert placed["gpu_home_bytes"] > 0, where
        # auto: after the first step the device's peak left room, and buckets moved there (byte-identical
        # above, with the moves mid-run).
        assert rank["variants"]["auto_budgets"]["placement"]["gpu"] >= 1, where
        # Remainder mains read 2 bytes per main instead of 4.
        assert rank["variants"]["remainder_mains"]["bytes_read"] < rank["variants"]["sync_engine"]["bytes_read"], where
