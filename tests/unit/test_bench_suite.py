"""``bench.harness`` and ``bench.suite`` on the CPU. The suite's real runs need a GPU and
Megatron-LM trees; here a stand-in for ``torchrun -m bench.pretrain_probe`` (a small
script writing the probe's records from the flags it is given) takes their place, so
what is tested is the harness around them: one process per mode, the deadline and the
stop, the statistics, the comparisons within a call, the expectations, the merge of
calls and the provenance."""

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import compare, harness, suite, workloads

GIB = 1 << 30

# The probe's records as a run of the flags would write them: streamed runs are slower
# and peak lower, dev's by its fraction; a resident run of 24 layers runs out of memory.
STAND_IN = """
import json, os, sys
argv = sys.argv[1:]
iters = int(argv[argv.index("--train-iters") + 1])
layers = argv[len(argv) - 1 - argv[::-1].index("--num-layers") + 1]
streamed = "--stream-optimizer-state-to-disk" in argv
fraction = float(argv[argv.index("--optimizer-state-offload-fraction") + 1]) if "--optimizer-state-offload-fraction" in argv else 0
if layers == "24" and not streamed:
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    sys.exit(1)
seconds = 1.9 + (0.2 if streamed else 0) + 0.3 * fraction
peak = (60 - (10 if streamed else 0) - 9 * fraction) * 2**30
with open(os.environ["PRETRAIN_PROBE_OUT"], "a") as out:
    for i in range(iters):
        record = {
            "iteration": i + 1, "losses": {"lm loss": (1 / (i + 1)).hex()},
            "params": f"hash{i}" if os.environ["PRETRAIN_PROBE_HASH"] == "1" else None,
            "seconds": seconds + 0.01 * i, "interval_seconds": seconds + 0.01 * i if i else None,
            "step_seconds": 0.1 + (0.1 if streamed else 0), "max_reserved_bytes": peak, "max_allocated_bytes": peak - 2**30,
        }
        if streamed:
            record.update(placement={"gpu": 0, "host": 23, "disk": 0}, home_bytes={"gpu": 0, "host": 13.75e9, "disk": 0},
                          stored_bytes=13.75e9, step_bytes_moved={"read": 13.75e9, "written": 13.75e9})
        out.write(json.dumps(record) + "\\n")
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """The suite with the stand-in for torchrun and the probe, and no trees to check."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)

    def command(workload, mode, gpus, iterations, disk_dir, quick):
        model = workloads.model_flags(workload, mode, gpus, quick)
        flags = workloads.mode_flags(mode, disk_dir)
        return [sys.executable, str(script), *model, "--train-iters", str(iterations), *flags]

    monkeypatch.setattr(suite, "command", command)
    monkeypatch.setattr(suite, "_check_trees", lambda workload, names: {"ours": str(tmp_path), "dev": str(tmp_path)})
    return tmp_path


def _job(tmp_path: Path, name: str, code: str, expected_s: float = 0.0) -> harness.Job:
    records = tmp_path / f"{name}.jsonl"
    argv = (sys.executable, "-c", code)
    return harness.Job(name, argv, str(tmp_path), records, {"RECORDS": str(records)}, expected_s=expected_s)


WRITE_THREE = (
    "import json, os\nfor i in range(3): open(os.environ['RECORDS'], 'a').write(json.dumps({'seconds': i}) + '\\n')"
)


def test_a_call_runs_each_job_in_its_own_process_stops_one_past_the_deadline_and_skips_what_cannot_start(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(harness, "STOP_GRACE_S", 0.3)
    # A job that writes a record, then hangs: stopped at the deadline, its record kept.
    hang = "import json, os, time\nopen(os.environ['RECORDS'], 'a').write(json.dumps({'seconds': 1}) + '\\n')\ntime.sleep(60)"
    jobs = [
        _job(tmp_path, "quick", WRITE_THREE),
        _job(tmp_path, "hangs", hang),
        _job(tmp_path, "too-long", WRITE_THREE, expected_s=30),
    ]
    landed = {}
    start = time.perf_counter()
    skipped = harness.run_call(jobs, 1.3, tmp_path, lambda name, run: landed.setdefault(name, run))
    assert time.perf_counter() - start < 10
    assert skipped == ["too-long"]
    assert landed["quick"]["returncode"] == 0 and [r["seconds"] for r in landed["quick"]["records"]] == [0, 1, 2]
    assert landed["hangs"]["stopped"] and landed["hangs"]["returncode"] != 0
    assert landed["hangs"]["records"] == [{"seconds": 1}]
    for run in landed.values():
        assert run["mem_available_bytes"]["min"] <= run["mem_available_bytes"]["start"]


def test_a_memory_limit_that_cannot_be_set_is_said_and_nothing_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "CGROUP_ROOT", tmp_path / "no-cgroup-here")
    job = harness.Job("limited", (sys.executable, "-c", "pass"), str(tmp_path), tmp_path / "r", memory_max_bytes=GIB)
    run = harness.run_job(job, 10, tmp_path / "log")
    assert run["returncode"] is None and "no cgroup v2 memory limit" in run["error"] and run["records"] == []


def test_iteration_stats_skip_the_warm_up_and_keep_the_run_s_peaks():
    records = [
        {
            "seconds": 9.0,
            "interval_seconds": None,
            "step_seconds": 5.0,
            "max_reserved_bytes": 7,
            "max_allocated_bytes": 3,
        },
        {"seconds": 1.0, "interval_seconds": 2.0, "step_seconds": 0.5, "max_reserved_bytes": 5},
        {"seconds": 1.0, "interval_seconds": 4.0, "step_seconds": 0.7, "max_reserved_bytes": 6},
        {"seconds": 3.0, "step_seconds": 0.6, "max_reserved_bytes": 6, "placement": {"host": 2}},
    ]
    stats = harness.iteration_stats(records, warmup=1)
    # The whole iteration where the probe measured it, the step's seconds where it did not.
    assert stats["s_per_iter"] == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 3}
    assert stats["step_s"]["median"] == 0.6
    assert stats["max_reserved_bytes"] == 7 and stats["max_allocated_bytes"] == 3  # the warm-up's peak counts
    assert stats["placement"] == {"host": 2}
    assert harness.iteration_stats([], warmup=3)["s_per_iter"] is None


def test_calls_merge_in_order_once_each_and_only_of_one_workload_and_machine():
    def result(*ids, workload="dense-1b"):
        calls = [{"id": i, "number": 1, "runs": {}} for i in ids]
        return {"format": suite.FORMAT, "workload": workload, "machine": "h200", "calls": calls}

    merged = harness.merge_calls([result("a"), result("b", "a")])
    assert [(c["id"], c["number"]) for c in merged["calls"]] == [("a", 1), ("b", 2)]
    with pytest.raises(SystemExit, match="cannot merge"):
        harness.merge_calls([result("a"), result("b", workload="moe")])


def test_provenance_names_this_repository_s_commit_and_a_tree_s_megatron(tmp_path):
    tree = tmp_path / "Megatron-LM"
    (tree / "megatron" / "core").mkdir(parents=True)
    (tree / "megatron" / "core" / "package_info.py").write_text(
        "MAJOR = 0\nMINOR = 19\nPATCH = 0\nPRE_RELEASE = 'rc1'\n"
    )
    found = harness.provenance({"ours": str(tree)}, str(tmp_path))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=harness.REPO, capture_output=True, text=True).stdout
    assert found["commit"] == head.strip() and isinstance(found["dirty"], bool)
    assert found["trees"]["ours"] == {"path": str(tree), "megatron_core": "0.19.0rc1", "commit": None}
    assert found["torch"] and found["drive"]["filesystem"] != "unknown"


def test_the_machine_is_the_gpu_s_model_and_the_gpu_count():
    assert suite.machine(["NVIDIA H200, 143771 MiB"], 1) == "h200"
    assert suite.machine(["NVIDIA H100 80GB HBM3, 81559 MiB"], 8) == "h100-x8"
    assert suite.machine([], 1) == "cpu"


def test_a_call_compares_each_mode_with_its_resident_and_dev_in_the_same_call(stand_in, capsys):
    out = stand_in / "dense.json"
    argv = ["--workload", "dense-1b", "--modes", "host+window-3g", "--out", str(out)]
    assert suite.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["workload"] == "dense-1b" and result["machine"] == "cpu"
    (call,) = result["calls"]
    assert list(call["runs"]) == ["resident", "host+window-3g", "dev@1"]  # the baseline and the peer came along
    assert call["provenance"]["commit"] and call["modes"]["dev@1"]["dev_fraction"] == 1
    stats = call["runs"]["host+window-3g"]["stats"]
    assert stats["s_per_iter"]["n"] == workloads.MEASURED
    assert stats["s_per_iter"]["min"] == pytest.approx(2.1 + 0.01 * workloads.WARMUP)
    row = compare.summarize(call)["host+window-3g"]
    assert row["x_baseline"] == pytest.approx(stats["s_per_iter"]["median"] / (stats["s_per_iter"]["median"] - 0.2))
    assert row["saved_bytes"] == 10 * GIB
    # dev at fraction 1 peaked at 51 GiB, above our 50: ours is faster at no more memory.
    assert row["vs_dev"]["dev"] == "dev@1" and row["vs_dev"]["ratio"] < 1
    assert "host+window-3g" in capsys.readouterr().out


def test_expectations_byte_identity_and_out_of_memory_are_checked(stand_in):
    out = stand_in / "scale.json"
    argv = ["--workload", "scale-1gpu", "--modes", "5.1b-auto,7.6b-auto", "--out", str(out)]
    assert suite.main(argv) == 0
    runs = json.loads(out.read_text())["calls"][0]["runs"]
    assert runs["5.1b-auto"]["expected"] is True  # losses and params hashes equal at every iteration
    assert runs["7.6b-resident"]["outcome"] == "out of memory" and runs["7.6b-resident"]["expected"] is True
    assert runs["7.6b-auto"]["outcome"] == compare.OK


def test_an_unmet_expectation_fails_the_suite(stand_in, monkeypatch, capsys):
    resident = workloads.SCALE_1GPU.mode("7.6b-resident")
    fits = workloads.Mode("7.6b-resident", model=("--num-layers", "23"), baseline=None, expect="oom")
    modes = tuple(fits if m is resident else m for m in workloads.SCALE_1GPU.modes)
    monkeypatch.setitem(workloads.WORKLOADS, "scale-1gpu", dataclasses.replace(workloads.SCALE_1GPU, modes=modes))
    assert suite.main(["--workload", "scale-1gpu", "--modes", "7.6b-auto", "--out", str(stand_in / "s.json")]) == 1
    assert "7.6b-resident: ok" in capsys.readouterr().err


def test_the_calls_of_a_workload_merge_into_one_result_file(stand_in):
    calls = []
    for mode in ("host", "auto"):
        calls.append(stand_in / f"{mode}.json")
        assert suite.main(["--workload", "dense-1b", "--modes", mode, "--quick", "--out", str(calls[-1])]) == 0
    merged = stand_in / "dense-1b-cpu.json"
    assert suite.main(["merge", *map(str, calls), "--out", str(merged)]) == 0
    result = json.loads(merged.read_text())
    assert [sorted(c["runs"]) for c in result["calls"]] == [["host", "resident"], ["auto", "resident"]]
    assert [c["number"] for c in result["calls"]] == [1, 2] and all(c["quick"] for c in result["calls"])


def test_a_workload_too_long_for_one_call_runs_as_several_written_to_one_file(stand_in, monkeypatch, capsys):
    monkeypatch.setattr(harness, "STOP_GRACE_S", 0.3)
    argv = ["--workload", "dense-1b", "--modes", "host,auto", "--quick", "--deadline-s", "100"]
    assert suite.main([*argv, "--plan"]) == 0
    assert capsys.readouterr().out.count("call ") == 2  # resident and host, then resident and auto
    out = stand_in / "both.json"
    assert suite.main([*argv, "--out", str(out)]) == 0
    calls = json.loads(out.read_text())["calls"]
    assert [(c["number"], list(c["runs"])) for c in calls] == [(1, ["resident", "host"]), (2, ["resident", "auto"])]


def test_bad_requests_are_refused_in_one_line_before_anything_runs(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit, match="unknown workload 'nope'"):
        suite.main(["--workload", "nope"])
    with pytest.raises(SystemExit, match="has no mode nope"):
        suite.main(["--workload", "dense-1b", "--modes", "host,nope"])
    with pytest.raises(SystemExit, match="runs at 1 GPUs, not 2"):
        suite.main(["--workload", "scale-1gpu", "--gpus", "2"])
    with pytest.raises(SystemExit, match="--call 9, but the plan has"):
        suite.main(["--workload", "dense-1b", "--call", "9"])
    monkeypatch.delenv(suite.TREE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="needs MEGATRON_LM_DIR"):
        suite.main(["--workload", "dense-1b", "--modes", "host"])
    (tmp_path / "pretrain_gpt.py").write_text("")
    monkeypatch.setenv(suite.TREE_ENV, str(tmp_path))
    monkeypatch.delenv("MEGATRON_DEV_DIR", raising=False)
    with pytest.raises(SystemExit, match="dev@1 needs MEGATRON_DEV_DIR"):
        suite.main(["--workload", "dense-1b", "--modes", "dev@1"])
    assert suite.main(["--workload", "dense-1b", "--plan"]) == 0
    assert capsys.readouterr().out.startswith("call 1 (about ")


def test_a_suite_result_in_bench_results_is_tabled_by_the_report(stand_in, monkeypatch):
    from bench import report

    results = stand_in / "results"
    shutil.copytree(report.RESULTS, results)
    docs = stand_in / "performance.md"
    shutil.copyfile(report.DOCS, docs)
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "DOCS", docs)
    monkeypatch.setattr(report, "README", shutil.copyfile(report.README, stand_in / "README.md"))
    monkeypatch.setattr(report, "REPO", stand_in)
    argv = ["--workload", "dense-1b", "--modes", "host+window-3g", "--out", str(results / "dense-1b-cpu.json")]
    assert suite.main(argv) == 0
    assert report.main(["--check"]) == 1  # the new file is not in the docs yet
    assert report.main([]) == 0 and report.main(["--check"]) == 0
    block = docs.read_text().split("<!-- bench.report:dense-1b -->")[1].split("<!-- /bench.report:dense-1b -->")[0]
    (row,) = [line for line in block.splitlines() if line.startswith("| host+window-3g: host home, 3 GiB window | 1 |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2] == "ok" and cells[7] == "10.00"  # saved vs resident, GiB
    assert cells[-1].endswith("faster than dev at fraction 1")
