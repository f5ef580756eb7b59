"""``bench.iteration`` (issue 26's whole-iteration bench; its runs need a GPU and Megatron-LM
trees): every placement's flags pass the launcher's own checks, each run's command and
environment are the GPU tier's, timings are read the way Megatron logs them, the report's
ratios and hidden shares follow from the runs, a run past its time is stopped, and
invocations merge side by side."""

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from bench import iteration
from miles_plugins.optimizers.megatron import args as megatron_args


@pytest.mark.parametrize("mode", sorted(iteration.MODES))
def test_every_mode_passes_the_launcher_s_own_checks(mode, tmp_path):
    parser = megatron_args.add_arguments(argparse.ArgumentParser())
    parsed, unknown = parser.parse_known_args(["--offload-train-disk-dir", str(tmp_path), *iteration.MODES[mode]])
    assert unknown == []
    assert parsed.stream_optimizer_state_to_disk == (mode != "resident")
    parsed.use_distributed_optimizer, parsed.bf16, parsed.optimizer = True, True, "adam"  # as GPT sets them
    megatron_args.validate_args(parsed)  # raises what the launcher would refuse


def test_a_run_is_the_probe_on_its_tree_s_script_with_this_repository_alone_on_the_path(tmp_path):
    cmd = iteration.command(6, iteration.dev_flags(0.5))
    assert cmd[cmd.index("-m", 3) + 1 : cmd.index("-m", 3) + 3] == ["bench.pretrain_probe", "pretrain_gpt.py"]
    assert cmd[-5:] == [
        "--chunked-optimizer-state-offload",
        "--optimizer-state-offload-fraction",
        "0.5",
        "--optimizer-state-offload-chunk-size-mb",
        "256",
    ]
    assert "--train-iters" in cmd and cmd[cmd.index("--train-iters") + 1] == "6"
    assert "--untie-embeddings-and-output-weights" in cmd  # 1.15B params, 13.7 GB of state
    env = iteration.environment(tmp_path / "probe.jsonl")
    assert env["PYTHONPATH"] == str(iteration.REPO) and env["PRETRAIN_PROBE_HASH"] == "0"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_timings_are_read_from_megatron_s_own_log_lines():
    # Megatron's formats: training.py's iteration line, report_memory's line (after iterations 1 and 2).
    log = "\n".join(
        [
            " [2026-12-02 01:00:00] iteration        1/       6 | consumed samples: 32 | "
            "elapsed time per iteration (ms): 4123.4 | learning rate: 3.0E-04 |",
            "[Rank 0] (after 1 iterations) memory (MB) | allocated: 100.00 | max allocated: 200.00 "
            "| reserved: 300.00 | max reserved: 51234.50",
            " [2026-12-02 01:00:02] iteration        2/       6 | elapsed time per iteration (ms): 3001.0 |",
            "[Rank 0] (after 2 iterations) memory (MB) | allocated: 100.00 | max allocated: 200.00 "
            "| reserved: 300.00 | max reserved: 61234.50",
            " [2026-12-02 01:00:04] iteration        3/       6 | elapsed time per iteration (ms): 1999.0 |",
        ]
    )
    timings = iteration.timings_from_log(log)
    assert timings["seconds"] == pytest.approx([4.1234, 3.001, 1.999])
    assert timings["max_reserved_mb_logged"] == 61234.5
    assert iteration.timings_from_log("CUDA out of memory") == {"seconds": [], "max_reserved_mb_logged": None}


def _run(seconds, steps=None, rc=0):
    run = {"returncode": rc, "iters": 5, "seconds": seconds, "max_reserved_mb_logged": 1.0}
    if steps is not None:
        run["probe"] = [
            {"step_seconds": s, "max_reserved_bytes": (k + 1) * 2**30, "placement": {"gpu": 1}}
            for k, s in enumerate(steps)
        ]
    return run


def test_the_summary_gives_ratios_and_the_share_of_the_step_s_transfers_hidden():
    # The first two iterations (one-time costs; Megatron's second line averages both) are left out.
    runs = {
        "resident": _run([9.0, 5.0, 2.0, 2.0, 2.0], [3.0, 3.0, 0.1, 0.1, 0.1]),
        # The step grew by 0.4 s and so did the iteration: nothing hidden.
        "host": _run([9.0, 5.0, 2.4, 2.4, 2.5], [3.0, 3.0, 0.5, 0.5, 0.5]),
        # The step grew by 0.4 s, the iteration by 0.1 s: three quarters hidden.
        "overlapped": _run([9.0, 5.0, 2.1, 2.1, 2.1], [3.0, 3.0, 0.5, 0.5, 0.5]),
        # The step grew by 0.05 s: too little to state a share.
        "auto": _run([9.0, 5.0, 2.0, 2.0, 2.0], [3.0, 3.0, 0.15, 0.15, 0.15]),
        "megatron-dev@0": _run([9.0, 5.0, 2.2, 2.2, 2.2], [3.0, 3.0, 0.1, 0.1, 0.1]),
        "megatron-dev@0.5": _run([9.0, 5.0, 3.3, 3.3, 3.3], [3.0, 3.0, 1.0, 1.0, 1.0]),
        "failed": _run([], rc=1),
        "cut short": _run([9.0, 5.0, 2.0]),  # rc 0, but not every iteration logged
    }
    summary = iteration.summarize(runs)
    host = summary["host"]
    assert host["s_per_iter"] == 2.4 and host["x_resident"] == 1.2 and host["step_s"] == 0.5
    assert (host["in_step_s"], host["grown_s"], host["hidden"]) == (0.4, 0.4, 0.0)
    assert summary["overlapped"]["hidden"] == 0.75
    assert "hidden" not in summary["auto"] and summary["auto"]["in_step_s"] == 0.05
    assert summary["megatron-dev@0.5"]["x_resident"] == 1.65 and summary["megatron-dev@0.5"]["x_dev_off"] == 1.5
    assert "x_dev_off" not in summary["host"]
    assert "in_step_s" not in summary["megatron-dev@0.5"]  # dev moves state outside its step too
    assert summary["failed"]["ok"] is False and "x_resident" not in summary["failed"]
    assert summary["host"]["conversions"] is None  # no conversion counts recorded

    assert summary["cut short"]["ok"] is False
    assert host["max_reserved_mb"] == 5 * 1024  # the largest any iteration saw
    assert host["placement"] == {"gpu": 1}


def test_the_summary_counts_the_codecs_conversions_from_the_third_iteration():
    run = _run([9.0, 5.0, 2.0, 2.0, 2.0], [3.0, 3.0, 0.1, 0.1, 0.1])
    for record, (replayed, eager) in zip(run["probe"], [(0, 8), (2, 6), (6, 2), (8, 0), (8, 0)], strict=True):
        record["conversions"] = {"replayed": replayed, "eager": eager}
    assert iteration.summarize({"disk-8bit": run})["disk-8bit"]["conversions"] == {"replayed": 22, "eager": 2}


def test_the_summary_counts_in_how_many_iterations_each_conversion_ran_eagerly():
    run = _run([9.0, 5.0, 2.0, 2.0, 2.0], [3.0, 3.0, 0.1, 0.1, 0.1])
    eager = [["decode 0", "encode 0"], ["decode 0"], ["decode 0", "encode 5"], ["encode 5"], []]
    for record, slots in zip(run["probe"], eager, strict=True):
        record["conversions"] = {"replayed": 8 - len(slots), "eager": len(slots), "eager_slots": slots}
    conversions = iteration.summarize({"auto-8bit": run})["auto-8bit"]["conversions"]
    assert conversions == {"replayed": 21, "eager": 3, "eager_slots": {"decode 0": 1, "encode 5": 2}}


def test_an_overlap_mode_is_judged_against_its_twin_and_a_disk_mode_against_its_drive():
    runs = {
        "resident": _run([9.0, 5.0, 2.0, 2.0, 2.0], [3.0, 3.0, 0.1, 0.1, 0.1]),
        # Its own step grew by 0.1 s only: the share is of its twin's 0.4 s, of which 0.1 s still
        # shows (the twin may run after it).
        "host+overlap": _run([9.0, 5.0, 2.1, 2.1, 2.1], [3.0, 3.0, 0.2, 0.2, 0.2]),
        "host": _run([9.0, 5.0, 2.4, 2.4, 2.4], [3.0, 3.0, 0.5, 0.5, 0.5]),
        "disk": _run([9.0, 5.0, 6.0, 6.0, 6.0], [3.0, 3.0, 4.1, 4.1, 4.1]),
    }
    for record in runs["disk"]["probe"]:
        record.update(placement={"disk": 3}, step_bytes_moved={"read": 4e9, "written": 5e9})
    drive = {"bytes_each_way": 1 << 30, "direct": True, "s_per_gb_each_way": 0.8}
    summary = iteration.summarize(runs, drive)
    assert summary["host+overlap"]["hidden"] == 0.75
    # 5 GB written at 0.8 s/GB: 4 s, above forward and backward (1.9 s).
    assert summary["disk"]["drive_bound_s"] == 4.0 and summary["disk"]["x_bound"] == 1.5
    assert "drive_bound_s" not in summary["host"]


def test_the_drive_is_measured_reading_and_writing_at_once(tmp_path):
    drive = iteration.drive_seconds_per_gb(str(tmp_path / "nvme"), nbytes=4 << 20, threads=2, chunk=1 << 20)
    assert drive["bytes_each_way"] == 4 << 20 and drive["request_bytes"] == 1 << 20 and drive["s_per_gb_each_way"] > 0
    assert isinstance(drive["direct"], bool)
    assert not list((tmp_path / "nvme").iterdir()), "the probe's files are removed"


def test_the_fastest_direct_probe_bounds_the_disk_modes(tmp_path, monkeypatch):
    """Every shape is probed each time; the bound is the fastest probe of the call,
    never one the page cache served. (The probe's own timing is replaced here: this
    checks the choice, the test above the measurement.)"""
    rates = iter([1.2, 0.9, 0.3, 1.0])  # the third: no O_DIRECT, the page cache's speed
    monkeypatch.setattr(iteration, "DRIVE_SHAPES", ((1 << 20, 1), (2 << 20, 2)))

    def probe(directory, threads, chunk):
        rate = next(rates)
        return {"request_bytes": chunk, "threads_each_way": threads, "direct": rate != 0.3, "s_per_gb_each_way": rate}

    monkeypatch.setattr(iteration, "drive_seconds_per_gb", probe)
    probes = []
    assert iteration._probe_drive(str(tmp_path), probes)["s_per_gb_each_way"] == 0.9
    assert iteration._probe_drive(str(tmp_path), probes)["s_per_gb_each_way"] == 0.9
    assert [p["request_bytes"] for p in probes] == [1 << 20, 2 << 20] * 2


def test_a_failed_request_fails_the_drive_probe(tmp_path, monkeypatch):
    """A write that fails while the reads go on must not leave a rate of the reads alone."""
    import errno

    real, calls = os.pwritev, []

    def pwritev(fd, buffers, offset):
        calls.append(offset)
        if len(calls) > 4:  # the read file's four chunks are written first
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    with pytest.raises(OSError, match="No space left"):
        iteration.drive_seconds_per_gb(str(tmp_path / "nvme"), nbytes=4 * iteration.DRIVE_CHUNK)
    assert not list((tmp_path / "nvme").iterdir()), "the probe's files are removed"


def test_no_drive_bound_is_drawn_from_the_page_cache_or_a_mixed_placement():
    runs = {
        "resident": _run([9.0, 5.0, 2.0, 2.0, 2.0], [3.0, 3.0, 0.1, 0.1, 0.1]),
        "disk": _run([9.0, 5.0, 6.0, 6.0, 6.0], [3.0, 3.0, 4.1, 4.1, 4.1]),
        "gpu+disk": _run([9.0, 5.0, 6.0, 6.0, 6.0], [3.0, 3.0, 4.1, 4.1, 4.1]),
    }
    for name, placement in (("disk", {"disk": 3}), ("gpu+disk", {"gpu": 1, "disk": 2})):
        for record in runs[name]["probe"]:
            record.update(placement=placement, step_bytes_moved={"read": 4e9, "written": 5e9})
    cached = iteration.summarize(runs, {"direct": False, "s_per_gb_each_way": 0.1})
    assert "drive_bound_s" not in cached["disk"]
    direct = iteration.summarize(runs, {"direct": True, "s_per_gb_each_way": 0.8})
    assert direct["disk"]["drive_bound_s"] == 4.0 and "drive_bound_s" not in direct["gpu+disk"]


def test_a_run_past_its_time_is_stopped_and_reported(tmp_path):
    script = "import time; print('started', flush=True); time.sleep(60)"
    run = iteration._run(
        "slow", [sys.executable, "-c", script], str(tmp_path), {}, tmp_path / "slow.jsonl", timeout_s=1, iters=5
    )
    assert run["returncode"] != 0 and run["wall_s"] < 30
    assert "started" in run["log_tail"] and "stopped after 1 s" in run["log_tail"]


def test_a_run_records_what_it_took_of_the_host_s_memory(tmp_path):
    # A child that holds 512 MiB it has written to for a second: MemAvailable falls by about that.
    script = "import time; b = bytearray(512 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)"
    run = iteration._run("hog", [sys.executable, "-c", script], str(tmp_path), {}, tmp_path / "hog.jsonl", 30, 5)
    assert run["returncode"] == 0
    taken = iteration._host_taken(run)
    assert run["mem_available_gb"]["min"] <= run["mem_available_gb"]["start"]
    assert taken > 0.25, f"the host sampler saw {taken} GB taken by a 0.54 GB child"


def test_a_run_gets_the_time_left_with_its_stop_s_grace_or_is_not_started():
    assert iteration.run_timeout(560, 300) == 300
    assert iteration.run_timeout(300, 300) == 300 - iteration.STOP_GRACE_S
    assert iteration.run_timeout(iteration.MIN_RUN_S + iteration.STOP_GRACE_S - 1, 300) is None


def test_bad_requests_are_refused_before_running_anything(monkeypatch, tmp_path):
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    with pytest.raises(SystemExit, match=r"unknown modes \['nvme'\]"):
        iteration.main(["--modes", "resident,nvme"])
    with pytest.raises(SystemExit, match="--iters must be 5 or more"):
        iteration.main(["--iters", "3"])
    with pytest.raises(SystemExit, match="--run-timeout-s must be 120 or more"):
        iteration.main(["--run-timeout-s", "110"])
    with pytest.raises(SystemExit, match="needs MEGATRON_LM_DIR"):
        iteration.main(["--modes", "resident"])
    with pytest.raises(SystemExit, match="a mode given twice"):
        iteration.main(["--modes", "resident,host,resident"])
    monkeypatch.setenv("MEGATRON_LM_DIR", str(iteration.REPO))  # no pretrain_gpt.py there
    with pytest.raises(SystemExit, match="needs MEGATRON_LM_DIR"):
        iteration.main(["--modes", "host"])
    (tmp_path / "pretrain_gpt.py").write_text("")  # a script, but no Megatron tree around it
    monkeypatch.setenv("MEGATRON_LM_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="could not check .*: error: no megatron/training/checkpointing.py"):
        iteration.main(["--modes", "host"])


def test_invocations_merge_side_by_side_each_run_keeping_its_own_ratios(tmp_path):
    first = {"summary": {"resident": {"ok": True, "x_resident": 1.0}, "host": {"ok": True, "x_resident": 1.2}}}
    second = {"summary": {"resident": {"ok": True, "x_resident": 1.0}, "disk": {"ok": True, "x_resident": 3.1}}}
    paths = []
    for k, report in enumerate((first, second)):
        paths.append(tmp_path / f"{k}.json")
        paths[-1].write_text(json.dumps(report))
    iteration.main(["merge", *map(str, paths), "--out", str(tmp_path / "all.json")])
    merged = json.loads(Path(tmp_path / "all.json").read_text())
    assert list(merged["summary"]) == ["resident", "host", "resident (call 2)", "disk"]
    assert merged["summary"]["disk"]["x_resident"] == 3.1 and len(merged["calls"]) == 2
    assert [row["call"] for row in merged["summary"].values()] == [1, 1, 2, 2]


def test_the_disk_directory_s_filesystem_is_named(tmp_path):
    mounts = {line.split()[2] for line in Path("/proc/mounts").read_text().splitlines()}
    assert iteration.filesystem_of(str(tmp_path)) in mounts
