"""GPU tier for the checkpoint hooks: save through Megatron's save_checkpoint, resume in a
new process through load_checkpoint, byte-identical to an uninterrupted run; and the
loads that must be refused.

Needs CUDA, and a Megatron whose megatron/training carries the patch series
(``make apply-patches MEGATRON_DIR=...``; for a carried wheel, its site dir).
The resumes at another data-parallel size need two GPUs.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        import megatron.training.checkpointing  # noqa: F401
    except ImportError as exc:
        return f"needs megatron.training (a Megatron-LM tree or megatron-core >= 0.17): {exc}"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from megatron_hooks.checkpoint import check_patched

    check_patched()  # fail, not skip: this tier exists to test the patched tree
    return tmp_path_factory.mktemp("ckpt_tier")


def phase(work: Path, name: str, nproc: int = 1, ckpt_format: str = "torch_dist", *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"]
    cmd += ["-m", "tests.gpu.harness.checkpoint_tier", "--phase", name, "--work", str(work)]
    cmd += ["--format", ckpt_format, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"phase {name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    suffix = f"-{ckpt_format}" if name in ("save", "resume") else ""
    suffix = f"-{extra[extra.index('--mode') + 1]}" if name.startswith("reshard") else suffix
    result = json.loads((work / f"{name}{suffix}.json").read_text())
    print(name, ckpt_format, json.dumps(result, indent=1))
    return result


@pytest.fixture(scope="module")
def reference(work):
    return phase(work, "reference")


@pytest.fixture(scope="module")
def saved(work, reference):
    """A streamed torch_dist checkpoint at step 6 (the resume and the refusals load it)."""
    return phase(work, "save")


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_save_then_resume_in_a_new_process_is_byte_identical(work, saved, ckpt_format):
    (result,) = saved if ckpt_format == "torch_dist" else phase(work, "save", ckpt_format=ckpt_format)
    assert "streamed_optimizer_state" in result["iteration_dir"]
    (resumed,) = phase(work, "resume", ckpt_format=ckpt_format)
    assert resumed["iteration"] == 6 and resumed["steps_after_load"] == [6]
    assert resumed["losses_identical"], (resumed["losses"], resumed["reference_losses"])
    assert resumed["params_identical"] and resumed["mains_identical"] and resumed["moments_identical"]


def test_loads_that_do_not_match_are_refused_with_their_reason(work, saved):
    (refusals,) = phase(work, "refuse")
    assert "moment dtype differs" in refusals["moment_dtype"]
    assert "written without optimizer-state streaming" in refusals["unstreamed"]
    assert "bucket_00003.bin has" in refusals["truncated"] and "truncated" in refusals["truncated"]
    # --no-load-optim on a checkpoint written without streaming: fresh Adam, said so, and it trains.
    fresh = refusals["no_load_optim"]
    assert fresh["iteration"] == 6 and fresh["steps_after_load"] == [0] and fresh["warned"], fresh
    assert fresh["mains_are_loaded_params"] and fresh["moments_fresh"], fresh
    assert len(fresh["losses_after"]) == 2 and all(loss == loss for loss in fresh["losses_after"]), fresh


def test_the_resident_reference_resumes_as_if_never_stopped(work, reference, tmp_path):
    """The two-GPU test's reference, trusted only if it is right where the answer is known:
    Megatron's resident save and load (with checkpoint_tier._resident_load's workarounds)
    at DP=1, then K steps, byte-identical to the uninterrupted resident run."""
    from tests.gpu.harness.megatron_tier import all_same

    phase(tmp_path, "reshard-save", 1, "torch_dist", "--mode", "resident")
    phase(tmp_path, "reshard-resume", 1, "torch_dist", "--mode", "resident")
    got, want = torch.load(tmp_path / "reshard-resident-rank0.pt"), torch.load(work / "reference-rank0.pt")
    assert got["losses"] == want["losses"][-len(got["losses"]) :]
    assert all_same(got["params"], want["params"])
    for mine, theirs in zip(got["state"], want["state"], strict=True):
        assert all_same(mine, theirs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("saved_dp, resumed_dp", [(2, 1), (1, 2)])
def test_a_streamed_checkpoint_resumes_at_another_dp_size_as_megatrons_own_does(tmp_path, saved_dp, resumed_dp, moe):
    """Megatron's own resume at the new DP size (resident, its default dp_reshardable torch_dist)
    is the reference: K steps after it, every rank's params, mains, moments and losses
    are byte-identical. (Not --dist-ckpt-optim-fully-reshardable: core 0.19.2 cannot load that
    into torch Adam, KeyError 'step'; checkpoint_tier._resident_load says what the reference
    works around where apex and TE are absent.)"""
    from tests.gpu.harness.megatron_tier import all_same

    for mode in ("resident", "streamed"):
        extra = ("--mode", mode, *(("--moe",) if moe else ()))
        phase(tmp_path, "reshard-save", saved_dp, "torch_dist", *extra)
        phase(tmp_path, "reshard-resume", resumed_dp, "torch_dist", *extra)
    for rank in range(resumed_dp):
        reference = torch.load(tmp_path / f"reshard-resident-rank{rank}.pt")
        streamed = torch.load(tmp_path / f"reshard-streamed-rank{rank}.pt")
        assert streamed["losses"] == reference["losses"], rank
        assert all_same(streamed["params"], reference["params"]), rank
        assert len(streamed["state"]) == len(reference["state"]), rank
        for got, want in zip(streamed["state"], reference["state"], strict=True):
            assert all_same(got, want), rank


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_state_rewritten_offline_for_dp2_resumes_at_dp1_as_if_never_stopped(work, reference, tmp_path, moe):
    """What one GPU can show of resharding: a streamed save at DP=1 is rewritten by
    ``ckpt reshard --dp 2`` (two new ranks' stores cut from real Megatron buckets and
    padding) and resumed at DP=1, so the load reshards it 2 -> 1. The reference is the
    uninterrupted resident run: K steps after the resume, params, mains, moments and
    losses are byte-identical to it. (That the rewritten DP=2 layout is the one a live
    DP=2 run builds is shown on the CPU by test_reshard_load, and by the two-GPU test.)"""
    from tests.gpu.harness.megatron_tier import all_same

    extra = ("--mode", "streamed", *(("--moe",) if moe else ()))
    if moe:
        phase(tmp_path, "reference", 1, "torch_dist", "--moe")
        want = torch.load(tmp_path / "reference-rank0.pt")
    else:
        want = torch.load(work / "reference-rank0.pt")
    phase(tmp_path, "reshard-save", 1, "torch_dist", *extra)
    saved, rewritten = tmp_path / "reshard_streamed", tmp_path / "rewritten"
    shutil.copytree(saved, rewritten, ignore=shutil.ignore_patterns("streamed_optimizer_state"))
    iteration = "iter_0000006"
    command = [sys.executable, "-m", "miles_plugins.optimizers.ckpt", "reshard", str(saved / iteration)]
    command += ["--dp", "2", "--out", str(rewritten / iteration)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    stores = sorted(os.listdir(rewritten / iteration / "streamed_optimizer_state"))
    assert [s for s in stores if s.startswith("rank1.")], stores  # the load below has a peer to read
    saved.rename(tmp_path / "saved_at_dp1")
    rewritten.rename(saved)
    phase(tmp_path, "reshard-resume", 1, "torch_dist", *extra)
    got = torch.load(tmp_path / "reshard-streamed-rank0.pt")
    assert got["losses"] == want["losses"][-len(got["losses"]) :]
    assert all_same(got["params"], want["params"])
    assert len(got["state"]) == len(want["state"])
    for mine, theirs in zip(got["state"], want["state"], strict=True):
        assert all_same(mine, theirs)
