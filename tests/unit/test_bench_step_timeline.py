"""``bench.step_timeline``'s summary of a profiler trace (the timeline itself needs a
GPU; its summary is plain arithmetic over the trace's events, checked here on a
hand-made trace)."""

import pytest

from bench import step_timeline


def _event(cat, name, ts, dur, stream, nbytes=None):
    args = {"stream": stream}
    if nbytes is not None:
        args["bytes"] = nbytes
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_busy_span_bytes_and_gaps_per_stream_and_kind():
    events = [
        _event("cpu_op", "aten::copy_", 0, 50, None),  # host events are not the device's
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1000, 2000, 45, 100_000_000),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 4000, 1000, 45, 50_000_000),  # 1 ms gap
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 5100, 900, 45, 40_000_000),  # 0.1 ms: not listed
        _event("kernel", "multi_tensor_apply_kernel", 1500, 300, 7),
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 2000, 4000, 49, 200_000_000),
    ]
    rows = {(r["stream"], r["kind"]): r for r in step_timeline.summarize(events)}
    assert set(rows) == {(45, "HtoD"), (7, "kernel"), (49, "DtoH")}
    h2d = rows[(45, "HtoD")]
    assert h2d["count"] == 3 and h2d["busy_ms"] == 3.9
    assert (h2d["first_ms"], h2d["last_ms"]) == (0.0, 5.0)  # from the first device event
    assert h2d["gb"] == 0.19 and h2d["gb_per_s_busy"] == pytest.approx(48.7, abs=0.05)
    assert h2d["gaps_ms_at_ms"] == [[1.0, 2.0]]
    assert rows[(7, "kernel")]["gb_per_s_busy"] is None and rows[(7, "kernel")]["first_ms"] == 0.5
    assert rows[(49, "DtoH")]["gb_per_s_busy"] == 50.0


def test_a_trace_without_device_events_summarizes_to_nothing():
    assert step_timeline.summarize([_event("cpu_op", "aten::add", 0, 5, None)]) == []


def test_a_small_run_on_the_cpu_reports_every_step_and_its_placement(tmp_path):
    # The real store and profiler on a tiny GPT (no device events on the CPU, so no timeline rows).
    args = step_timeline.argparse.Namespace(
        layers=2, hidden=64, vocab=256, seq=32, tier="host", gpu_budget_gb=0.0004, window_gb=0.0003,
        buckets_in_flight=2, bucket_cap=20000, steps=2, pause_s=0.0, dir=str(tmp_path), out="", trace=None,
    )  # fmt: skip
    report, trace = step_timeline.timeline(args, step_timeline.torch.device("cpu"))
    assert len(report["steps"]) == 3 and all(s["seconds"] > 0 for s in report["steps"])
    assert report["steps"][-1]["read_gb"] == report["steps"][-1]["written_gb"] > 0
    assert report["placement"]["gpu"] > 0 and report["placement"]["host"] > 0
    assert report["timeline"] == [] and trace["traceEvents"]
    assert list(tmp_path.iterdir()) == []  # the state directory went with the store


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(SystemExit, match="--steps, --buckets-in-flight and --bucket-cap"):
        step_timeline.main(["--steps", "0"])
