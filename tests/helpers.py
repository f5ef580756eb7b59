"""What several test modules share: the streamed runs of ``reference.Net`` they judge against
the independent reference, their checkpoints, child processes, and the stand-ins for what
this CPU machine lacks (a CUDA allocator's statistics, megatron-core's sharding).

The reference itself stays apart, in ``tests/unit/reference.py``: nothing there touches
the code under test, while everything here drives it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import math
import os
import re
import subprocess
import sys
import types
import zlib
from pathlib import Path

import pytest
import torch

from megatron_hooks.contract import STORE_ATTR
from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
from miles_plugins.optimizers.checkpoint.manifest import CHECKSUM_KEY, checksum
from miles_plugins.optimizers.errors import CheckpointMismatchError
from tests.unit.reference import Net, assert_same_training, between_steps, groups, loss_fn, reference_run, schedule

REPO = str(Path(__file__).resolve().parents[1])

# ---- processes ---------------------------------------------------------------------


def start(module: str, *args: str) -> subprocess.Popen:
    """``python -m module args...`` from the repository root, output captured as text."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_main(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m module args...`` run as the module's ``main`` in this process, read as the
    command would be: exit status (argparse's usage errors exit), stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            returncode = importlib.import_module(module).main(list(args))
        except SystemExit as exit_:
            returncode = exit_.code
    return subprocess.CompletedProcess([module, *args], returncode, out.getvalue(), err.getvalue())


CKPT_MODULE = "miles_plugins.optimizers.ckpt"


def ckpt_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m miles_plugins.optimizers.ckpt args...``, in this process (:func:`run_main`)."""
    return run_main(CKPT_MODULE, *args)


# ---- streamed runs of the reference's model ------------------------------------------

STEPS, SAVE_AT = 22, 12  # SAVE_AT is after the LR drop, before the weight-decay change
CAP = 500  # elements per bucket: six buckets of the test model
# The stated tolerance for bf16 moments: bf16 keeps 8 mantissa bits, so each stored
# moment rounds at ~0.4% relative; the fp32 mains stay within this (absolute) of the
# run with fp32 moments after 20 steps at lr 1e-2.
BF16_MAIN_TOLERANCE = 5e-3


def wrap(directory, model: torch.nn.Module | None = None, **config) -> StreamedOptimizer:
    """A streamed AdamW over ``model`` (a bf16 64x64 linear layer by default)."""
    model = model or torch.nn.Linear(64, 64).to(torch.bfloat16)
    return StreamedOptimizer(torch.optim.AdamW(model.parameters()), StreamConfig(directory=str(directory), **config))


def three_bf16_layers() -> torch.nn.Sequential:
    """Three bf16 256x256 layers without bias, the same weights in every process."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(3))).to(torch.bfloat16)


def streamed_run(opt_cls, dtype, steps, directory, fp32_extra=True, device="cpu", **config):
    """``steps`` streamed steps of ``Net`` on the reference's batches and schedule;
    returns (params, [(main, exp_avg, exp_avg_sq)] in model order, the open optimizer)."""
    model = Net(dtype, fp32_extra).to(device)
    optimizer = opt_cls(groups(model))
    config.setdefault("bucket_cap_elements", 1500)
    config.setdefault("directory", str(directory))
    streamed = StreamedOptimizer(optimizer, StreamConfig(**config))
    scheduler = schedule(optimizer)  # after wrapping, so it wraps the streamed step
    for step in range(steps):
        loss_fn(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
        between_steps(optimizer, scheduler, step)
    by_param = {id(p): (main, m, v) for p, main, m, v in streamed.iter_state()}
    state = [by_param[id(p)] for p in model.parameters()]
    return [p.detach().cpu().clone() for p in model.parameters()], state, streamed


def train(model, optimizer, scheduler, steps) -> None:
    for step in steps:
        loss_fn(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
        between_steps(optimizer, scheduler, step)


def fresh(tmp_path, name, dtype=torch.bfloat16, opt_cls=torch.optim.AdamW, **config):
    """(model, optimizer, scheduler, streamed) before the first step; scratch under ``tmp_path``."""
    model = Net(dtype)
    optimizer = opt_cls(groups(model))
    config.setdefault("bucket_cap_elements", 1500)
    config.setdefault("directory", str(tmp_path / "scratch"))
    streamed = StreamedOptimizer(optimizer, StreamConfig(name=name, **config))
    return model, optimizer, schedule(optimizer), streamed


def state_of(model, streamed):
    """(params, [(main, exp_avg, exp_avg_sq)]) in model order, as ``reference_run`` returns them."""
    by_param = {id(p): (main, m, v) for p, main, m, v in streamed.iter_state()}
    return [p.detach().clone() for p in model.parameters()], [by_param[id(p)] for p in model.parameters()]


def bucket_sizes(fp32_extra: bool = True, **config) -> list[int]:
    """The stored size of each bucket of the test model under ``config`` (held in host memory to see them)."""
    model = Net(torch.bfloat16, fp32_extra)
    streamed = StreamedOptimizer(
        torch.optim.AdamW(groups(model)), StreamConfig(tier="host", bucket_cap_elements=CAP, **config)
    )
    sizes = [b.file_size for b in streamed.store.buckets]
    streamed.close()
    return sizes


def all_three_homes(**config) -> dict:
    """Budgets that put the last bucket on the GPU, the two before it in host memory, the rest on disk."""
    sizes = bucket_sizes(**config)
    assert len(sizes) >= 4, "the test needs a bucket for every home and more"
    return {"bucket_cap_elements": CAP, "gpu_budget_bytes": sizes[-1], "host_budget_bytes": sizes[-2] + sizes[-3]}


# ---- checkpoints ---------------------------------------------------------------------


def save_run(tmp_path, ckpt, **kw):
    """Train SAVE_AT steps and save everything a resume needs; returns the live objects."""
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", **kw)
    train(model, optimizer, scheduler, range(SAVE_AT))
    streamed.save_to(str(ckpt))
    torch.save({"model": model.state_dict(), "scheduler": scheduler.state_dict()}, ckpt / "rest.pt")
    return model, optimizer, scheduler, streamed


def resume(tmp_path, ckpt, **kw):
    """A fresh run holding the model and scheduler ``save_run`` saved; the streamed state is not loaded yet."""
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", **kw)
    rest = torch.load(ckpt / "rest.pt")
    model.load_state_dict(rest["model"])
    scheduler.load_state_dict(rest["scheduler"])  # the groups' lr comes back with the streamed state
    return model, optimizer, scheduler, streamed


def finish_and_save_again(ckpt, model, optimizer, scheduler, streamed) -> None:
    """After a resume at SAVE_AT: the rest of the run must be the uninterrupted
    one, and the next save must leave only the complete save beside rest.pt."""
    assert streamed.store.steps_taken == SAVE_AT
    train(model, optimizer, scheduler, range(SAVE_AT, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.save_to(str(ckpt))
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"], "the next save clears what the failure left"
    streamed.close()


def partial_dirs(ckpt, name: str = "rank0") -> list[Path]:
    """The partial directories of saves of ``name`` in ``ckpt`` (one per saver)."""
    return sorted(Path(ckpt).glob(f".{name}.partial-*"))


def listing(directory) -> list[str]:
    """``directory``'s entries, sorted, each saver's partial directory as ``.<name>.partial-*``."""
    return sorted(re.sub(r"(\.partial)-[^/]+$", r"\1-*", entry) for entry in os.listdir(directory))


def refusal(tmp_path, ckpt, **kw) -> str:
    """The message of the ``CheckpointMismatchError`` a resume under ``kw`` raises loading ``ckpt``."""
    *_, streamed = resume(tmp_path, ckpt, **kw)
    try:
        with pytest.raises(CheckpointMismatchError) as info:
            streamed.load_from(str(ckpt))
    finally:
        streamed.close()
    return str(info.value)


def rewrite_manifest(path, change, sign=True) -> None:
    """Edit a saved manifest with ``change(data)``; with ``sign`` its own checksum is
    recomputed, as a writer that means to be believed would (or a buggy one)."""
    data = json.loads(path.read_text())
    change(data)
    if sign:
        data[CHECKSUM_KEY] = checksum(data)
    path.write_text(json.dumps(data))


def as_format(store, version):
    """A manifest change that makes it one of an older format: one CRC-32 per file
    (before format 3), no checksum of its own (format 1)."""

    def change(data):
        data["format_version"] = version
        del data["crc_block_bytes"]
        if version < 2:
            del data[CHECKSUM_KEY]
        for name, entry in data["files"].items():
            entry["crc32"] = zlib.crc32((store / name).read_bytes())
            del entry["block_crc32"]

    return change


# ---- megatron-core's sharding ----------------------------------------------------------


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def megatron_shards(model, dp: int) -> tuple[list, list[int]]:
    """Per DP rank its pieces, in Megatron's sharding at ``dp``; and each bucket's padded size.
    ``model``: DDP buckets of (param name, numel). The ranges come from megatron-core's own
    ``DistributedOptimizer._build_model_gbuf_param_range_map``; the buffer layout it is given
    follows Megatron's padding rules (each param's start padded to 64 elements, params in
    reverse order, each bucket's end padded to a multiple of lcm(dp, 128))."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    from miles_plugins.optimizers.checkpoint.reshard_plan import Piece

    pieces: list[list[Piece]] = [[] for _ in range(dp)]
    sizes, offset = [], 0
    for bucket in model:
        index_map, start = {}, offset
        for name, numel in reversed(bucket):
            start = _pad(start, 64)
            index_map[name] = (start, start + numel, 0)
            start += numel
        end = _pad(start, math.lcm(dp, 128))
        sizes.append(end - offset)
        shard = (end - offset) // dp
        for rank in range(dp):
            world = Range(offset + rank * shard, offset + (rank + 1) * shard)
            for name, ranges in DistributedOptimizer._build_model_gbuf_param_range_map(
                index_map, world, offset
            ).items():
                pieces[rank].append(Piece(name, ranges["param"].start, ranges["param"].size))
        offset = end
    return pieces, sizes


def megatron_param_layout(model) -> dict:
    """What the Megatron binding records of these buckets (``megatron.param_layout``):
    per bucket, its params in the range maps' order with their start in the bucket."""
    buckets = []
    for index, bucket in enumerate(model):
        params, start = [], 0
        for name, numel in reversed(bucket):
            start = _pad(start, 64)
            params.append([name, start, numel])
            start += numel
        buckets.append({"key": [0, index], "params": params, "size": start})
    return {"buckets": buckets, "pad_for_high_nccl_busbw": False, "ddp_bucket_size": None}


# ---- a CUDA allocator's statistics ------------------------------------------------------

GiB = 1 << 30


class SimulatedDevice:
    """What ``CudaMemory`` reads from the CUDA allocator, modelled as it behaves: a
    device of ``total`` bytes on which a forward/backward uses the activity plus what
    ``held()`` says the gpu home keeps there; the allocator keeps what it reserved
    (cached) until :meth:`release_cache`, and :meth:`new_interval` restarts the peak
    from what is reserved then, cache included, as ``reset_peak_memory_stats`` does."""

    def __init__(self, headroom: int, activity: int = 10 * GiB) -> None:
        self.total, self.activity = activity + headroom, activity
        self.held = lambda: 0
        self.step = lambda: 0  # what a step uses beside the home, where it sets the peak (steps_set_the_peak)
        self._reserved = self._peak = activity

    def steps_set_the_peak(self, store) -> None:
        """From now on ``store``'s steps use the activity (grads, Adam's temporaries: what
        forward and backward leave) plus its buckets in flight: the ``max_in_flight`` largest, each
        its fp32 state, but a bucket of the gpu home only its converted segments (its fp32
        ones share the home's bytes: ``Pipeline._share``)."""

        def step() -> int:
            homes = store.placed.homes
            sizes = [b.converted_bytes if homes[b.index] == "gpu" else b.materialized_bytes for b in store.buckets]
            return self.activity + sum(sorted(sizes, reverse=True)[: store.config.max_in_flight])

        self.step = step

    def peak(self) -> int:
        # The interval's forward/backward, or its step where that uses more.
        self._reserved = max(self._reserved, max(self.activity, self.step()) + self.held())
        self._peak = max(self._peak, self._reserved)
        return self._peak

    def record(self) -> None:
        """The allocator records a peak as it happens (a transient between readings)."""
        self.peak()

    def limit(self) -> int:
        return self.total

    def new_interval(self) -> None:
        self._peak = self._reserved

    def release_cache(self) -> None:
        self._reserved = self.held()  # only what is in use stays reserved

    def grow(self, nbytes: int) -> None:
        """The forward/backward peak grew (a larger batch), or shrank (negative)."""
        self.activity += nbytes


# ---- the checkpoint hooks ------------------------------------------------------------


class Chain:
    """Stands in for Megatron's ChainedOptimizer: only ``chained_optimizers`` is read."""

    def __init__(self, *members):
        self.chained_optimizers = list(members)


def streamed(tmp_path, name, seed):
    """One bf16 param under a StreamedOptimizer that has taken a step, and a stand-in for
    the Megatron optimizer the hooks find its store on: (param, front, holder)."""
    torch.manual_seed(seed)
    param = torch.randn(300, dtype=torch.bfloat16, requires_grad=True)
    optimizer = torch.optim.AdamW([param], lr=1e-2)
    front = StreamedOptimizer(optimizer, StreamConfig(directory=str(tmp_path / "scratch"), name=name))
    holder = types.SimpleNamespace(step=front.step)  # steps as Megatron's optimizer would
    setattr(holder, STORE_ATTR, front.store)
    param.grad = torch.randn_like(param)
    front.step()
    return param, front, holder
