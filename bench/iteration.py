"""Whole iterations of Megatron-LM's own ``pretrain_gpt.py`` on one GPU: every placement of
the optimizer state side by side, and Megatron dev's chunked optimizer-state offload beside
them (issue 26's measurement).

    MEGATRON_LM_DIR=/patched/Megatron-LM [MEGATRON_DEV_DIR=/Megatron-LM-dev] \\
        python -m bench.iteration [--modes resident,auto,...] [--dev-fractions 0,0.5,1] \\
        [--iters 6] [--deadline-s 560] [--disk-dir /nvme/bench] [--out bench-results/iteration.json]
    python -m bench.iteration merge a.json b.json --out all.json [--plot]

The GPT of issue 26: 20 layers, hidden 2048, 16 heads, seq 2048, micro-batch 4, global
batch 32, untied embeddings, ``--transformer-impl local``, mock data, bf16, the distributed
optimizer: 1.15B params, 13.7 GB of fp32 optimizer state. Every run goes through the GPU
tier's harness (``bench.pretrain_probe``: each iteration's step seconds, the device's
peak, where the state lives) and the launcher: ours from ``$MEGATRON_LM_DIR`` with our
flags, dev's from ``$MEGATRON_DEV_DIR`` with ``--chunked-optimizer-state-offload
--optimizer-state-offload-fraction F`` (chunks of ``bench.megatron_dev.DEV_CHUNK_MB``; F = 0
is dev's own baseline, the feature off). Each run imports the ``megatron`` of its tree.

Timing: Megatron's own log, ``elapsed time per iteration (ms)``, the median from the third
iteration on (the second line averages the first two, whose one-time costs it carries);
the step's seconds from the probe, same iterations. Per run: s/iter, x resident (and, for
dev, x dev@0), the step's seconds, and for ours what the step grew beyond resident's
step (the transfers inside the step, ``in_step_s``) and what the iteration grew
(``grown_s``); where the step grew by 0.2 s or more, ``hidden = 1 - grown / in_step``: the share of the step's
transfers that forward/backward hid (about 0 while every transfer sits inside
``optimizer.step()``). An overlap mode ("X+overlap", the window of
``--stream-optimizer-state-overlap-gb``) is judged against its twin X in the same
invocation: ``hidden = 1 - grown / in_step of X``; its ``carried_gb`` is the state its
window held between steps. The probe synchronizes the device after each step to time
it; a window's writes are submitted only at the next forward, so none is waited there.

The codec's conversions (``conversions``): how many of the store's bucket decodes and
encodes, from the third iteration on, replayed from its CUDA graphs and how many ran
eagerly (``StepStats``; "auto-8bit" keeps every bucket in the gpu home in its stored
forms, so its step is the codec and Adam), and in how many of those iterations each
eager one ran so (``eager_slots``: "decode 3", say).

Host memory: the host's ``MemAvailable`` is sampled every half second through each run
(``bench.harness``); ``host_taken_gb`` is its fall at the run's worst.

The disk modes' bound: before the runs and after them, the drive of ``--disk-dir`` is
measured as the disk tier uses it (:func:`drive_seconds_per_gb`: 4 GiB written while
4 GiB are read, direct I/O), in each of ``DRIVE_SHAPES`` (``drive_probes``; after the
runs only before ``--deadline-s``); the fastest probe (``drive``: the strictest bound)
counts. A disk run's ``drive_bound_s`` is that rate times the larger direction of what
its step moves, and ``x_bound`` its s/iter against the larger of that and resident's
forward and backward.

A call of the GPU machine lasts at most 600 s, and a run about one to three minutes: each
invocation runs what fits before ``--deadline-s`` (a run gets the time left, its stop's
grace included, up to ``--run-timeout-s``, and is not started with less than
``MIN_RUN_S``), writes ``--out`` after every run, and its ratios are within the
invocation: give each one ``resident`` (and ``--dev-fractions`` starting with 0 for dev's
own ratios), three or four runs a call; ``merge`` puts invocations side by side, each run
keeping its own invocation's ratios and naming it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import mmap
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.harness import HostSampler

REPO = Path(__file__).resolve().parents[1]
GPT = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 32768 --transformer-impl local "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
    "--no-rope-fusion --no-persist-layer-norm --num-layers 20 --hidden-size 2048 --num-attention-heads 16 "
    "--seq-length 2048 --max-position-embeddings 2048 --untie-embeddings-and-output-weights "
    "--micro-batch-size 4 --global-batch-size 32 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine "
    "--lr-warmup-iters 1 --lr-decay-iters 100 --bf16 --use-distributed-optimizer --log-interval 1 "
    "--eval-iters 0 --eval-interval 100000 --seed 1234 --ckpt-format torch_dist"
).split()
STREAM = ["--stream-optimizer-state-to-disk"]


def _gpu_and_host(
    gpu_gib: str, window: str | None = None, depth: str | None = None, cap: str | None = None
) -> list[str]:
    """Our flags for ``gpu_gib`` GiB in the gpu home and the rest in host memory, with a
    window of ``window`` GiB, ``depth`` buckets in flight and ``cap`` elements per bucket
    where given."""
    flags = [*STREAM, "--stream-optimizer-state-tier", "host", "--stream-optimizer-state-gpu-budget-gb", gpu_gib]
    if window is not None:
        flags += ["--stream-optimizer-state-overlap-gb", window]
    if depth is not None:
        flags += ["--stream-optimizer-state-buckets-in-flight", depth]
    if cap is not None:
        flags += ["--stream-optimizer-state-bucket-cap", cap]
    return flags


# Our placements (after ``--offload-train-disk-dir``). "gpu+host": half the state's 13.7 GB
# (6.4 GiB) in the gpu home, the rest in host memory.
MODES = {
    "resident": [],
    "auto": [
        *STREAM,
        "--stream-optimizer-state-gpu-budget-gb",
        "auto",
        "--stream-optimizer-state-host-budget-gb",
        "auto",
    ],
    "host": [*STREAM, "--stream-optimizer-state-tier", "host"],
    "gpu+host": _gpu_and_host("6.4"),
    "disk": [*STREAM, "--stream-optimizer-state-tier", "disk"],
    "disk-8bit": [
        *STREAM,
        "--stream-optimizer-state-tier",
        "disk",
        "--stream-optimizer-state-main-storage",
        "remainder",
        "--stream-optimizer-state-moment-dtype",
        "8bit",
    ],
}
# The same stored forms with auto budgets: at this size every bucket in the gpu home, so the
# step is the codec's conversions and Adam (issue 26's "codec at memory speed", in training).
MODES["auto-8bit"] = [
    *MODES["auto"],
    "--stream-optimizer-state-main-storage",
    "remainder",
    "--stream-optimizer-state-moment-dtype",
    "8bit",
]
# The overlap window (``--stream-optimizer-state-overlap-gb``) beside each placement: "X+overlap"
# is X with a window of the whole state beyond the gpu home (12.8 GiB materialized), so every
# transfer may leave the step; "host+overlap-3g" holds about what dev at fraction 1 holds
# beyond our host mode (3420 MiB of peak reserved, measured 2026-12-02), "host+overlap-6.5g"
# and "gpu+host+overlap-1g" a little less than dev at fraction 0.5 (7.4 GiB beyond host,
# 1.4 beyond gpu+host); "gpu+host+overlap-1.75g" fills the rest of dev's peak at 0.5 (1g
# peaked 880 MiB below it on 2026-12-02, and each GiB of window adds about one to the peak).
OVERLAP = "+overlap"
MODES.update(
    {
        "host+overlap": [*MODES["host"], "--stream-optimizer-state-overlap-gb", "13"],
        "host+overlap-3g": [*MODES["host"], "--stream-optimizer-state-overlap-gb", "3"],
        "host+overlap-6.5g": [*MODES["host"], "--stream-optimizer-state-overlap-gb", "6.5"],
        "gpu+host+overlap": [*MODES["gpu+host"], "--stream-optimizer-state-overlap-gb", "6.6"],
        "gpu+host+overlap-1g": [*MODES["gpu+host"], "--stream-optimizer-state-overlap-gb", "1"],
        "gpu+host+overlap-1.75g": [*MODES["gpu+host"], "--stream-optimizer-state-overlap-gb", "1.75"],
        "gpu+host+overlap-1.75g-d6": _gpu_and_host("6.4", window="1.75", depth="6"),
        "gpu+host+overlap-1.75g-d4": _gpu_and_host("6.4", window="1.75", depth="4"),
        # Dev's memory at 0.5 spent on a larger gpu home instead of the window: the step is
        # bound by its writes to host memory (6.3 GB at about 52 GB/s, 2026-12-02), and each
        # GiB in the home takes one off them (and off the reads), where the window's reads at
        # the walk's start take none off them.
        "gpu8.15+host-d6": _gpu_and_host("8.15", depth="6"),
        "gpu7.4+host+overlap-0.75g-d6": _gpu_and_host("7.4", window="0.75", depth="6"),
        # At dev's peak at 0.5 (52930-54310 MiB over calls): 6.9 GiB in the home with four in
        # flight (12 of 23 buckets, 53148 MiB), or the shipped home and a window of a few
        # buckets' worth. 6.7 GiB holds the same 12 buckets (2026-12-03): a bucket is a layer's
        # 0.6 GB, so the home moves by 580 MiB of peak at a time. Half the default cap
        # ("-cap32m") halves that step, for a home just under dev's lowest peak.
        "gpu6.7+host-d4": _gpu_and_host("6.7", depth="4"),
        "gpu6.9+host-d4": _gpu_and_host("6.9", depth="4"),
        "gpu6.15+host-d6-cap32m": _gpu_and_host("6.15", depth="6", cap="32000000"),
        "gpu6.35+host-d6-cap32m": _gpu_and_host("6.35", depth="6", cap="32000000"),
        "gpu+host+overlap-0.5g-d6": _gpu_and_host("6.4", window="0.5", depth="6"),
        "disk+overlap": [*MODES["disk"], "--stream-optimizer-state-overlap-gb", "13"],
        "disk-8bit+overlap": [*MODES["disk-8bit"], "--stream-optimizer-state-overlap-gb", "13"],
    }
)
MIN_ITERS = 5  # the median is taken from the third iteration on
RUN_TIMEOUT_S = 300
MIN_RUN_S = 120  # a run is not started with less time than this before the deadline
STOP_GRACE_S = 60  # SIGTERM to torchrun, which stops its workers (they run in sessions of their own)
HIDDEN_FROM_S = 0.2  # a step that grew by less: no share worth stating
ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
MAX_RESERVED = re.compile(r"max reserved: ([0-9.]+)")


def dev_flags(fraction: float) -> list[str]:
    """Megatron dev's chunked optimizer-state offload of ``fraction`` of the state (dev d48bd6be)."""
    return [
        "--chunked-optimizer-state-offload",
        "--optimizer-state-offload-fraction",
        str(fraction),
        "--optimizer-state-offload-chunk-size-mb",
        str(_megatron_dev().DEV_CHUNK_MB),
    ]


def _megatron_dev():
    """``bench.megatron_dev``, imported when wanted (it imports torch; a merge needs none)."""
    from bench import megatron_dev

    return megatron_dev


def command(iters: int, flags: list[str]) -> list[str]:
    """One run: torchrun of the probe (then the launcher) on ``pretrain_gpt.py`` of the tree
    it runs in (its cwd)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone"]
    return [*torchrun, "-m", "bench.pretrain_probe", "pretrain_gpt.py", *GPT, "--train-iters", str(iters), *flags]


def environment(probe_out: Path) -> dict[str, str]:
    """A run's environment: this repository on the path (the probe, the launcher), no other
    (the run's tree, its cwd, gives ``megatron``); one allocator setting for every run."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PRETRAIN_PROBE_OUT": str(probe_out),
        "PRETRAIN_PROBE_HASH": "0",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }


def timings_from_log(log: str) -> dict:
    """Seconds of every iteration Megatron logged, and its last ``max reserved`` (MB)."""
    reserved = MAX_RESERVED.findall(log)
    return {
        "seconds": [float(ms) / 1e3 for ms in ELAPSED.findall(log)],
        "max_reserved_mb_logged": float(reserved[-1]) if reserved else None,
    }


def summarize(runs: dict[str, dict], drive: dict | None = None) -> dict[str, dict]:
    """Per run: s/iter, ratios, the step's seconds and the transfers' share hidden
    (module docstring), from the third iteration on; with ``drive``
    (:func:`drive_seconds_per_gb`), each disk run's bound (:func:`_drive_bounds`)."""
    out: dict[str, dict] = {}
    for name, run in runs.items():
        seconds = run.get("seconds", [])[2:]
        probe = run.get("probe", [])
        steps = [r["step_seconds"] for r in probe[2:]]
        out[name] = {
            "ok": run.get("returncode") == 0 and len(run.get("seconds", [])) == run.get("iters"),
            "s_per_iter": statistics.median(seconds) if seconds else None,
            "step_s": statistics.median(steps) if steps else None,
            "max_reserved_mb": round(max(r["max_reserved_bytes"] for r in probe) / 2**20) if probe else None,
            "max_reserved_mb_logged": run.get("max_reserved_mb_logged"),
            "placement": probe[-1].get("placement") if probe else None,
            # What the run took of the host's memory at its most (MemAvailable's fall).
            "host_taken_gb": _host_taken(run),
            # State the overlap window held between steps (the store's accounting), and its bound.
            "carried_gb": round(probe[-1].get("carried_peak_bytes", 0) / 1e9, 2) if probe else None,
            "overlap_bound_gb": round(probe[-1].get("overlap_bytes_bound", 0) / 1e9, 2) if probe else None,
            # The codec's bucket conversions from the third iteration on: replayed from its CUDA
            # graphs, or eager (whole iterations leave the buckets' addresses repeating or not).
            "conversions": _conversions(probe[2:]),
        }
    _ratios(out, "resident", "x_resident", names=list(out))
    if drive:
        _drive_bounds(out, runs, drive)
    _ratios(out, "megatron-dev@0", "x_dev_off", names=[n for n in out if n.startswith("megatron-dev@")])
    return out


def _conversions(probe: list[dict]) -> dict | None:
    counted = [r["conversions"] for r in probe if "conversions" in r]
    if not counted:
        return None
    summed = {kind: sum(c[kind] for c in counted) for kind in ("replayed", "eager")}
    slots = Counter(slot for c in counted for slot in c.get("eager_slots", ()))  # records since 2026-12-02
    return {**summed, "eager_slots": dict(sorted(slots.items()))} if slots else summed


def _host_taken(run: dict) -> float | None:
    available = run.get("mem_available_gb")
    return round(available["start"] - available["min"], 2) if available else None


def _drive_bounds(out: dict[str, dict], runs: dict[str, dict], drive: dict) -> None:
    """A run whose state is all on disk: the drive's seconds for the bytes its step
    moves (the larger direction, both running at once as measured), and s/iter against
    the larger of that and resident's forward and backward (its s/iter less its step).
    None from a probe the page cache served (``direct`` False)."""
    if not drive.get("direct"):
        return
    base = out.get("resident")
    for name, row in out.items():
        probe = runs[name].get("probe") or []
        placement = (probe[-1].get("placement") or {}) if probe else {}
        if not row["ok"] or not placement.get("disk") or placement.get("gpu") or placement.get("host"):
            continue
        moved = probe[-1]["step_bytes_moved"]
        row["drive_bound_s"] = round(max(moved["read"], moved["written"]) / 1e9 * drive["s_per_gb_each_way"], 3)
        if base and base["ok"]:
            forward_backward = base["s_per_iter"] - base["step_s"]
            row["x_bound"] = round(row["s_per_iter"] / max(forward_backward, row["drive_bound_s"]), 3)


def _ratios(out: dict[str, dict], base_name: str, key: str, names: list[str]) -> None:
    base = out.get(base_name)
    if not base or not base["ok"]:
        return
    for name in names:
        row = out[name]
        if not row["ok"]:
            continue
        row[key] = round(row["s_per_iter"] / base["s_per_iter"], 3)
        ours = not name.startswith("megatron-dev@")  # dev moves state outside its step too
        if key == "x_resident" and ours and row["step_s"] is not None and base["step_s"] is not None:
            row["in_step_s"] = round(row["step_s"] - base["step_s"], 3)
            row["grown_s"] = round(row["s_per_iter"] - base["s_per_iter"], 3)
    for name in names if key == "x_resident" else ():  # every twin's in_step_s is known now
        row = out[name]
        if "grown_s" in row:
            # An overlap mode's transfers are its twin's (the same placement without the
            # window): the share hidden is of what the twin's step spent on them.
            twin = out.get(name.split(OVERLAP)[0]) if OVERLAP in name else row
            if twin and twin.get("in_step_s") is not None and twin["in_step_s"] >= HIDDEN_FROM_S:
                row["hidden"] = round(1 - row["grown_s"] / twin["in_step_s"], 3)


DRIVE_PROBE_BYTES = 4 << 30  # per direction
DRIVE_CHUNK = 16 << 20
# The probe's shapes (request bytes, threads per direction; None: the engine's io_threads):
# the disk tier's, and a deeper queue of larger requests, which this drive ran up to 10%
# faster (one H200 machine, 2026-12-02). The fastest counts: the bound is the drive's best.
DRIVE_SHAPES = ((DRIVE_CHUNK, None), (2 * DRIVE_CHUNK, 8))
DRIVE_PROBES_S = 30  # what probing every shape took on the GPU machine's drive, with room


def drive_seconds_per_gb(
    directory: str, nbytes: int = DRIVE_PROBE_BYTES, threads: int | None = None, chunk: int = DRIVE_CHUNK
) -> dict:
    """The disk directory's drive, as the disk tier uses it: ``nbytes`` written to one
    file while ``nbytes`` are read from another (written first), in ``chunk``-byte
    requests, ``threads`` in flight per direction (default: the engine's ``io_threads``),
    with ``O_DIRECT`` where the filesystem takes it (``direct``; without it the page
    cache is timed, and no bound is drawn from it). Seconds per GB moved each way; a
    failed request fails the probe."""
    from miles_plugins.optimizers.config import DEFAULT_IO_THREADS  # imports torch: not for a merge

    threads = threads or DEFAULT_IO_THREADS
    os.makedirs(directory, exist_ok=True)
    if shutil.disk_usage(directory).free < 2 * nbytes + (1 << 30):
        raise SystemExit(f"bench.iteration: {directory} has no room for the drive probe's {2 * nbytes} bytes")
    paths = [os.path.join(directory, "drive-probe-read"), os.path.join(directory, "drive-probe-write")]
    direct = getattr(os, "O_DIRECT", 0)

    def stream(fd: int, write: bool, buffer, first: int = 0, step: int = 1) -> None:
        view = memoryview(buffer)
        for offset in range(first * chunk, nbytes, step * chunk):
            moved = os.pwritev(fd, [view], offset) if write else os.preadv(fd, [view], offset)
            if moved != chunk:
                raise OSError(f"drive probe: short {'write' if write else 'read'} at {offset}")
        if write:
            os.fsync(fd)

    buffers = [mmap.mmap(-1, chunk) for _ in range(2 * threads)]  # page-aligned, as O_DIRECT needs
    fds: list[int] = []
    try:
        for path in paths:
            try:
                fds.append(os.open(path, os.O_RDWR | os.O_CREAT | direct))
            except OSError:  # a filesystem without O_DIRECT
                direct = 0
                fds.append(os.open(path, os.O_RDWR | os.O_CREAT))
        read_fd, write_fd = fds
        stream(read_fd, True, buffers[0])
        with concurrent.futures.ThreadPoolExecutor(2 * threads) as pool:
            start = time.perf_counter()
            futures = [
                pool.submit(stream, fd, fd == write_fd, buffers[2 * t + (fd == write_fd)], t, threads)
                for fd in fds
                for t in range(threads)
            ]
            for future in futures:
                future.result()  # raises a request's failure
            seconds = time.perf_counter() - start
    finally:
        for fd in fds:
            os.close(fd)
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return {
        "bytes_each_way": nbytes,
        "request_bytes": chunk,
        "threads_each_way": threads,
        "direct": bool(direct),
        "s_per_gb_each_way": round(seconds / (nbytes / 1e9), 4),
    }


def _probe_drive(directory: str, probes: list[dict]) -> dict:
    """Probe the drive in each of ``DRIVE_SHAPES``, adding to ``probes``; the fastest so
    far (a direct one before any through the page cache)."""
    for chunk, threads in DRIVE_SHAPES:
        probes.append(drive_seconds_per_gb(directory, threads=threads, chunk=chunk))
        print(f"[iteration] drive: {probes[-1]}", file=sys.stderr, flush=True)
    return min(probes, key=lambda probe: (not probe["direct"], probe["s_per_gb_each_way"]))


def filesystem_of(path: str) -> str:
    """The type of the filesystem ``path`` lies on (/proc/mounts: a tmpfs would time host RAM)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                mount = fields[1]
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):  # the later of two mounts on one path is in effect
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def _run(name: str, cmd: list[str], cwd: str, env: dict, probe_out: Path, timeout_s: float, iters: int) -> dict:
    print(f"[iteration] {name}: {' '.join(cmd[-10:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    # The log goes to a file, not a pipe: workers torchrun leaves behind would hold a pipe open.
    log_path = probe_out.with_suffix(".log")
    with open(log_path, "w") as log_file, HostSampler() as host:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        stopped = ""
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # torchrun's workers live in sessions of their own: a SIGKILL of torchrun would leave
            # them holding the GPU. SIGTERM makes it stop them first.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_GRACE_S)
            stopped = f"\n[iteration] stopped after {timeout_s:.0f} s"
    log = log_path.read_text(errors="replace") + stopped
    run = {
        "returncode": proc.returncode,
        "iters": iters,
        "wall_s": round(time.perf_counter() - start, 1),
        # The host's MemAvailable at the start and its least during the run (every half second).
        "mem_available_gb": {"start": round(host.samples[0] / 1e9, 2), "min": round(min(host.samples) / 1e9, 2)},
    }
    run.update(timings_from_log(log))
    if probe_out.exists():
        records = []
        for line in probe_out.read_text(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # the last line of a run stopped mid-write
                break
        run["probe"] = records
    if proc.returncode != 0:
        run["log_tail"] = log[-3000:]
    print(f"[iteration] {name}: rc={proc.returncode} s/iter={[round(s, 2) for s in run['seconds']]}", file=sys.stderr)
    return run


def run_timeout(left_s: float, run_timeout_s: float) -> float | None:
    """The time a run may take with ``left_s`` before the deadline (its stop's grace kept
    inside it), or None when too little is left to start one."""
    timeout = min(run_timeout_s, left_s - STOP_GRACE_S)
    return timeout if timeout >= MIN_RUN_S else None


def _check_tree(tree: str, patched: bool) -> None:
    """Refuse before any run: no tree, or (``patched``: streamed modes) a tree without the hooks."""
    if not tree or not os.path.isfile(os.path.join(tree, "pretrain_gpt.py")):
        raise SystemExit("bench.iteration: needs MEGATRON_LM_DIR, a patched Megatron-LM tree holding pretrain_gpt.py")
    if not patched:
        return
    status = subprocess.run(
        [sys.executable, "-m", "megatron_hooks", "status", "--megatron-dir", tree],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if status.returncode == 1:
        raise SystemExit(f"bench.iteration: {tree} is not patched (make apply-patches MEGATRON_DIR={tree})")
    if status.returncode != 0:
        said = (status.stdout + status.stderr).strip().splitlines()
        raise SystemExit(f"bench.iteration: could not check {tree}'s hooks: {said[-1] if said else status.returncode}")


def measure(args: argparse.Namespace) -> None:
    modes = [m for m in args.modes.split(",") if m]
    if len(set(modes)) != len(modes):
        raise SystemExit(f"bench.iteration: a mode given twice in {args.modes!r}")
    if unknown := sorted(set(modes) - set(MODES)):
        raise SystemExit(f"bench.iteration: unknown modes {unknown}; known: {', '.join(MODES)}")
    if args.iters < MIN_ITERS:
        raise SystemExit(f"bench.iteration: --iters must be {MIN_ITERS} or more (the median starts at the third)")
    if args.run_timeout_s < MIN_RUN_S:
        # Else every run would be skipped as "not run before the deadline", whatever the deadline.
        raise SystemExit(f"bench.iteration: --run-timeout-s must be {MIN_RUN_S} or more (no run starts with less)")
    tree = os.environ.get("MEGATRON_LM_DIR", "")
    tree = os.path.abspath(tree) if tree else ""
    if modes:
        _check_tree(tree, patched=any(MODES[m] for m in modes))
    megatron_dev = _megatron_dev()
    dev = os.environ.get(megatron_dev.DEV_DIR_ENV)
    fractions_given = args.dev_fractions is not None
    fractions = [float(f) for f in (args.dev_fractions if fractions_given else "0,0.25,0.5,1").split(",") if f]
    if len(set(fractions)) != len(fractions):
        raise SystemExit(f"bench.iteration: a dev fraction given twice in {args.dev_fractions!r}")
    if fractions and (missing := megatron_dev.checkout_missing()):
        if fractions_given:
            raise SystemExit(f"bench.iteration: {missing}")
        print(f"[iteration] dev runs skipped: {missing}", file=sys.stderr)
        fractions = []
    deadline = time.perf_counter() + args.deadline_s
    report = {"gpt": " ".join(GPT), "iters": args.iters, "runs": {}, "skipped": []}
    with tempfile.TemporaryDirectory(prefix="bench-iteration-") as tmp:
        disk = os.path.abspath(args.disk_dir or os.path.join(tmp, "nvme"))
        report["disk_dir"] = {"path": disk, "filesystem": filesystem_of(disk)}
        plan = [(m, tree, ["--offload-train-disk-dir", disk, *MODES[m]] if MODES[m] else []) for m in modes]
        probes = report["drive_probes"] = []  # before the runs, and after them (below)
        if any("disk" in m for m in modes):
            report["drive"] = _probe_drive(disk, probes)
        plan += [(f"megatron-dev@{f:g}", os.path.abspath(dev), dev_flags(f)) for f in fractions]
        for name, cwd, flags in plan:
            timeout = run_timeout(deadline - time.perf_counter(), args.run_timeout_s)
            if timeout is None:
                report["skipped"].append(name)
                continue
            probe_out = Path(tmp) / f"{name}.jsonl"
            report["runs"][name] = _run(
                name, command(args.iters, flags), cwd, environment(probe_out), probe_out, timeout, args.iters
            )
            report["summary"] = summarize(report["runs"], report.get("drive"))
            _write(report, args.out)  # after every run: a call cut short keeps what it measured
        if probes and time.perf_counter() + DRIVE_PROBES_S < deadline:
            # The drive's speed drifts over a call (its runs wrote tens of GB): probed again,
            # the fastest probe of the call bounds its runs (the strictest bound).
            report["drive"] = _probe_drive(disk, probes)
        elif probes:
            report["skipped"].append("drive probe after the runs")
    report["summary"] = summarize(report["runs"], report.get("drive"))
    _write(report, args.out)
    print(json.dumps(report["summary"], indent=1))
    if report["skipped"]:
        print(f"[iteration] not run before the deadline: {', '.join(report['skipped'])}", file=sys.stderr)


def merge(paths: list[str], out: str, plot: bool) -> None:
    """Invocations side by side: every run keeps its own invocation's ratios; a name seen
    again (each invocation's resident) is suffixed with its invocation's number."""
    merged = {"calls": [], "summary": {}}
    for number, path in enumerate(paths, 1):
        with open(path) as f:
            report = json.load(f)
        merged["calls"].append({"path": path, **report})
        for name, row in report.get("summary", {}).items():
            merged["summary"][name if name not in merged["summary"] else f"{name} (call {number})"] = {
                **row,
                "call": number,  # its ratios are to this call's resident (and dev@0)
            }
    _write(merged, out)
    print(json.dumps(merged["summary"], indent=1))
    if plot:
        _plot(merged["summary"], os.path.splitext(out)[0] + ".png")


def _write(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _plot(summary: dict, path: str) -> None:
    from bench.plotting import pyplot

    plt = pyplot()
    names = [n for n, row in summary.items() if row["ok"]]
    fig, (time_ax, memory_ax) = plt.subplots(2, 1, sharex=True, figsize=(max(6, len(names)), 6))
    time_ax.bar(names, [summary[n]["s_per_iter"] for n in names])
    time_ax.set_ylabel("s / iteration\n(median from the third)")
    time_ax.set_title("pretrain_gpt.py, 1.15B GPT, one GPU")
    memory_ax.bar(names, [summary[n]["max_reserved_mb"] / 1024 for n in names], color="tab:orange")
    memory_ax.set_ylabel("device peak reserved, GiB")
    plt.setp(memory_ax.get_xticklabels(), rotation=35, ha="right")  # long names: anchored at their bar
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        parser = argparse.ArgumentParser(prog="bench.iteration merge", description=merge.__doc__)
        parser.add_argument("reports", nargs="+")
        parser.add_argument("--out", required=True)
        parser.add_argument("--plot", action="store_true", help="also write the runs' s/iter as a PNG beside --out")
        args = parser.parse_args(argv[1:])
        merge(args.reports, args.out, args.plot)
        return
    parser = argparse.ArgumentParser(prog="bench.iteration", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument(
        "--dev-fractions", default=None, help="dev's offload fractions (default 0,0.25,0.5,1 where a checkout is set)"
    )
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--deadline-s", type=float, default=560, help="start no run that could end past this")
    parser.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S)
    parser.add_argument("--disk-dir", default=None, help="our disk tier's directory (a temporary one if not given)")
    parser.add_argument("--out", default="bench-results/iteration.json")
    measure(parser.parse_args(argv))


if __name__ == "__main__":
    main()
