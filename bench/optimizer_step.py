"""Optimizer-step benchmark: every way of streaming the state, side by side in one run.

    python -m bench.optimizer_step [--params N] [--steps K] [--dir DIR] [--regimes constrained,roomy]
                                   [--memory-max-gib G] [--staging-mb 128 | 16,64,256] [--rounds R]
                                   [--out bench-results/optimizer_step.json]

A synthetic model of N bf16 params (4096 x 4096 matrices, smaller for small N) with fp32 grads kept
resident (as Megatron's grad buffer does) is stepped with AdamW in each *mode*,
each in its own process so GPU peaks, RSS and page cache are its own:

- ``resident``: fp32 mains and moments on the device (no streaming);
- ``sync-*``: the simple design (one bucket at a time, buffered I/O, one staging buffer);
- ``pipelined-*``: the pipelined engine with direct I/O; ``rem`` = remainder mains;
  ``fp32`` / ``bf16`` / ``8bit`` = moment storage;
- ``host``: the pipelined engine over the host-RAM tier;
- ``megatron-cpu-offload``: Megatron's ``HybridDeviceOptimizer`` (what
  ``--optimizer-cpu-offload`` builds: CPU AdamW over fp32 copies), with
  megatron-core and a GPU only.

Placement points (``--host-fractions 0,25,50,75,100``, ``--gpu-fractions``,
``--offload-fractions``): ``placed@host<P>`` streams pipelined-fp32 with the
host budget at P% of the stored state (the rest on disk; 100: the host tier),
``placed@gpu<P>`` with the GPU budget at P% (the rest on disk), and
``placed@offload<P>`` with P% in host memory and the rest in the gpu home (no
disk): the split Megatron's offloads make at fraction P/100, which run beside
each ``placed@offload<P>`` in the same run (roomy regime):

- ``megatron-cpu-offload@<P>`` (P > 0) is ``HybridDeviceOptimizer`` with
  ``optimizer_offload_fraction`` P/100 (the rest stepped on the GPU);
- ``megatron-dev-chunked@<P>`` is Megatron-LM dev's chunked optimizer-state
  offload (NVIDIA/Megatron-LM PR #6244, ``--chunked-optimizer-state-offload
  --optimizer-state-offload-fraction`` P/100): the selected fraction of the fp32
  mains and both moments lives in pinned host memory between steps and is
  stepped on the GPU, the moments in ``--dev-chunk-mb`` windows. It is built the
  way dev's training builds it (a one-rank process group, megatron-core's
  ``DistributedDataParallel`` over the bench's params, ``get_megatron_optimizer``
  with the flags; no grad clipping, as in the other modes); P = 0 is dev's full
  disable, the same ``DistributedOptimizer`` with nothing offloaded. The child
  imports dev's ``megatron`` from ``$MEGATRON_DEV_DIR`` (a checkout with the
  feature), put first on its ``PYTHONPATH``; without it, or without a GPU, the
  point is skipped with the reason. Only ``optimizer.step()`` is timed; the
  masters' copy back to the host that dev starts at the next forward
  (``offload_optimizer_state_for_forward``) runs before each step, untimed, and
  is reported as ``offload_for_forward_seconds``. The masters' and first
  chunk's copy in, which dev's training starts during gradient finalization,
  falls inside the step here (there is no backward to hide it behind).

In the constrained regime a point's cgroup limit is raised
by what it pins on purpose. A placed point's bound is its disk bytes at the
measured rates plus its host bytes at ``HOST_GBPS``. ``--plot JSON`` draws step
time against the host fraction into a PNG beside it (needs matplotlib).

``--auto`` adds ``auto`` and ``auto-growing``: pipelined-fp32 with both budgets
measured (``auto_budget.py``) on a device capped at ``--auto-device-gib``
(``set_per_process_memory_fraction``), with ``--auto-activation-gib`` allocated
and freed between steps as a forward/backward would; ``auto-growing`` grows that by
``--auto-growth-gib`` halfway through the timed steps (a larger batch; use
``--steps`` 3 or more). They run in each regime; in the constrained one the host
budget is what the cgroup's limit leaves (nothing is added to it for these modes). They record
where the buckets were before each step and after the last; the targets compare
``auto`` with disk only and say whether ``auto-growing`` stepped on and gave
buckets back.

Two regimes. *constrained*: the disk modes run inside a cgroup v2 whose
``memory.max`` is well below the state, so the page cache cannot hold it (the
regime these runs live in; needs root and the memory controller, else it is
skipped with a note). *roomy*: no limit; buffered I/O is served from page
cache, and the host tier is the answer there.

``--staging-mb`` with several budgets runs every disk mode at each (the first
keeps the mode's name, the others are ``<mode>@<budget>MiB``) and reports the
step at the smallest budget over the step at the largest: what splitting a small
budget among the I/O threads costs.

The disk bound is measured first, in the same directory, with direct I/O
(``bench/disk.py``). Per mode: step seconds (median of K steps after one
warm-up step that creates the moments), bytes moved, GB/s, ratio to the disk
bound, optimizer-state residency on the device, device peak during the step,
host RSS growth, page-cache growth, buckets per home (gpu+host+disk) at the end. The JSON goes to ``--out`` (regimes from
earlier runs with the same size are kept, so two calls can fill it) and a table
is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from bench import disk, megatron_dev
from miles_plugins.optimizers.config import (
    DEFAULT_BUCKET_CAP_ELEMENTS,
    DEFAULT_IO_THREADS,
    DEFAULT_STAGING_BUDGET_MB,
    StreamConfig,
)
from miles_plugins.optimizers.errors import StreamConfigError

WIDTH = 4096
# A pipeline needs buckets to overlap: small models get a smaller cap than the store's default.
MIN_BUCKETS = 16
# Params are WIDTH x WIDTH matrices, or smaller so that a small model still has this many.
MIN_TENSORS = 64
LR, WEIGHT_DECAY, BETAS, EPS = 1e-4, 0.1, (0.9, 0.95), 1e-8
CGROUP_ROOT = "/sys/fs/cgroup"

# mode -> StreamConfig settings (None: not a streamed mode).
MODES: dict[str, dict | None] = {
    "resident": None,
    "sync-fp32": dict(engine="sync"),
    "sync-bf16": dict(engine="sync", moment_dtype="bf16"),
    "pipelined-fp32": dict(),
    "pipelined-bf16": dict(moment_dtype="bf16"),
    "pipelined-rem-fp32": dict(main_storage="remainder"),
    "pipelined-rem-bf16": dict(main_storage="remainder", moment_dtype="bf16"),
    "pipelined-8bit": dict(moment_dtype="8bit"),
    "pipelined-rem-8bit": dict(main_storage="remainder", moment_dtype="8bit"),
    "host": dict(tier="host"),
    "host-rem": dict(tier="host", main_storage="remainder"),
    "megatron-cpu-offload": None,
    # Both budgets measured (auto_budget.py) under a device capped at --auto-device-gib, with a
    # forward/backward stand-in of --auto-activation-gib between steps; "auto-growing" grows it
    # by --auto-growth-gib halfway through the timed steps (a larger batch).
    "auto": dict(gpu_budget_bytes="auto", host_budget_bytes="auto"),
    "auto-growing": dict(gpu_budget_bytes="auto", host_budget_bytes="auto"),
}
AUTO_MODES = ("auto", "auto-growing")
REGIMES = {
    "constrained": [m for m in MODES if m.startswith(("sync", "pipelined"))],
    "roomy": ["resident", "sync-fp32", "pipelined-fp32", "host", "host-rem", "megatron-cpu-offload"],
}

# Placement points: "placed@host<P>", "placed@gpu<P>", "placed@offload<P>", "megatron-cpu-offload@<P>",
# "megatron-dev-chunked@<P>" (see the docstring).
POINT = re.compile(r"(placed@host|placed@gpu|placed@offload|megatron-cpu-offload@|megatron-dev-chunked@)(\d+)")
# Host memory <-> device the host part of a placed point's bound assumes (pinned, over PCIe 5).
HOST_GBPS = 40


def _point(mode: str) -> tuple[str, int] | None:
    """(kind, percent) of a placement point, or None for a plain mode."""
    match = POINT.fullmatch(mode)
    if match is None or int(match.group(2)) > 100:
        return None
    return match.group(1), int(match.group(2))


def _settings(mode: str, params: int) -> dict | None:
    """StreamConfig settings of a streamed mode or point; None for the others."""
    point = _point(mode)
    if point is None:
        return MODES[mode]
    kind, percent = point
    budget = int(percent / 100 * 12 * params)  # of the fp32 state; padding makes 100% a little short
    if kind == "placed@host":
        return dict(tier="host") if percent == 100 else dict(host_budget_bytes=budget)
    if kind == "placed@gpu":
        return dict(gpu_budget_bytes=budget if percent < 100 else 2 * 12 * params)
    if kind == "placed@offload":  # the gpu home takes the rest; what it leaves goes to host, never to disk
        return dict(tier="host", gpu_budget_bytes=12 * params - budget if percent else 2 * 12 * params)
    return None


def _pinned_bytes(mode: str, params: int, bucket_cap: int) -> int:
    """Host memory a mode holds on purpose (a constrained cgroup is raised by it)."""
    point = _point(mode)
    if point is None:
        return 12 * params if mode in ("host", "host-rem", "megatron-cpu-offload") else 0
    kind, percent = point
    # HybridDeviceOptimizer: fp32 param, moments and grad copies on the CPU (16 bytes per param).
    # Dev's chunked offload: the fp32 main and both fp32 moments of each selected param, in pinned
    # buffers it keeps (12 bytes per param). It selects whole params until it reaches the
    # fraction, so it may pass it by one param: under 1/MIN_TENSORS of the state, inside the 5%.
    per_param = {
        "placed@host": 12,
        "placed@gpu": 0,
        "placed@offload": 12,
        "megatron-cpu-offload@": 16,
        "megatron-dev-chunked@": 12,
    }[kind]
    pinned = int(percent / 100 * per_param * params * 1.05)
    if kind == "placed@offload":  # host memory takes what the gpu budget leaves: up to a bucket more
        pinned += 12 * bucket_cap
    return pinned


def _modes_of(
    regime: str, host_fractions: list[int], gpu_fractions: list[int], offload_fractions=(), auto: bool = False
) -> list[str]:
    """A regime's modes, then its placement points: each offload fraction's own point with
    Megatron's two offloads at that fraction beside it (roomy only; dev's chunked offload at
    every fraction, 0 being its full disable), then the host and gpu fractions' points, then
    (``--auto``) the auto modes: constrained, auto sizes the host home by the cgroup's limit."""
    points = []
    for p in offload_fractions:
        points.append(f"placed@offload{p}")
        if regime == "roomy":
            points += [f"megatron-cpu-offload@{p}"] * (p > 0) + [f"megatron-dev-chunked@{p}"]
    points += [f"placed@host{p}" for p in host_fractions] + [f"placed@gpu{p}" for p in gpu_fractions]
    return REGIMES[regime] + points + (list(AUTO_MODES) if auto else [])


# ---- the child: one mode, one process --------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _page_cache_bytes() -> int:
    """Page cache charged to this process's cgroup (v2), else the machine's."""
    with open("/proc/self/cgroup") as f:
        path = f.read().strip().split("::")[-1]
    if path not in ("", "/"):
        with open(os.path.join(CGROUP_ROOT, path.lstrip("/"), "memory.stat")) as f:
            for line in f:
                key, value = line.split()
                if key == "file":
                    return int(value)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def _model(params: int, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """bf16 params of ``params`` elements in all, and their fp32 grads (fixed, resident)."""
    g = torch.Generator(device=device).manual_seed(0)
    size = min(WIDTH * WIDTH, -(-params // MIN_TENSORS))
    tensors, grads, left = [], [], params
    while left > 0:
        n = min(left, size)
        tensors.append((torch.randn(n, generator=g, device=device) * 0.02).to(torch.bfloat16))
        grads.append(torch.randn(n, generator=g, device=device) * 1e-3)
        left -= n
    return tensors, grads


def streamed_store(params: list[torch.Tensor], grads: list[torch.Tensor], config, **adamw):
    """A ``StreamingStore`` over bf16 ``params`` with their fixed fp32 ``grads``: one entry
    each, its main released until the store fills it from the param, stepped by
    AdamW(``adamw``)."""
    from miles_plugins.optimizers.step.adam import backend_for
    from miles_plugins.optimizers.step.entries import Entry
    from miles_plugins.optimizers.store.streaming_store import StreamingStore

    entries = []
    for p in params:
        main = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        main.untyped_storage().resize_(0)
        entries.append(Entry(param=p, main=main, group_index=0))
    grad_of = {id(e.main): g for e, g in zip(entries, grads, strict=True)}
    master = torch.optim.AdamW([e.main for e in entries], **adamw)
    return StreamingStore(
        entries,
        backend_for(master),
        config,
        grad_fn=lambda e: grad_of[id(e.main)],
        copy_to_model=lambda e: e.param.copy_(e.main),
        init_main=lambda p, m: m.copy_(p),
    )


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed_steps(
    step: Callable[[], object],
    steps: int,
    device: torch.device,
    before: Callable[[], None] | None = None,
    reset_peaks: bool = True,
) -> tuple[list[float], int]:
    """Seconds of each of ``steps`` steps, and the device peak over them. ``before`` runs ahead
    of each step, finished and outside the timing and the peak (what a training loop does
    between two steps). Without ``reset_peaks`` (the auto modes) the bench leaves the peak
    statistics to the auto GPU budget, which reads and resets them at each step's end: the
    peak reported is then only what the last interval left, not the step's own."""
    seconds, peak = [], 0
    for _ in range(steps):
        if before is not None:
            before()
            sync_device(device)
        if device.type == "cuda" and reset_peaks:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step()
        sync_device(device)
        seconds.append(time.perf_counter() - start)
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated())
    return seconds, peak


def _auto_margins(args: argparse.Namespace) -> dict:
    return {
        "auto_gpu_margin_bytes": int(args.auto_gpu_margin_gib * 2**30),
        "auto_host_margin_bytes": int(args.auto_host_margin_gib * 2**30),
    }


def _activations(mode: str, args: argparse.Namespace, device: torch.device, store, out: dict) -> Callable[[], None]:
    """The auto modes' stand-in for a forward/backward between two steps: ``--auto-activation-gib``
    allocated on the device and freed (what activations do to the allocator), growing by
    ``--auto-growth-gib`` halfway through the timed steps in ``auto-growing``. Records where
    the buckets were after each step (``placement_before_each_step``)."""
    calls = []
    out["placement_before_each_step"] = placements = []
    grow_from = 1 + args.steps // 2  # the warm-up step's call is the first

    def between() -> None:
        grown = mode == "auto-growing" and len(calls) >= grow_from
        nbytes = int((args.auto_activation_gib + (args.auto_growth_gib if grown else 0)) * 2**30)
        calls.append(nbytes)
        placements.append(store.placement)
        if device.type == "cuda":
            torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)  # touched, then freed

    return between


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    from miles_plugins.optimizers.config import StreamConfig

    device = torch.device(args.device)
    if mode in AUTO_MODES and device.type == "cuda":
        # A device that holds the model, its grads, the activations and a few GiB of state only.
        torch.cuda.set_per_process_memory_fraction(args.auto_device_gib * 2**30 / torch.cuda.mem_get_info()[1])
    params, grads = _model(args.params, device)
    rss_before = _status("VmRSS")
    cache_before = _page_cache_bytes()
    out: dict = {"mode": mode}
    store = None
    between = None  # work a training loop does between two steps, untimed

    if mode == "resident":
        mains = [p.float() for p in params]
        for main, grad in zip(mains, grads, strict=True):
            main.grad = grad
        optimizer = torch.optim.AdamW(mains, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

        def step() -> None:
            optimizer.step()
            for p, main in zip(params, mains, strict=True):
                p.copy_(main)

    elif mode.startswith("megatron-cpu-offload"):
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

        point = _point(mode)

        for p, grad in zip(params, grads, strict=True):
            p.decoupled_grad = grad  # HybridDeviceOptimizer reads fp32 grads from here
        # As megatron.core.optimizer builds it for --optimizer-cpu-offload (offload fraction 1,
        # or --optimizer-offload-fraction's for a point).
        optimizer = HybridDeviceOptimizer(
            [{"params": params}],
            offload_fraction=point[1] / 100 if point else 1.0,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.AdamW,
            overlap_cpu_optimizer_d2h_h2d=True,
            pin_cpu_grads=True,
            pin_cpu_params=True,
            param_update_in_fp32=True,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            betas=BETAS,
            eps=EPS,
        )
        step = optimizer.step

    elif mode.startswith("megatron-dev-chunked"):
        adamw = {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": BETAS, "eps": EPS}
        step, offload_for_forward, planned = megatron_dev.build(
            params, grads, _point(mode)[1] / 100, args.dev_chunk_mb, adamw
        )
        out.update(planned)
        forward_seconds: list[float] = []

        def between() -> None:
            start = time.perf_counter()
            offload_for_forward()
            sync_device(device)
            forward_seconds.append(time.perf_counter() - start)

    else:
        config = StreamConfig(
            directory=args.dir,
            name=f"bench-{os.getpid()}",
            bucket_cap_elements=args.bucket_cap,
            staging_budget_mb=int(args.staging_mb),
            io_threads=args.io_threads,
            **_settings(mode, args.params),
            **(_auto_margins(args) if mode in AUTO_MODES else {}),
        )
        store = streamed_store(params, grads, config, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        step = store.step
        out.update(
            buckets=len(store.buckets),
            buckets_in_flight=config.depth,
            bucket_bytes_max=store.bucket_bytes_max,
            stored_bytes=store.file_bytes_total,
            staging_bytes=config.staging_bytes_total,
            direct_io=store._backing.direct,
            placement=store.placement,
            home_bytes=store.home_bytes,
        )
        if mode in AUTO_MODES:
            between = _activations(mode, args, device, store, out)

    rss_setup = _status("VmRSS")
    with torch.no_grad():
        if mode in AUTO_MODES:
            between()  # a forward/backward before the first step, whose peak auto sizes the GPU home by
        step()  # the warm-up step: creates the moments (and loads the kernels)
        sync_device(device)
        rss_warm = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM restarts from here: the peak of the timed steps alone
        cache_steps = _page_cache_bytes()
        seconds, peak = _timed_steps(step, args.steps, device, before=between, reset_peaks=mode not in AUTO_MODES)
    out.update(
        step_seconds=statistics.median(seconds),
        step_seconds_all=seconds,
        device_peak_bytes=peak or None,
        host_rss_setup_bytes=rss_setup - rss_before,
        host_rss_warmup_bytes=rss_warm - rss_setup,
        host_rss_step_growth_bytes=_status("VmHWM") - rss_warm,
        page_cache_growth_bytes=_page_cache_bytes() - cache_steps,
        page_cache_growth_since_start_bytes=_page_cache_bytes() - cache_before,
    )
    if store is not None:
        out.update(
            bytes_read=store.last_step.bytes_read,
            bytes_written=store.last_step.bytes_written,
            bytes_per_param_read=store.last_step.bytes_read / args.params,
            bytes_per_param_written=store.last_step.bytes_written / args.params,
            state_residency_bytes=store.accounted_max_state_bytes,
            placement_after=store.placement,
        )
        store.close()
    elif mode == "resident":
        out["state_residency_bytes"] = 12 * args.params
    if mode.startswith("megatron-dev-chunked"):
        out["offload_for_forward_seconds"] = statistics.median(forward_seconds)
    return out


# ---- the driver ------------------------------------------------------------------


def _cgroup(limit: int) -> str | None:
    """A fresh child cgroup with ``memory.max = limit``, or None (with the reason printed)."""
    path = os.path.join(CGROUP_ROOT, f"miles-bench-{os.getpid()}")
    try:
        with open(os.path.join(CGROUP_ROOT, "cgroup.subtree_control")) as f:
            if "memory" not in f.read().split():
                with open(os.path.join(CGROUP_ROOT, "cgroup.subtree_control"), "w") as w:
                    w.write("+memory")
        os.mkdir(path)
        with open(os.path.join(path, "memory.max"), "w") as f:
            f.write(str(limit))
    except OSError as exc:
        print(f"constrained regime skipped: cannot make a cgroup v2 with a memory limit ({exc})", flush=True)
        return None
    return path


def _child(mode: str, args: argparse.Namespace, cgroup: str | None, staging_mb: int, limit: int = 0) -> dict:
    if cgroup:
        # What the mode pins on purpose comes on top of the limit that keeps its disk part honest.
        with open(os.path.join(cgroup, "memory.max"), "w") as f:
            f.write(str(limit + _pinned_bytes(mode, args.params, args.bucket_cap)))
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, "-m", "bench.optimizer_step", "--child", mode, "--child-out", result_path]
    cmd += ["--params", str(args.params), "--steps", str(args.steps), "--dir", args.dir, "--device", args.device]
    cmd += [
        "--bucket-cap",
        str(args.bucket_cap),
        "--staging-mb",
        str(staging_mb),
        "--io-threads",
        str(args.io_threads),
        "--dev-chunk-mb",
        str(args.dev_chunk_mb),
    ]
    for name in ("device", "activation", "growth", "gpu_margin", "host_margin"):
        cmd += [f"--auto-{name.replace('_', '-')}-gib", str(getattr(args, f"auto_{name}_gib"))]
    env = None
    point = _point(mode)
    if point and point[0] == "megatron-dev-chunked@":
        # Dev's megatron ahead of any installed megatron-core (the child checks where it came from).
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                filter(None, [os.environ[megatron_dev.DEV_DIR_ENV], os.environ.get("PYTHONPATH")])
            ),
        )
    if cgroup:
        # Join the cgroup before the benchmark process starts, so all its memory is charged there.
        cmd = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cgroup, *cmd]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            return {"mode": mode, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
        with open(result_path) as f:
            return json.load(f)
    finally:
        os.unlink(result_path)


def _outcome(result: dict) -> str:
    """One line for a measurement as it lands: its steps, or why it has none."""
    if "step_seconds_all" in result:
        return "steps " + ", ".join(f"{t:.3f}" for t in result["step_seconds_all"]) + " s"
    return f"no steps: {result.get('skipped') or result.get('error')}"


def _write(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def _available(mode: str, device: torch.device) -> str | None:
    """Why ``mode`` cannot run here, or None."""
    if mode.startswith("megatron-cpu-offload"):
        if device.type != "cuda":
            return "needs a GPU"
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            return "needs megatron-core"
    if mode.startswith("megatron-dev-chunked"):
        if device.type != "cuda":
            return "needs a GPU"
        return megatron_dev.checkout_missing()
    return None


def _derive(result: dict, rates: disk.DiskRates | None) -> None:
    if "bytes_read" not in result or rates is None:
        return
    moved = result["bytes_read"] + result["bytes_written"]
    result["gb_per_s"] = moved / 1e9 / result["step_seconds"]
    if result["mode"].startswith("placed@"):
        # Every bucket is read and written once a step: its disk part at the drive's
        # measured rates, its host part at HOST_GBPS (the gpu part moves on the device).
        held = result["home_bytes"]
        bound = disk.step_bound(rates, held["disk"], held["disk"]) + 2 * held["host"] / (HOST_GBPS * 1e9)
        result["host_fraction"] = held["host"] / max(1, sum(held.values()))
        result["gpu_fraction"] = held["gpu"] / max(1, sum(held.values()))
        result["disk_bound_seconds"] = bound
        result["ratio_to_disk_bound"] = result["step_seconds"] / bound if bound else None
    elif result["mode"].startswith(("sync", "pipelined")):
        bound = disk.step_bound(rates, result["bytes_read"], result["bytes_written"])
        result["disk_bound_seconds"] = bound
        result["ratio_to_disk_bound"] = result["step_seconds"] / bound


def _targets(regimes: dict) -> dict:
    """The issue's targets as ratios over this run's numbers (None where a mode is missing)."""

    def get(regime, mode, key="step_seconds"):
        return (regimes.get(regime, {}).get(mode) or {}).get(key)

    def ratio(a, b):
        return a / b if a is not None and b else None

    resident_peak = get("roomy", "resident", "device_peak_bytes")
    streamed_peak = get("constrained", "pipelined-fp32", "device_peak_bytes") or get(
        "roomy", "pipelined-fp32", "device_peak_bytes"
    )
    split = {}
    for regime, results in regimes.items():
        by_mode: dict[str, dict[int, float]] = {}
        for r in results.values():
            if r.get("staging_budget_mb") and r.get("step_seconds"):
                by_mode.setdefault(r["mode"], {})[r["staging_budget_mb"]] = r["step_seconds"]
        for mode, steps in by_mode.items():
            if len(steps) > 1:
                small, large = min(steps), max(steps)
                split[f"{regime}: {mode} step at {small} MiB staging / at {large} MiB (~1)"] = (
                    steps[small] / steps[large]
                )
    points = {}
    for regime, results in regimes.items():
        for mode, r in results.items():
            point = _point(mode)
            if point and point[0] == "placed@host" and r.get("ratio_to_disk_bound") is not None:
                points[f"{regime}: {mode} step / its bound (<= 1.15)"] = r["ratio_to_disk_bound"]
            if point and point[0] in ("megatron-cpu-offload@", "megatron-dev-chunked@"):
                # The same split of the state: P% in host memory, the rest on the GPU (at 100 the
                # host tier, which placed@host100 also is).
                ours = f"placed@offload{point[1]}"
                if ours not in results and point[1] == 100:
                    ours = "placed@host100"
                points[f"{regime}: {mode} / {ours} (> 1)"] = ratio(get(regime, mode), get(regime, ours))
    growing = regimes.get("constrained", {}).get("auto-growing")
    if growing and "skipped" not in growing:
        points["constrained: auto-growing stepped on after its activations grew (1: no OOM)"] = float(
            "step_seconds" in growing
        )
        filled = (growing.get("placement_before_each_step") or [{}, {}])[1].get("gpu")
        points["constrained: auto-growing gpu buckets after the fill (> 0: the device took some)"] = filled
        points["constrained: auto-growing gpu buckets at the end / after the fill (< 1: gave back)"] = ratio(
            (growing.get("placement_after") or {}).get("gpu"), filled
        )
    return (
        split
        | points
        | {
            "constrained: pipelined-fp32 (disk only) / auto (> 1)": ratio(
                get("constrained", "pipelined-fp32"), get("constrained", "auto")
            ),
            "constrained: pipelined-fp32 step / disk bound (<= 1.1)": get(
                "constrained", "pipelined-fp32", "ratio_to_disk_bound"
            ),
            "constrained: sync-fp32 / pipelined-rem-fp32 (>= 1.2)": ratio(
                get("constrained", "sync-fp32"), get("constrained", "pipelined-rem-fp32")
            ),
            "constrained: sync-bf16 / pipelined-rem-bf16 (>= 1.33)": ratio(
                get("constrained", "sync-bf16"), get("constrained", "pipelined-rem-bf16")
            ),
            "constrained: pipelined-rem-bf16 / pipelined-rem-8bit (>= 1.35)": ratio(
                get("constrained", "pipelined-rem-bf16"), get("constrained", "pipelined-rem-8bit")
            ),
            "constrained: sync-fp32 / pipelined-rem-8bit (>= 3.5)": ratio(
                get("constrained", "sync-fp32"), get("constrained", "pipelined-rem-8bit")
            ),
            "roomy: sync-fp32 (page cache) / host (>= 5)": ratio(get("roomy", "sync-fp32"), get("roomy", "host")),
            "roomy: megatron-cpu-offload / host (> 1)": ratio(
                get("roomy", "megatron-cpu-offload"), get("roomy", "host")
            ),
            "device peak below resident (>= 0.45)": (
                1 - streamed_peak / resident_peak if resident_peak and streamed_peak else None
            ),
        }
    )


def _table(regimes: dict) -> str:
    cols = [
        ("regime", 11, None),
        ("mode", 24, None),
        ("step s", 8, "step_seconds"),
        ("read GB", 8, "bytes_read"),
        ("wrote GB", 8, "bytes_written"),
        ("B/param", 7, "bytes_per_param_read"),
        ("GB/s", 6, "gb_per_s"),
        ("bound s", 8, "disk_bound_seconds"),
        ("x bound", 7, "ratio_to_disk_bound"),
        ("state GB", 8, "state_residency_bytes"),
        ("peak GB", 8, "device_peak_bytes"),
        ("RSS+ MB", 8, "host_rss_step_growth_bytes"),
        ("cache+ MB", 9, "page_cache_growth_bytes"),
        ("gpu+host+disk", 13, "placement_after"),  # buckets per home at the end (auto moves them)
    ]
    scale = {"bytes_read": 1e9, "bytes_written": 1e9, "state_residency_bytes": 1e9, "device_peak_bytes": 1e9}
    scale |= {"host_rss_step_growth_bytes": 1e6, "page_cache_growth_bytes": 1e6}
    lines = [" ".join(name.rjust(width) for name, width, _ in cols)]
    for regime, results in regimes.items():
        for mode, r in results.items():
            cells = [regime.rjust(11), mode.rjust(24)]
            if "error" in r or "skipped" in r:
                cells.append(f"  {r.get('skipped') or r['error']}")
            else:
                for _, width, key in cols[2:]:
                    value = r.get(key)
                    if value is None:
                        text = "-"
                    elif isinstance(value, dict):
                        text = "+".join(str(value[home]) for home in ("gpu", "host", "disk"))
                    else:
                        text = f"{value / scale.get(key, 1):.3g}"
                    cells.append(text.rjust(width))
            lines.append(" ".join(cells))
    return "\n".join(lines)


PLOT_LABELS = {
    "placed@host": "streamed (host + disk)",
    "placed@offload": "streamed (host + gpu)",
    "megatron-cpu-offload@": "Megatron HybridDeviceOptimizer",
    "megatron-dev-chunked@": "Megatron dev chunked state offload (PR #6244)",
}


def plot(path: str) -> str:
    """Step time (log scale) against the fraction of the state in host memory, per
    regime: the placed points and Megatron's two partial offloads, and dev's step plus
    the copy back to the host it defers to the next forward (dashed). Returns the PNG's path."""
    from bench.plotting import pyplot

    plt = pyplot()

    with open(path) as f:
        report = json.load(f)
    figure, axes = plt.subplots(figsize=(7, 5.5), dpi=120)
    for regime, results in report["regimes"].items():
        series: dict[str, list[tuple[float, float]]] = {}
        for mode, r in results.items():
            point = _point(mode)
            if point is None or point[0] == "placed@gpu" or "step_seconds" not in r:
                continue
            x = r.get("host_fraction", point[1] / 100) * 100
            kinds = [point[0]]
            offload_points = any(m.startswith("placed@offload") for m in results)
            if mode == "placed@host100" and offload_points and "placed@offload100" not in results:
                kinds.append("placed@offload")  # the host tier: the end of both of our series
            for kind in kinds:
                series.setdefault(f"{PLOT_LABELS[kind]}, {regime}", []).append((x, r["step_seconds"]))
            if "offload_for_forward_seconds" in r:
                label = f"{PLOT_LABELS[point[0]]}, step + copy back to host, {regime}"
                series.setdefault(label, []).append((x, r["step_seconds"] + r["offload_for_forward_seconds"]))
        for label, points in series.items():
            points.sort()
            style = "--" if "copy back" in label else "-"
            axes.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=label)
    axes.set_yscale("log")
    axes.set_xlabel("optimizer state in host memory (%)")
    axes.set_ylabel("optimizer step (s)")
    axes.set_title(f"{report['params'] / 1e9:.2g}B params on {report.get('device_name', report['device'])}")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)  # below: no point hidden
    out = os.path.splitext(path)[0] + "-placement.png"
    figure.tight_layout()
    figure.savefig(out, bbox_inches="tight")  # the legend below the axes included
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=16_000_000, help="model size in params (default 16M)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode, after one warm-up")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the state files go (node-local NVMe)")
    parser.add_argument("--regimes", default="constrained,roomy")
    parser.add_argument("--modes", default=None, help="comma-separated subset of the modes")
    parser.add_argument(
        "--memory-max-gib",
        type=float,
        default=None,
        help="constrained cgroup limit (default: a quarter of the state, at least 2 GiB)",
    )
    parser.add_argument(
        "--bucket-cap",
        type=int,
        default=None,
        help=f"elements per bucket (default: the store's {DEFAULT_BUCKET_CAP_ELEMENTS}, or less to get {MIN_BUCKETS} buckets)",
    )
    parser.add_argument(
        "--staging-mb",
        default=str(DEFAULT_STAGING_BUDGET_MB),
        help="host staging budget (MiB) of the streamed modes; several (e.g. 16,64,256) run each mode at each",
    )
    parser.add_argument("--io-threads", type=int, default=DEFAULT_IO_THREADS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every (mode, staging budget) this many times, alternating the budgets' order; "
        "steps are the median over all rounds",
    )
    parser.add_argument(
        "--host-fractions",
        default="",
        help="placement points: percents of the state in host memory, the rest on disk, e.g. 0,25,50,75,100",
    )
    parser.add_argument(
        "--gpu-fractions", default="", help="placement points: percents of the state kept on the GPU (the rest on disk)"
    )
    parser.add_argument(
        "--offload-fractions",
        default="",
        help="placement points: percents of the state in host memory, the rest on the GPU, with megatron-cpu-offload "
        "and megatron-dev-chunked at the same fractions beside each in the roomy regime",
    )
    parser.add_argument(
        "--dev-chunk-mb",
        type=int,
        default=megatron_dev.DEV_CHUNK_MB,
        help="--optimizer-state-offload-chunk-size-mb of the megatron-dev-chunked points (default "
        f"{megatron_dev.DEV_CHUNK_MB}; "
        "0: all selected moments at once)",
    )
    parser.add_argument("--auto", action="store_true", help="add the auto modes (measured budgets) to each regime")
    parser.add_argument("--auto-device-gib", type=float, default=24.0, help="auto modes: the device cap (GiB)")
    parser.add_argument("--auto-activation-gib", type=float, default=4.0, help="auto modes: activations (GiB)")
    parser.add_argument(
        "--auto-growth-gib",
        type=float,
        default=2.0,
        help="auto-growing: activation growth (GiB; at the margin, buckets go back)",
    )
    parser.add_argument("--auto-gpu-margin-gib", type=float, default=2.0, help="auto modes: GPU margin (GiB)")
    parser.add_argument("--auto-host-margin-gib", type=float, default=1.0, help="auto modes: host margin (GiB)")
    parser.add_argument("--plot", metavar="JSON", help="draw a result file's placement points into a PNG beside it")
    parser.add_argument("--out", default="bench-results/optimizer_step.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plot:
        if not os.path.isfile(args.plot):
            parser.error(f"--plot {args.plot}: no such results file")
        print(f"wrote {plot(args.plot)}")
        return 0
    try:
        host_fractions = [int(p) for p in args.host_fractions.split(",") if p]
        gpu_fractions = [int(p) for p in args.gpu_fractions.split(",") if p]
        offload_fractions = [int(p) for p in args.offload_fractions.split(",") if p]
    except ValueError:
        parser.error("--host-fractions / --gpu-fractions / --offload-fractions: comma-separated whole percents")
    if any(not 0 <= p <= 100 for p in host_fractions + gpu_fractions + offload_fractions):
        parser.error("--host-fractions / --gpu-fractions / --offload-fractions: percents from 0 to 100")
    if args.params <= 0 or args.steps <= 0:
        parser.error("--params and --steps must be positive")
    if args.dev_chunk_mb < 0:
        parser.error(f"--dev-chunk-mb {args.dev_chunk_mb}: MiB, 0 or more (0: no chunking)")
    if args.bucket_cap is None:
        args.bucket_cap = min(DEFAULT_BUCKET_CAP_ELEMENTS, -(-args.params // MIN_BUCKETS))
    if args.child:
        with open(args.child_out, "w") as f:
            json.dump(run_mode(args.child, args), f)
        return 0

    regimes = [r for r in args.regimes.split(",") if r]
    unknown = [r for r in regimes if r not in REGIMES]
    if unknown:
        parser.error(f"unknown regime(s) {unknown}; choose from {list(REGIMES)}")
    wanted = set(args.modes.split(",")) if args.modes else set(MODES)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    if wanted - set(MODES):
        parser.error(f"unknown mode(s) {sorted(wanted - set(MODES))}; choose from {list(MODES)}")
    if "," in args.dir:
        parser.error(f"--dir {args.dir}: one directory (the bound is one drive's, measured there)")
    if os.path.exists(args.dir) and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir} is not a directory")
    try:
        os.makedirs(args.dir, exist_ok=True)
    except OSError as exc:
        parser.error(f"--dir {args.dir}: {exc.strerror or exc}")
    state_bytes = 12 * args.params
    print(f"{args.params / 1e9:.3g}B params, {state_bytes / 1e9:.3g} GB of fp32 state, on {args.device}", flush=True)
    print(f"measuring the disk under {args.dir} with direct I/O...", flush=True)
    try:
        budgets = list(dict.fromkeys(int(mb) for mb in args.staging_mb.split(",") if mb))
        configs = [StreamConfig(directory=args.dir, staging_budget_mb=mb, io_threads=args.io_threads) for mb in budgets]
    except (ValueError, StreamConfigError) as exc:
        parser.error(f"--staging-mb {args.staging_mb!r} / --io-threads {args.io_threads}: {exc}")
    if not budgets:
        parser.error("--staging-mb names no budget")
    # The bound is measured once, with the first budget's requests.
    chunk, threads = configs[0].staging_bytes, configs[0].transfer_threads
    rates = disk.measure(args.dir, min(state_bytes, 4 << 30), chunk, threads)
    print(
        f"  reads {rates.read / 1e9:.2f} GB/s, writes {rates.write / 1e9:.2f} GB/s; both at once "
        f"{rates.mixed_read / 1e9:.2f} + {rates.mixed_write / 1e9:.2f} GB/s (direct I/O: {rates.direct})",
        flush=True,
    )

    previous = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            previous = json.load(f)
    same_size = previous.get("params") == args.params and previous.get("device") == args.device
    report = {
        "params": args.params,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "steps": args.steps,
        "bucket_cap": args.bucket_cap,
        "memory_max_bytes": previous.get("memory_max_bytes") if same_size else None,
        "regimes": dict(previous.get("regimes", {})) if same_size else {},
        # Per regime: the disk bound measured by the run that measured the regime.
        "disk": dict(previous.get("disk", {})) if same_size else {},
    }
    for regime in regimes:
        cgroup, limit = None, 0
        if regime == "constrained":
            limit = int(args.memory_max_gib * 2**30) if args.memory_max_gib else max(state_bytes // 4, 2 << 30)
            if limit >= state_bytes:
                print(f"warning: memory.max {limit / 2**30:.1f} GiB holds the whole state: not constrained")
            cgroup = _cgroup(limit)
            if cgroup is None:
                report["regimes"][regime] = {"*": {"skipped": "no writable cgroup v2 memory controller"}}
                continue
            report["memory_max_bytes"] = limit
        results = {}
        try:
            for mode in _modes_of(regime, host_fractions, gpu_fractions, offload_fractions, args.auto):
                if mode not in wanted and not _point(mode) and mode not in AUTO_MODES:
                    continue
                why = _available(mode, torch.device(args.device))
                if why:
                    results[mode] = {"mode": mode, "skipped": why}
                    continue
                # Staging matters to the disk modes; the first budget's results keep the
                # bare mode name (the targets read them), the others get "@<budget>MiB".
                # With --rounds, the budgets run again in alternating order (a drive's state
                # drifts within a run), and each one's step is the median over all its steps.
                staged = mode.startswith(("sync", "pipelined"))  # placement points run at the first budget
                order = budgets if staged else budgets[:1]
                for round_index in range(args.rounds):
                    for mb in order if round_index % 2 == 0 else order[::-1]:
                        key = mode if mb == budgets[0] else f"{mode}@{mb}MiB"
                        print(f"[{regime}] {key} (round {round_index + 1} of {args.rounds})...", flush=True)
                        result = _child(mode, args, cgroup, mb, limit)
                        print(f"  {_outcome(result)}", flush=True)
                        if key not in results or "step_seconds_all" not in results[key]:
                            results[key] = result
                        elif "step_seconds_all" in result:  # a failed later round keeps the earlier ones
                            steps = results[key]["step_seconds_all"] + result["step_seconds_all"]
                            results[key].update(step_seconds_all=steps, step_seconds=statistics.median(steps))
                        results[key]["staging_budget_mb"] = mb if _settings(mode, args.params) is not None else None
                        results[key]["rounds"] = round_index + 1
                        # What has been measured so far survives a run cut short (a device's time limit).
                        report["regimes"][regime] = results
                        _write(report, args.out)
                for mb in order:
                    _derive(results[mode if mb == budgets[0] else f"{mode}@{mb}MiB"], rates)
        finally:
            if cgroup:
                os.rmdir(cgroup)
        report["regimes"][regime] = results
        report["disk"][regime] = {"directory": args.dir, **rates.as_dict()}
    report["targets"] = _targets(report["regimes"])
    _write(report, args.out)
    print(_table(report["regimes"]))
    for name, value in report["targets"].items():
        print(f"  {name}: {'-' if value is None else f'{value:.3f}'}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
