"""``bench.iteration`` (issue 26's whole-iteration bench; its runs need a GPU and Megatron-LM
trees): the flags of every placement are the launcher's own, the timings are read the way
Megatron logs them, and the report's ratios and hidden shares follow from the runs."""

import argparse
import sys

import pytest

from bench import iteration
from miles_plugins.optimizers.megatron import args as megatron_args


@pytest.mark.parametrize("mode", sorted(iteration.MODES))
def test_every_mode_passes_only_flags_the_launcher_defines(mode):
    parser = megatron_args.add_arguments(argparse.ArgumentParser())
    parsed, unknown = parser.parse_known_args(["--offload-train-disk-dir", "/nvme", *iteration.MODES[mode]])
    assert unknown == []
    assert parsed.stream_optimizer_state_to_disk == (mode != "resident")


def test_timings_are_read_from_megatron_s_own_log_lines():
    # Megatron's formats: training.py's iteration line, utils' report_memory line.
    log = "\n".join(
        [
            " [2026-12-02 01:00:00] iteration        1/       6 | consumed samples: 32 | "
            "elapsed time per iteration (ms): 4123.4 | learning rate: 3.0E-04 |",
            "[Rank 0] (after 1 iterations) memory (MB) | allocated: 100.00 | max allocated: 200.00 "
            "| reserved: 300.00 | max reserved: 51234.50",
            " [2026-12-02 01:00:02] iteration        2/       6 | elapsed time per iteration (ms): 2001.0 |",
            " [2026-12-02 01:00:04] iteration        3/       6 | elapsed time per iteration (ms): 1999.0 |",
        ]
    )
    timings = iteration.timings_from_log(log)
    assert timings["seconds"] == pytest.approx([4.1234, 2.001, 1.999])
    assert timings["max_reserved_mb_first_iteration"] == 51234.5
    assert iteration.timings_from_log("Traceback: CUDA out of memory") == {
        "seconds": [],
        "max_reserved_mb_first_iteration": None,
    }


def _run(seconds, steps=None, rc=0):
    run = {"returncode": rc, "seconds": seconds, "max_reserved_mb_first_iteration": 1.0}
    if steps is not None:
        run["probe"] = [{"step_seconds": s, "max_reserved_bytes": 2**30, "placement": {"gpu": 1}} for s in steps]
    return run


def test_the_summary_gives_ratios_to_resident_and_the_share_of_the_step_s_transfers_hidden():
    runs = {
        "resident": _run([9.0, 2.0, 2.0, 2.0], [0.1, 0.1, 0.1, 0.1]),
        # The step grew by 0.4 s and so did the iteration: nothing hidden.
        "host": _run([9.0, 2.4, 2.4, 2.5], [0.5, 0.5, 0.5, 0.5]),
        # The step grew by 0.4 s, the iteration by 0.1 s: three quarters hidden.
        "overlapped": _run([9.0, 2.1, 2.1, 2.1], [0.5, 0.5, 0.5, 0.5]),
        "megatron-dev-chunked@0.5": _run([9.0, 3.0, 3.0]),
        "failed": _run([], rc=1),
    }
    summary = iteration.summarize(runs)
    assert summary["host"]["s_per_iter"] == 2.4 and summary["host"]["x_resident"] == 1.2
    assert summary["host"]["hidden"] == 0.0
    assert summary["overlapped"]["hidden"] == 0.75
    assert summary["megatron-dev-chunked@0.5"]["x_resident"] == 1.5
    assert "hidden" not in summary["megatron-dev-chunked@0.5"]  # no probe: no step seconds
    assert summary["failed"]["ok"] is False and "x_resident" not in summary["failed"]
    assert summary["host"]["max_reserved_mb"] == 1024 and summary["host"]["placement"] == {"gpu": 1}


def test_it_refuses_unknown_modes_and_a_missing_tree_before_running_anything(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench.iteration", "--modes", "resident,nvme"])
    with pytest.raises(SystemExit, match=r"unknown modes \['nvme'\]"):
        iteration.main()
    monkeypatch.setattr(sys, "argv", ["bench.iteration", "--modes", "resident"])
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    with pytest.raises(SystemExit, match="needs MEGATRON_LM_DIR"):
        iteration.main()
