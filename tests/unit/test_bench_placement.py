"""`make bench`'s placement points, run small on the CPU: the modes exist, place what they
say and report the fields the plot and the targets read. (Speed is the GPU machine's
business: nothing here is timed.)"""

import json

from bench import optimizer_step


def test_placement_points_place_their_fraction_and_report_it(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--params", "400000", "--steps", "1", "--regimes", "roomy", "--modes", "pipelined-fp32"]
    argv += ["--host-fractions", "0,50,100", "--gpu-fractions", "50", "--dir", str(tmp_path / "state")]
    assert optimizer_step.main([*argv, "--out", str(out)]) == 0
    # Each measurement says what it measured as it lands (a run cut short keeps its lines and its file).
    lines = capsys.readouterr().out.splitlines()
    landed = [b for a, b in zip(lines, lines[1:], strict=False) if a.startswith("[roomy] placed@host50 ")]
    assert landed and landed[0].strip().startswith("steps "), lines
    results = json.loads(out.read_text())["regimes"]["roomy"]
    assert results["placed@host0"]["placement"] == {"gpu": 0, "host": 0, "disk": 16}
    assert results["placed@host100"]["placement"]["host"] == results["placed@host100"]["buckets"]
    for mode, home in (("placed@host50", "host"), ("placed@gpu50", "gpu")):
        fraction = results[mode][f"{home}_fraction"]
        assert 0.3 < fraction <= 0.5, (mode, fraction)  # bucket granularity: at most the budget
        assert results[mode]["disk_bound_seconds"] > 0
    # Megatron's partial offload sits beside them (skipped here: it needs a GPU).
    assert results["megatron-cpu-offload@50"]["skipped"] == "needs a GPU"
