"""`make bench`'s placement points, run small on the CPU: the modes exist, place what they
say and report the fields the plot and the targets read. (Speed is the GPU machine's
business: nothing here is timed.)"""

import json

import pytest
import torch

from bench import megatron_dev, optimizer_step


def test_placement_points_place_their_fraction_and_report_it(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--params", "400000", "--steps", "1", "--regimes", "roomy", "--modes", "pipelined-fp32"]
    argv += ["--host-fractions", "0,50,100", "--gpu-fractions", "50", "--offload-fractions", "0,50,100"]
    argv += ["--dir", str(tmp_path / "state")]
    assert optimizer_step.main([*argv, "--out", str(out)]) == 0
    # Each measurement says what it measured as it lands (a run cut short keeps its lines and its file).
    lines = capsys.readouterr().out.splitlines()
    landed = [b for a, b in zip(lines, lines[1:], strict=False) if a.startswith("[roomy] placed@host50 ")]
    assert landed and landed[0].strip().startswith("steps "), lines
    # The table's last column: buckets per home (gpu+host+disk) as the run left them.
    assert any(" placed@host0 " in line and line.endswith(" 0+0+16") for line in lines), lines
    results = json.loads(out.read_text())["regimes"]["roomy"]
    assert results["placed@host0"]["placement"] == {"gpu": 0, "host": 0, "disk": 16}
    assert results["placed@host100"]["placement"]["host"] == results["placed@host100"]["buckets"]
    for mode, home in (("placed@host50", "host"), ("placed@gpu50", "gpu")):
        fraction = results[mode][f"{home}_fraction"]
        assert 0.3 < fraction <= 0.5, (mode, fraction)  # bucket granularity: at most the budget
        assert results[mode]["disk_bound_seconds"] > 0
    # The peers' split: P% in host memory, the rest on the GPU, none on disk.
    assert results["placed@offload0"]["placement"]["gpu"] == results["placed@offload0"]["buckets"]
    assert results["placed@offload100"]["placement"]["host"] == results["placed@offload100"]["buckets"]
    half = results["placed@offload50"]
    assert half["placement"]["disk"] == 0 and 0.3 < half["host_fraction"] < 0.7, half["placement"]
    # Megatron's partial offloads sit beside them (skipped here: they need a GPU). Dev's chunked
    # offload has a point at every fraction (0 is its full disable), HybridDeviceOptimizer above 0.
    assert results["megatron-cpu-offload@50"]["skipped"] == "needs a GPU"
    assert "megatron-cpu-offload@0" not in results
    for percent in (0, 50, 100):
        assert results[f"megatron-dev-chunked@{percent}"] == {
            "mode": f"megatron-dev-chunked@{percent}",
            "skipped": "needs a GPU",
        }


def test_dev_chunked_points_say_why_a_checkout_cannot_serve_them(tmp_path, monkeypatch):
    gpu = torch.device("cuda")  # a device name only: nothing touches a GPU
    mode = "megatron-dev-chunked@50"
    monkeypatch.delenv(megatron_dev.DEV_DIR_ENV, raising=False)
    assert megatron_dev.DEV_DIR_ENV in optimizer_step._available(mode, gpu)
    monkeypatch.setenv(megatron_dev.DEV_DIR_ENV, str(tmp_path))
    assert "not a Megatron-LM checkout" in optimizer_step._available(mode, gpu)
    config = tmp_path / megatron_dev.DEV_CONFIG_FILE
    config.parent.mkdir(parents=True)
    config.write_text("class OptimizerConfig:\n    optimizer_cpu_offload: bool = False\n")
    assert "lacks chunked optimizer-state offload" in optimizer_step._available(mode, gpu)
    config.write_text("class OptimizerConfig:\n    chunked_optimizer_state_offload: bool = False\n")
    offloader = tmp_path / megatron_dev.DEV_OFFLOADER_FILE
    offloader.parent.mkdir()
    offloader.write_text("")
    assert optimizer_step._available(mode, gpu) is None
    # What it pins on purpose raises a constrained cgroup: fp32 main and moments of its fraction.
    assert optimizer_step._pinned_bytes(mode, 1000, 100) == int(0.5 * 12 * 1000 * 1.05)
    assert optimizer_step._pinned_bytes("megatron-dev-chunked@0", 1000, 100) == 0
    # Ours at the peers' split: host memory takes what the gpu budget leaves, up to a bucket more.
    assert optimizer_step._pinned_bytes("placed@offload25", 1000, 100) == int(0.25 * 12 * 1000 * 1.05) + 1200


def test_auto_modes_measure_their_budgets_and_record_where_buckets_were(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--params", "400000", "--steps", "3", "--regimes", "roomy", "--modes", "pipelined-fp32", "--auto"]
    argv += ["--auto-host-margin-gib", "0", "--dir", str(tmp_path / "state"), "--out", str(out)]
    assert optimizer_step.main(argv) == 0
    results = json.loads(out.read_text())["regimes"]["roomy"]
    for mode in ("auto", "auto-growing"):
        r = results[mode]
        assert "step_seconds" in r, r
        # The host budget came from this machine's available memory: the small state fits there.
        assert r["placement"] == {"gpu": 0, "host": r["buckets"], "disk": 0}, r
        # One record before the warm-up step and one before each timed step; on the CPU
        # nothing moves to the device home.
        assert len(r["placement_before_each_step"]) == 4 and r["placement_after"]["gpu"] == 0


def test_bad_paths_are_refused_with_a_reason(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    for argv, reason in (
        (["--dir", str(a_file)], f"--dir {a_file} is not a directory"),
        (["--dir", f"{tmp_path}/a,{tmp_path}/b"], "one directory (the bound is one drive's"),
        (["--plot", str(tmp_path / "none.json")], "no such results file"),
    ):
        with pytest.raises(SystemExit) as exit_:
            optimizer_step.main(["--params", "1000", *argv])
        assert exit_.value.code == 2 and reason in capsys.readouterr().err
