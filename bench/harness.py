"""The harness every bench that runs processes shares: one process per measurement, a
deadline per call, a cgroup memory limit where asked, the host's memory watched, the
statistics of a run's iterations, the provenance of a call, the merge of calls and a plot.

A *job* is one process (``torchrun`` of a script, say) that appends one JSON object per
iteration to its records file. A *call* is what one invocation runs before its
deadline: the device machine gives a command at most ``CALL_LIMIT_S``, so a measurement
that needs more is split into calls, each a file of its own, merged afterwards into one
result file (:func:`merge_calls`). Nothing here imports torch: a merge and a plot run
anywhere.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What one command on the device machine may take; a call's runs must end before it.
CALL_LIMIT_S = 600
# SIGTERM first: torchrun stops its workers (they run in sessions of their own) before
# it exits; a SIGKILL of torchrun would leave them holding the GPU.
STOP_GRACE_S = 60
CGROUP_ROOT = Path("/sys/fs/cgroup")
HOST_SAMPLE_S = 0.5


def mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, in bytes."""
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


class HostSampler:
    """``MemAvailable`` when entered and every ``interval_s`` until left (``samples``): the
    GPU tier's and the benches' check that streaming's host memory stays where stated."""

    def __init__(self, interval_s: float = HOST_SAMPLE_S) -> None:
        self.samples: list[int] = []
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.samples.append(mem_available())

    def __enter__(self) -> HostSampler:
        self.samples.append(mem_available())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class Job:
    """One process: ``argv`` run in ``cwd`` with ``env`` added to this process's
    environment, appending one JSON line per iteration to ``records``; inside a cgroup
    whose ``memory.max`` is ``memory_max_bytes`` where given (page cache included). Not
    started with less than ``expected_s`` left before the call's deadline."""

    name: str
    argv: tuple[str, ...]
    cwd: str
    records: Path
    env: dict[str, str] = field(default_factory=dict)
    memory_max_bytes: int | None = None
    expected_s: float = 0.0


def _cgroup(limit: int) -> tuple[Path | None, str]:
    """A fresh child cgroup with ``memory.max = limit``, or None and why not (cgroup v2
    with the memory controller, and root, are needed)."""
    path = CGROUP_ROOT / f"bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        control = CGROUP_ROOT / "cgroup.subtree_control"
        if "memory" not in control.read_text().split():
            control.write_text("+memory")
        path.mkdir()
        (path / "memory.max").write_text(str(limit))
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.rmdir()
        return None, f"no cgroup v2 memory limit here ({exc.strerror or exc})"
    return path, f"memory.max {limit}"


def read_records(path: Path) -> list[dict]:
    """The JSON lines a job appended; a last line cut mid-write (a stopped run) ends them."""
    records = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def run_job(job: Job, timeout_s: float, log_path: Path) -> dict:
    """Run ``job`` to its end or for ``timeout_s`` (then SIGTERM, and SIGKILL to its process
    group after ``STOP_GRACE_S``). Returns its exit status, wall seconds, whether it was
    stopped, its records, the host's MemAvailable at the start and at its lowest, the
    cgroup it ran in, and its log's tail when it failed."""
    argv = list(job.argv)
    cgroup, cgroup_note = (None, "none asked")
    if job.memory_max_bytes:
        cgroup, cgroup_note = _cgroup(job.memory_max_bytes)
        if cgroup is None:
            return {"returncode": None, "error": f"{job.name}: {cgroup_note}", "records": []}
        # The job joins the cgroup before it starts, so all its memory is charged there.
        argv = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *argv]
    start = time.perf_counter()
    stopped = False
    # The log goes to a file, not a pipe: workers a launcher leaves behind would hold a pipe open.
    with open(log_path, "w") as log, HostSampler() as host:
        proc = subprocess.Popen(
            argv,
            cwd=job.cwd,
            env={**os.environ, **job.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=max(timeout_s, 0))
        except subprocess.TimeoutExpired:
            stopped = True
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if cgroup is not None:
        with contextlib.suppress(OSError):
            cgroup.rmdir()
    log_text = log_path.read_text(errors="replace")
    run = {
        "returncode": proc.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
        "stopped": stopped,
        "cgroup": cgroup_note,
        "mem_available_bytes": {"start": host.samples[0], "min": min(host.samples)},
        "records": read_records(job.records),
    }
    if proc.returncode != 0:
        run["log_tail"] = log_text[-3000:]
    return run


def run_timeout(left_s: float, expected_s: float) -> float | None:
    """The time a run may take with ``left_s`` before the call's deadline (its stop's grace
    kept inside), or None when less than ``expected_s`` is left to start one."""
    timeout = left_s - STOP_GRACE_S
    return timeout if timeout > 0 and timeout >= expected_s else None


def run_call(jobs: list[Job], deadline_s: float, workdir: Path, landed: Callable[[str, dict], None]) -> list[str]:
    """Run ``jobs`` in order, each in its own process, none started with less than its
    ``expected_s`` before ``deadline_s`` (seconds from now); ``landed(name, run)`` after
    each (write the call's file there: a call cut short keeps what it measured). Returns
    the names not run before the deadline."""
    deadline = time.perf_counter() + deadline_s
    skipped = []
    for job in jobs:
        timeout = run_timeout(deadline - time.perf_counter(), job.expected_s)
        if timeout is None:
            skipped.append(job.name)
            continue
        print(f"[bench] {job.name}: {' '.join(job.argv[-12:])}", file=sys.stderr, flush=True)
        run = run_job(job, timeout, workdir / f"{job.name}.log")
        print(f"[bench] {job.name}: rc={run['returncode']} iterations={len(run['records'])}", file=sys.stderr)
        landed(job.name, run)
    return skipped


def iteration_stats(records: list[dict], warmup: int) -> dict:
    """A run's figures from its records after ``warmup`` iterations: s/iter (each
    record's ``interval_seconds``, else its ``seconds``) and the step's seconds as
    median, min, max and count; the device's peaks over the whole run (reserved and
    allocated); and where streaming reported them, the last record's bytes moved by the
    step, buckets and bytes per home, and stored bytes."""
    measured = records[warmup:]
    seconds = [r["interval_seconds"] if r.get("interval_seconds") is not None else r["seconds"] for r in measured]
    steps = [r["step_seconds"] for r in measured if r.get("step_seconds") is not None]

    def spread(values: list[float]) -> dict | None:
        if not values:
            return None
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}

    def peak(key: str) -> int | None:
        values = [r[key] for r in records if r.get(key) is not None]
        return max(values) if values else None

    last = records[-1] if records else {}
    return {
        "s_per_iter": spread(seconds),
        "step_s": spread(steps),
        "max_reserved_bytes": peak("max_reserved_bytes"),
        "max_allocated_bytes": peak("max_allocated_bytes"),
        "step_bytes_moved": last.get("step_bytes_moved"),
        "placement": last.get("placement"),
        "home_bytes": last.get("home_bytes"),
        "stored_bytes": last.get("stored_bytes"),
    }


def _git(*args: str, where: Path | str = REPO) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def megatron_version(tree: str) -> str | None:
    """``megatron.core``'s version in a Megatron-LM tree (its ``package_info.py``)."""
    info: dict = {}
    try:
        exec(Path(tree, "megatron", "core", "package_info.py").read_text(), info)
    except (OSError, SyntaxError):
        return None
    version = ".".join(str(info[k]) for k in ("MAJOR", "MINOR", "PATCH") if k in info)
    return version + str(info.get("PRE_RELEASE", "") or "") if version else None


def gpus() -> list[str]:
    """The machine's GPUs by name and memory (``nvidia-smi``), empty without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def drive(path: str) -> dict:
    """The filesystem ``path`` lies on and the model of its block device, where the
    kernel names one (a tmpfs would time host RAM, a network mount the network)."""
    path = os.path.realpath(path)
    mount, kind, source = "", "unknown", ""
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            dev, point, fs = line.split()[:3]
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(mount):  # the later of two mounts on one path is in effect
                mount, kind, source = point, fs, dev
    model = None
    with contextlib.suppress(OSError):
        st = os.stat(path)
        block = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
        for node in (block, block.parent):  # a partition's model is its disk's
            with contextlib.suppress(OSError):
                model = (node / "device" / "model").read_text().strip()
                break
    return {"path": path, "filesystem": kind, "device": source, "model": model}


def provenance(trees: dict[str, str], disk_dir: str | None = None) -> dict:
    """What a call ran on: this repository's commit and whether its tracked files differed
    from it, the Megatron trees (megatron-core version and commit), torch and Python,
    the GPUs, the drive of ``disk_dir``, the host's CPUs and memory."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "trees": {
            name: {
                "path": tree,
                "megatron_core": megatron_version(tree),
                "commit": _git("rev-parse", "HEAD", where=tree),
            }
            for name, tree in trees.items()
        },
        "torch": _package_version("torch"),
        "python": platform.python_version(),
        "gpus": gpus(),
        "drive": drive(disk_dir) if disk_dir else None,
        "cpus": os.cpu_count(),
        "mem_total_bytes": _mem_total(),
    }


def _mem_total() -> int | None:
    with contextlib.suppress(OSError, StopIteration), open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    return None


def merge_calls(results: list[dict]) -> dict:
    """Calls of one workload on one kind of machine, each from its own file, as one
    result: the calls in order, numbered again, a call found twice (same ``id``) kept once.
    Refuses results of different workloads or machines: their figures do not compare."""
    if not results:
        raise SystemExit("bench: nothing to merge")
    keys = ("format", "workload", "machine")
    first = results[0]
    for other in results[1:]:
        if any(other.get(k) != first.get(k) for k in keys):
            theirs, ours = ({k: r.get(k) for k in keys} for r in (other, first))
            raise SystemExit(f"bench: cannot merge {theirs} into {ours}")
    merged = {k: first.get(k) for k in keys}
    seen, calls = set(), []
    for result in results:
        for call in result["calls"]:
            if call["id"] in seen:
                continue
            seen.add(call["id"])
            calls.append({**call, "number": len(calls) + 1})
    merged["calls"] = calls
    return merged


def write_json(data: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or exit saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: dict, path: str | Path, title: str) -> None:
    """Per run of every call, s/iter (median, min to max) above and the device's peak
    reserved memory below, so a mode's spread across calls shows."""
    rows = [
        (f"{name} ({call['number']})", run["stats"])
        for call in result["calls"]
        for name, run in call["runs"].items()
        if run.get("stats", {}).get("s_per_iter")
    ]
    plt = pyplot()
    fig, (time_ax, memory_ax) = plt.subplots(2, 1, sharex=True, figsize=(max(6, 0.6 * len(rows)), 6))
    names = [name for name, _ in rows]
    medians = [s["s_per_iter"]["median"] for _, s in rows]
    low = [m - s["s_per_iter"]["min"] for m, (_, s) in zip(medians, rows, strict=True)]
    high = [s["s_per_iter"]["max"] - m for m, (_, s) in zip(medians, rows, strict=True)]
    time_ax.bar(names, medians, yerr=[low, high], capsize=3)
    time_ax.set_ylabel("s / iteration")
    time_ax.set_title(title)
    memory_ax.bar(names, [(s["max_reserved_bytes"] or 0) / 2**30 for _, s in rows], color="tab:orange")
    memory_ax.set_ylabel("GPU peak reserved, GiB")
    plt.setp(memory_ax.get_xticklabels(), rotation=35, ha="right")
    fig.tight_layout()
    fig.savefig(path)
