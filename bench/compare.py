"""Each run of a call against the runs beside it: its baseline (x resident, GPU memory
saved) and Megatron dev at no more GPU memory. The suite prints these after a call;
``bench.report`` builds its tables from them.

A call is a dict in the suite's result format: ``modes`` (each mode's table entry, as
``dataclasses.asdict`` gives it) and ``runs`` (each with its ``outcome`` and ``stats``).
Peaks are the device's peak *reserved* memory over the whole run: what the process took
from the GPU, the figure a neighbour on the device would feel.
"""

from __future__ import annotations

OK = "ok"
GIB = 1 << 30


def holds_whole_state(spec: dict, stats: dict) -> bool:
    """Whether the mode keeps all the state on the GPU across the step: a window at least
    the stored state, or every bucket in the gpu home. Such a mode saves no memory,
    whatever its peak."""
    ours = spec.get("ours") or {}
    stored = stats.get("stored_bytes")
    placement = stats.get("placement") or {}
    window = ours.get("window_gb")
    if window is not None and stored and window * GIB >= stored:
        return True
    return bool(placement) and placement.get("gpu", 0) > 0 and not placement.get("host") and not placement.get("disk")


def _median(run: dict | None) -> float | None:
    if not run or run.get("outcome") != OK:
        return None
    return run["stats"]["s_per_iter"]["median"]


def _peak(run: dict | None) -> int | None:
    if not run or run.get("outcome") != OK:
        return None
    return run["stats"].get("max_reserved_bytes")


def summarize(call: dict) -> dict[str, dict]:
    """Per run of ``call``: ``x_baseline`` (s/iter over its baseline's), ``saved_bytes``
    (its baseline's peak less its own; 0 where it holds the whole state or peaks
    higher; None without a baseline that ran), ``baseline_outcome``, and ``vs_dev``:
    among dev's runs of the call that peaked at no less than it, the one nearest in
    memory, and s/iter over that run's (None where none did)."""
    runs, modes = call["runs"], call["modes"]
    out: dict[str, dict] = {}
    for name, run in runs.items():
        spec = modes[name]
        row: dict = {"outcome": run.get("outcome"), "x_baseline": None, "saved_bytes": None, "vs_dev": None}
        baseline = runs.get(spec.get("baseline") or "")
        row["baseline_outcome"] = baseline.get("outcome") if baseline else None
        mine, theirs = _median(run), _median(baseline)
        if mine is not None and theirs is not None:
            row["x_baseline"] = mine / theirs
            peak, base_peak = _peak(run), _peak(baseline)
            if peak is not None and base_peak is not None:
                whole = holds_whole_state(spec, run["stats"])
                row["saved_bytes"] = 0 if whole else max(0, base_peak - peak)
        if mine is not None and spec.get("dev_fraction") is None and _peak(run) is not None:
            devs = [
                (_peak(r), n)
                for n, r in runs.items()
                if modes[n].get("dev_fraction") is not None and _median(r) is not None and _peak(r) is not None
            ]
            above = sorted((p, n) for p, n in devs if p >= _peak(run))
            if above:
                dev = above[0][1]
                row["vs_dev"] = {
                    "dev": dev,
                    "dev_fraction": modes[dev]["dev_fraction"],
                    "ratio": mine / _median(runs[dev]),
                    "dev_peak_bytes": above[0][0],
                }
        out[name] = row
    return out
