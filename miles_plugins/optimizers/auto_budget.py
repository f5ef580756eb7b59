"""``"auto"`` budgets: how much of this rank's host and GPU memory the state may take, measured.

Host (:func:`host_budget`), once, at setup: the least of ``MemAvailable`` and the
room left under every ``memory.max`` of this process's cgroup v2 and its
ancestors, less the margin, divided among this node's ranks (``LOCAL_WORLD_SIZE``,
as torchrun sets it). Pinned memory is charged to the cgroup, so this is what
the host home may pin without the kernel's OOM killer stepping in.

GPU (:class:`AutoGpuBudget`), after the first step: until then nobody knows the
forward/backward peak, so every bucket starts in its host or disk home. Once
every store of the rank has stepped, the device's peak use so far (the
allocator's ``max_memory_reserved``, plus what other processes and the CUDA
context hold, within ``set_per_process_memory_fraction``'s cap) says what the
step never needed; less the margin, that is the pool. Buckets move to the device from the last one a step visits backwards, as
with a fixed budget. A bucket that moves keeps its place below (its files, or
its host buffer), so giving it back never needs memory: after each later step,
if the peak grew past what was seen (a larger batch, longer sequences), buckets
go back to their places until the growth is covered, with a warning. A growth
larger than the margin within one step cannot be caught (the allocation that
fails is the model's own): size the margin for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Protocol

import torch

from miles_plugins.optimizers.config import AUTO

logger = logging.getLogger(__name__)

GB = 1e9


def _meminfo_bytes(field: str, path: str = "/proc/meminfo") -> int:
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name == field:
                return int(rest.split()[0]) * 1024  # kB
    raise OSError(f"{path} has no {field}")


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's cgroup v2 (and its ancestors) may still charge before a
    ``memory.max`` is hit: the least ``max - current`` along the path; None where
    no limit applies or cgroup v2 is not there."""
    try:
        with open(proc_cgroup) as f:
            path = next((line.split("::", 1)[1].strip() for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    if path is None:
        return None
    room = None
    directory = os.path.join(root, path.lstrip("/"))
    while True:
        try:
            with open(os.path.join(directory, "memory.max")) as f:
                limit = f.read().strip()
            with open(os.path.join(directory, "memory.current")) as f:
                current = int(f.read().strip())
        except (OSError, ValueError):
            limit = "max"
        if limit != "max":
            left = max(0, int(limit) - current)
            room = left if room is None else min(room, left)
        if os.path.normpath(directory) == os.path.normpath(root):
            return room
        directory = os.path.dirname(directory)


def local_ranks() -> int:
    """Ranks sharing this node's host memory (torchrun's ``LOCAL_WORLD_SIZE``; 1 without it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def host_budget(margin_bytes: int, *, available: int | None = None, room: int | None = None) -> tuple[int, str]:
    """This rank's share of the host memory pinned state may take, and why (for the log)."""
    available = _meminfo_bytes("MemAvailable") if available is None else available
    room = cgroup_room() if room is None else room
    usable = available if room is None else min(available, room)
    ranks = local_ranks()
    budget = max(0, usable - margin_bytes) // ranks
    limit = "no cgroup memory limit" if room is None else f"{room / GB:.1f} GB left under the cgroup's memory.max"
    why = (
        f"{available / GB:.1f} GB available, {limit}, less a {margin_bytes / GB:.1f} GB margin, "
        f"shared by {ranks} rank{'s' if ranks > 1 else ''} on this node"
    )
    return budget, why


def resolve_host(config):
    """``config`` with an ``"auto"`` host budget measured (:func:`host_budget`), logged."""
    if config.host_budget_bytes != AUTO:
        return config
    budget, why = host_budget(config.auto_host_margin_bytes)
    logger.info("auto host budget: %.2f GB of pinned host memory for this rank (%s)", budget / GB, why)
    return dataclasses.replace(config, host_budget_bytes=budget)


class DeviceMemory(Protocol):
    """What :class:`AutoGpuBudget` reads of the device (:class:`CudaMemory` on CUDA)."""

    def headroom(self) -> int:
        """Bytes the device's largest use so far left free (total less the peak and
        what others hold)."""

    def peak(self) -> int:
        """The largest use so far: grows when the forward/backward peak does."""


class CudaMemory:
    """The CUDA caching allocator's view of one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def headroom(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)  # the CUDA context, NCCL, other processes
        # A launcher sharing the GPU (a colocated inference engine) may cap this process's share.
        capped = int(total * torch.cuda.get_per_process_memory_fraction(self.device))
        return min(total - others, capped) - self.peak()

    def peak(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)


class AutoGpuBudget:
    """One per rank, shared by the rank's stores (a Megatron chain has two): sizes
    the ``gpu`` home once all of them have stepped, then gives buckets back when
    the device's peak grows. Stores call :meth:`after_step` after each step;
    the work happens after the last store's, once per training step."""

    def __init__(self, margin_bytes: int, memory: DeviceMemory | None = None) -> None:
        self.margin = margin_bytes
        self.memory = memory  # None until a store on a CUDA device registers (CudaMemory)
        self.stores: list = []
        self._seen_peak: int | None = None

    def register(self, store, device: torch.device) -> None:
        self.stores.append(store)
        if self.memory is None and device.type == "cuda":
            self.memory = CudaMemory(device)
        if self.memory is None:
            logger.info(
                "auto GPU budget: the state's device is the CPU, whose memory the host budget covers; "
                "nothing is kept in the device home"
            )
        else:
            logger.info(
                "auto GPU budget: decided after the first step, once the forward/backward peak is known "
                "(margin %.1f GB); until then every bucket stays in its host or disk home",
                self.margin / GB,
            )

    def after_step(self, store) -> None:
        if self.memory is None or store is not self.stores[-1] or any(s.steps_taken < 1 for s in self.stores):
            return
        if self._seen_peak is None:
            self._fill()
        else:
            self._cover_growth()

    def _fill(self) -> None:
        pool = max(0, self.memory.headroom() - self.margin)
        peak = self.memory.peak()  # before the moves: what they allocate is counted as moved
        moved = 0
        for store in reversed(self.stores):  # the last store's buckets are the last a step visits
            moved += store.move_to_gpu_home(pool - moved)
        self._seen_peak = peak + moved
        logger.info(
            "auto GPU budget: the peak so far left %.2f GB beyond the %.1f GB margin; %d buckets (%.2f GB) "
            "now stay on the device",
            pool / GB,
            self.margin / GB,
            sum(s.placement["gpu"] for s in self.stores),
            moved / GB,
        )

    def _cover_growth(self) -> None:
        peak = self.memory.peak()
        growth = peak - self._seen_peak
        self._seen_peak = max(peak, self._seen_peak)
        if growth <= 0:
            return
        freed = 0
        for store in self.stores:  # the first store's device buckets are the first a step visits
            if freed >= growth:
                break
            freed += store.move_from_gpu_home(growth - freed)
        logger.warning(
            "auto GPU budget: the device's peak grew by %.2f GB since the budget was set; gave %.2f GB of "
            "buckets back to their host or disk homes to keep the %.1f GB margin%s",
            growth / GB,
            freed / GB,
            self.margin / GB,
            "" if freed >= growth else " (all there were: the margin is what is left)",
        )
