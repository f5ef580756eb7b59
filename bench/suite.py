"""The benchmark suite: every workload of ``bench.workloads`` in every mode, each mode in its
own process beside its own resident run (and Megatron dev where the mode names it), on
Megatron-LM's ``pretrain_gpt.py`` through the launcher and ``bench.pretrain_probe``.

    MEGATRON_LM_DIR=/patched/Megatron-LM [MEGATRON_DEV_DIR=/Megatron-LM-dev] \\
        python -m bench.suite --workload dense-1b [--modes host,disk] [--gpus N] [--quick]
            [--plan] [--call K] [--deadline-s 560] [--disk-dir /nvme/bench] [--out FILE] [--plot]
    python -m bench.suite merge CALL.json [CALL.json ...] --out bench/results/dense-1b-h200.json [--plot]

The asked modes (all by default) are packed into calls of at most ``--deadline-s`` by
their estimated times, each call holding every mode's baseline and peers (``--plan``
prints them); ``--call K`` runs the K-th alone, as the device machine's 600 s commands
need, and ``merge`` puts the calls' files together. Per run: ``WARMUP`` iterations,
then ``MEASURED`` timed (``--quick``: a smoke run of a smaller model, never reported).
Each run's record: its exit, its iterations as the probe wrote them, the host's
MemAvailable at its lowest, and ``stats`` (``harness.iteration_stats``); each call's:
its provenance (``harness.provenance``). ``bench.report`` turns merged files into the
README's and the docs' tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from bench import compare, harness, megatron_dev, workloads
from bench.workloads import Mode, Workload

FORMAT = "bench.suite/1"
DEFAULT_DEADLINE_S = 560  # a device command's 600 s, less the start and the file's return
OOM = re.compile(r"CUDA out of memory|OutOfMemoryError")
TREE_ENV = "MEGATRON_LM_DIR"


def command(workload: Workload, mode: Mode, gpus: int, iterations: int, disk_dir: str, quick: bool) -> list[str]:
    """torchrun of the probe, which runs the launcher on ``pretrain_gpt.py`` of the run's tree."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", "--standalone"]
    model = workloads.model_flags(workload, mode, gpus, quick)
    probe = ["-m", "bench.pretrain_probe", "pretrain_gpt.py"]
    return [*torchrun, *probe, *model, "--train-iters", str(iterations), *workloads.mode_flags(mode, disk_dir)]


def machine(gpu_names: list[str], gpus: int) -> str:
    """The result file's machine: the GPU's model (``h200``), ``-xN`` beyond one GPU."""
    found = re.search(r"\b([A-Z]+\d{2,4}[A-Za-z]*)\b", gpu_names[0]) if gpu_names else None
    kind = found.group(1).lower() if found else "cpu"
    return kind if gpus == 1 else f"{kind}-x{gpus}"


def outcome(run: dict, iterations: int, log: str) -> str:
    """``ok`` (every iteration recorded), ``out of memory``, ``stopped at the deadline``,
    ``not run: ...`` or ``failed (exit N)``."""
    if run.get("error"):
        return f"not run: {run['error']}"
    if run["returncode"] == 0 and len(run["records"]) >= iterations:
        return compare.OK
    if OOM.search(log):
        return "out of memory"
    if run.get("stopped"):
        return "stopped at the deadline"
    return f"failed (exit {run['returncode']})"


def expectation(mode: Mode, runs: dict[str, dict]) -> bool | None:
    """Whether ``mode``'s run met what its table entry expects (None: it expects nothing)."""
    run = runs.get(mode.name)
    if mode.expect is None or run is None:
        return None
    if mode.expect == "oom":
        return run["outcome"] == "out of memory"
    baseline = runs.get(mode.baseline or "")
    if not baseline or run["outcome"] != compare.OK or baseline["outcome"] != compare.OK:
        return False
    ours = [(r["losses"], r["params"]) for r in run["records"]]
    theirs = [(r["losses"], r["params"]) for r in baseline["records"]]
    return ours == theirs and all(params is not None for _, params in ours)


def _hashing(workload: Workload, name: str) -> bool:
    """Params are hashed where a byte-identity check reads them: the mode's, its baseline's."""
    return any(m.expect == "identical" and name in (m.name, m.baseline) for m in workload.modes)


def run_call(
    workload: Workload, names: list[str], args: argparse.Namespace, trees: dict[str, str], earlier: list[dict]
) -> dict:
    """One call: every run of ``names`` in its own process before the deadline. After each
    run, the ``earlier`` calls' results and this one are written to ``args.out`` (a call
    cut short keeps what it measured)."""
    warmup_of = {n: workloads.QUICK_WARMUP if args.quick else workload.mode(n).warmup for n in names}
    measured = workloads.QUICK_MEASURED if args.quick else workloads.MEASURED
    with tempfile.TemporaryDirectory(prefix="bench-suite-") as tmp:
        disk_dir = os.path.abspath(args.disk_dir or os.path.join(tmp, "nvme"))
        os.makedirs(disk_dir, exist_ok=True)
        provenance = harness.provenance(trees, disk_dir)
        call = {
            "id": uuid.uuid4().hex,
            "number": 1,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "quick": args.quick,
            "gpus": args.gpus,
            "provenance": provenance,
            "measured": measured,
            "modes": {n: dataclasses.asdict(workload.mode(n)) for n in names},
            "runs": {},
            "skipped": [],
        }
        result = {"format": FORMAT, "workload": workload.name, "machine": args.machine, "calls": [call]}
        jobs = []
        for name in names:
            mode = workload.mode(name)
            records = Path(tmp) / f"{name}.jsonl"
            env = {
                "PYTHONPATH": str(harness.REPO),
                "PRETRAIN_PROBE_OUT": str(records),
                "PRETRAIN_PROBE_HASH": "1" if _hashing(workload, name) else "0",
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                **workload.env,
            }
            cwd = trees["dev" if mode.dev_fraction is not None else "ours"]
            argv = command(workload, mode, args.gpus, warmup_of[name] + measured, disk_dir, args.quick)
            memory = int(mode.memory_max_gib * workloads.GIB) if mode.memory_max_gib else None
            expected = workloads.run_estimate_s(workload, mode, args.quick)
            jobs.append(harness.Job(name, tuple(argv), cwd, records, env, memory, expected))

        def landed(name: str, run: dict) -> None:
            log = Path(tmp, f"{name}.log")
            run["outcome"] = outcome(run, warmup_of[name] + measured, log.read_text(errors="replace"))
            run["stats"] = harness.iteration_stats(run["records"], warmup_of[name])
            call["runs"][name] = run
            harness.write_json(harness.merge_calls([*earlier, result]), args.out)

        call["skipped"] = harness.run_call(jobs, args.deadline_s, Path(tmp), landed)
    for mode in map(workload.mode, names):
        if mode.expect and mode.name in call["runs"] and not args.quick:  # a smoke run's model expects nothing
            call["runs"][mode.name]["expected"] = expectation(mode, call["runs"])
    harness.write_json(harness.merge_calls([*earlier, result]), args.out)
    return result


def table(call: dict) -> str:
    """The call's runs, one line each: outcome, s/iter, x baseline, peak, saved, vs dev."""
    lines = [f"call {call['number']}: {call['provenance'].get('commit')} dirty={call['provenance'].get('dirty')}"]
    for name, row in compare.summarize(call).items():
        stats = call["runs"][name]["stats"]
        s = stats["s_per_iter"]
        peak = stats["max_reserved_bytes"]
        parts = [f"{name:<28} {row['outcome']}"]
        if s:
            parts.append(f"s/iter {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}, n={s['n']})")
        if row["x_baseline"] is not None:
            parts.append(f"x{row['x_baseline']:.3f}")
        if peak is not None:
            parts.append(f"peak {peak / 2**20:.0f} MiB")
        if row["saved_bytes"] is not None:
            parts.append(f"saved {row['saved_bytes'] / 2**30:.2f} GiB")
        if row["vs_dev"]:
            parts.append(f"vs {row['vs_dev']['dev']} x{row['vs_dev']['ratio']:.3f}")
        expected = call["runs"][name].get("expected")
        if expected is not None:
            parts.append(f"expectation {'met' if expected else 'NOT met'}")
        lines.append("  ".join(parts))
    return "\n".join(lines)


def _check_trees(workload: Workload, names: list[str]) -> dict[str, str]:
    """The trees the runs need, checked before any runs: ours patched where we stream, dev's
    with its chunked offload where a dev mode runs. Refuses in one line otherwise."""
    modes = [workload.mode(n) for n in names]
    tree = os.path.abspath(os.environ.get(TREE_ENV, "") or ".")
    trees = {}
    if any(m.dev_fraction is None for m in modes):
        if not os.path.isfile(os.path.join(tree, "pretrain_gpt.py")):
            raise SystemExit(f"bench.suite: needs {TREE_ENV}, a patched Megatron-LM tree holding pretrain_gpt.py")
        trees["ours"] = tree
    if any(m.ours for m in modes):
        status = subprocess.run(
            [sys.executable, "-m", "megatron_hooks", "status", "--megatron-dir", tree],
            cwd=harness.REPO,
            capture_output=True,
            text=True,
        )
        if status.returncode == 1:
            raise SystemExit(f"bench.suite: {tree} is not patched (make apply-patches MEGATRON_DIR={tree})")
        if status.returncode != 0:
            said = (status.stdout + status.stderr).strip().splitlines()
            raise SystemExit(f"bench.suite: could not check {tree}'s hooks: {said[-1] if said else status.returncode}")
    if any(m.dev_fraction is not None for m in modes):
        if missing := megatron_dev.checkout_missing():
            dev_modes = ", ".join(m.name for m in modes if m.dev_fraction is not None)
            raise SystemExit(f"bench.suite: {dev_modes} {missing}")
        trees["dev"] = os.path.abspath(os.environ[megatron_dev.DEV_DIR_ENV])
    return trees


def measure(args: argparse.Namespace) -> int:
    workload = workloads.WORKLOADS.get(args.workload)
    if workload is None:
        raise SystemExit(f"bench.suite: unknown workload {args.workload!r}; known: {', '.join(workloads.WORKLOADS)}")
    names = [m for m in args.modes.split(",") if m] if args.modes else [m.name for m in workload.modes]
    if unknown := [n for n in names if n not in {m.name for m in workload.modes}]:
        known = ", ".join(m.name for m in workload.modes)
        raise SystemExit(f"bench.suite: {workload.name} has no mode {', '.join(unknown)}; known: {known}")
    args.gpus = args.gpus or workload.gpu_counts[0]
    if args.gpus not in workload.gpu_counts:
        counts = ", ".join(map(str, workload.gpu_counts))
        raise SystemExit(f"bench.suite: {workload.name} runs at {counts} GPUs, not {args.gpus}")
    calls = workloads.plan_calls(workload, names, args.deadline_s, args.quick)
    if args.plan:
        for number, call in enumerate(calls, 1):
            estimate = sum(workloads.run_estimate_s(workload, workload.mode(n), args.quick) for n in call)
            print(f"call {number} (about {estimate:.0f} s): {', '.join(call)}")
        return 0
    if args.call is not None and not 1 <= args.call <= len(calls):
        raise SystemExit(f"bench.suite: --call {args.call}, but the plan has {len(calls)} calls (see --plan)")
    chosen = [calls[args.call - 1]] if args.call else calls
    trees = _check_trees(workload, sorted({n for call in chosen for n in call}))
    args.machine = machine(harness.gpus(), args.gpus)
    args.out = args.out or f"bench-results/{workload.name}-{args.machine}{'-quick' if args.quick else ''}.json"
    results: list[dict] = []
    for call in chosen:
        results.append(run_call(workload, call, args, trees, results))
    merged = harness.merge_calls(results)
    harness.write_json(merged, args.out)
    for call in merged["calls"]:
        print(table(call))
    if args.plot:
        harness.plot(merged, Path(args.out).with_suffix(".png"), workload.title)
    troubles = [
        f"{name}: {run['outcome']}"
        for call in merged["calls"]
        for name, run in call["runs"].items()
        if run.get("expected") is False or (run["outcome"] != compare.OK and run.get("expected") is None)
    ]
    troubles += [f"{name}: not run before the deadline" for call in merged["calls"] for name in call["skipped"]]
    for trouble in troubles:
        print(f"bench.suite: {trouble}", file=sys.stderr)
    return 1 if troubles else 0


def merge(paths: list[str], out: str, plot: bool) -> int:
    """Calls' files of one workload and machine into one result file."""
    results = []
    for path in paths:
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"bench.suite merge: cannot read {path}: {exc}") from None
    merged = harness.merge_calls(results)
    harness.write_json(merged, out)
    print(f"bench.suite merge: {len(merged['calls'])} calls of {merged['workload']} on {merged['machine']} -> {out}")
    if plot:
        harness.plot(merged, Path(out).with_suffix(".png"), workloads.WORKLOADS[merged["workload"]].title)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        parser = argparse.ArgumentParser(prog="bench.suite merge", description=merge.__doc__)
        parser.add_argument("calls", nargs="+")
        parser.add_argument("--out", required=True)
        parser.add_argument("--plot", action="store_true", help="also draw the runs beside --out (.png)")
        args = parser.parse_args(argv[1:])
        return merge(args.calls, args.out, args.plot)
    parser = argparse.ArgumentParser(prog="bench.suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, help=f"one of {', '.join(workloads.WORKLOADS)}")
    parser.add_argument("--modes", default=None, help="comma-separated (default: all of the workload's)")
    parser.add_argument("--gpus", type=int, default=None, help="torchrun processes (default: the workload's first)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a smaller model, 1 + 2 iterations")
    parser.add_argument("--plan", action="store_true", help="print the calls and their estimated seconds, run none")
    parser.add_argument("--call", type=int, default=None, help="run only the K-th call of the plan")
    parser.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S, help="seconds a call may take")
    parser.add_argument("--disk-dir", default=None, help="the disk home's directory (default: a temporary one)")
    parser.add_argument("--out", default=None, help="default: bench-results/<workload>-<machine>.json")
    parser.add_argument("--plot", action="store_true", help="also draw the runs beside --out (.png)")
    return measure(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
