"""Result files written before the suite, read as suite results (``bench.report``).

Two formats: the merged calls of the whole-iteration bench that preceded the suite (each
run: Megatron's logged seconds per iteration, the probe's records) and one case of the
scale tier (the probe's records of one run). Neither file records the commit it ran on
or its GPU: ``LEGACY`` says what is known of each and where that comes from, and the
mode names of the old bench map to table entries of the same flags
(``ITERATION_MODES``: the old bench's flags at that commit, as ``git show`` gives them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bench import compare, harness, workloads
from bench.workloads import Mode, Placement

FORMAT = "bench.suite/1"
# The old bench timed from the third iteration on (Megatron's first two carry one-time
# costs); the scale tier's case from the second.
ITERATION_WARMUP = 2
SCALE_WARMUP = 1


@dataclass(frozen=True)
class Legacy:
    """What a legacy file is: its ``workload`` and ``reader`` (``iteration`` or
    ``scale``), the ``commit`` it ran on and the ``source`` of that knowledge, its GPU."""

    workload: str
    reader: str
    commit: str
    source: str
    gpu: str = "NVIDIA H200"


LEGACY = {
    "iteration-h200-2026-12-03-fraction-half.json": Legacy(
        "dense-1b",
        "iteration",
        "ff13426",
        "named in the message of ebd0287, which added the file; miles_plugins/ is the same at both",
    ),
    "scale-h200-2026-12-02-7b-auto-fp32.json": Legacy(
        "scale-1gpu",
        "scale",
        "ff13426",
        "named in the message of ebd0287, which added the file; miles_plugins/ is the same at both",
    ),
}

ITERATION_MODES = {
    "resident": Mode("resident", baseline=None),
    "host+overlap-3g": Mode("host+overlap-3g", Placement(tier="host", window_gb=3)),
    "gpu6.9+host-d4": Mode("gpu6.9+host-d4", Placement(tier="host", gpu_budget_gb=6.9, buckets_in_flight=4)),
    "gpu6.7+host-d4": Mode("gpu6.7+host-d4", Placement(tier="host", gpu_budget_gb=6.7, buckets_in_flight=4)),
    "gpu6.35+host-d6-cap32m": Mode(
        "gpu6.35+host-d6-cap32m",
        Placement(tier="host", gpu_budget_gb=6.35, buckets_in_flight=6, bucket_cap=32_000_000),
    ),
    "gpu6.15+host-d6-cap32m": Mode(
        "gpu6.15+host-d6-cap32m",
        Placement(tier="host", gpu_budget_gb=6.15, buckets_in_flight=6, bucket_cap=32_000_000),
    ),
    "megatron-dev@0.5": Mode("megatron-dev@0.5", dev_fraction=0.5),
    "megatron-dev@1": Mode("megatron-dev@1", dev_fraction=1),
}


# The old modes the suite's dense-1b table runs with the same flags, by its names.
SUITE_NAMES = {
    "resident": "resident",
    "host+overlap-3g": "host+window-3g",
    "gpu6.15+host-d6-cap32m": "gpu-budget-at-dev@0.5",
    "megatron-dev@0.5": "dev@0.5",
    "megatron-dev@1": "dev@1",
}


def _provenance(legacy: Legacy) -> dict:
    return {
        "commit": legacy.commit,
        "dirty": None,
        "commit_source": legacy.source,
        "gpus": [legacy.gpu],
        "torch": None,
        "trees": {},
        "drive": None,
    }


def _run(records: list[dict], returncode: int, complete: bool, warmup: int, available: dict | None) -> dict:
    return {
        "returncode": returncode,
        "outcome": compare.OK if returncode == 0 and complete else f"failed (exit {returncode})",
        "records": records,
        "stats": harness.iteration_stats(records, warmup),
        "mem_available_bytes": {k: int(v * 1e9) for k, v in available.items()} if available else None,
    }


def _iteration_call(number: int, call: dict) -> dict:
    runs, modes = {}, {}
    for name, run in call["runs"].items():
        if name not in ITERATION_MODES:
            raise ValueError(f"a legacy iteration mode without a table entry: {name}")
        # The old bench's s/iter was Megatron's logged time per iteration: the probe's
        # records carry it as the whole iteration's seconds.
        records = [
            {**record, "interval_seconds": seconds}
            for record, seconds in zip(run.get("probe", []), run["seconds"], strict=False)
        ]
        complete = len(run["seconds"]) == run["iters"]
        runs[name] = _run(records, run["returncode"], complete, ITERATION_WARMUP, run.get("mem_available_gb"))
        modes[name] = dataclasses.asdict(ITERATION_MODES[name])
    measured = call["iters"] - ITERATION_WARMUP
    return {"id": f"legacy-{number}", "number": number, "measured": measured, "modes": modes, "runs": runs}


def _scale_call(case: dict) -> dict:
    names = {"7b-auto-fp32": "7.6b-auto"}
    if case["name"] not in names:
        raise ValueError(f"a legacy scale case without a table entry: {case['name']}")
    mode = workloads.SCALE_1GPU.mode(names[case["name"]])
    available = {"start": case["mem_available_start_gb"], "min": case["mem_available_min_gb"]}
    run = _run(case["iterations"], case["returncode"], bool(case["iterations"]), SCALE_WARMUP, available)
    return {
        "id": "legacy-1",
        "number": 1,
        "measured": len(case["iterations"]) - SCALE_WARMUP,
        "modes": {mode.name: dataclasses.asdict(mode)},
        "runs": {mode.name: run},
    }


def read(name: str, data: dict) -> dict:
    """The legacy file ``name`` (a key of ``LEGACY``) as a suite result."""
    legacy = LEGACY[name]
    if legacy.reader == "iteration":
        calls = [_iteration_call(number, call) for number, call in enumerate(data["calls"], 1)]
    else:
        calls = [_scale_call(data)]
    for call in calls:
        call["provenance"] = _provenance(legacy)
        call["skipped"] = []
    return {"format": FORMAT, "workload": legacy.workload, "machine": "h200", "legacy": True, "calls": calls}
