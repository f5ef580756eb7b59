"""``"auto"`` budgets: how much of this rank's host and GPU memory the state may take, measured.

Host (:func:`host_budget`), once, at setup: the least of ``MemAvailable`` and the
room left under every memory limit of this process's cgroup (v2, or v1's memory
controller) and its ancestors, less the margin, divided among this node's ranks
(:func:`local_ranks`). Pinned memory is charged to the cgroup, so this is what
the host home may pin without the kernel's OOM killer stepping in; host memory
something else pins later (another offload, a memory saver's backups) must fit
in the margin.

GPU (:class:`AutoGpuBudget`), after the first step: until then nobody knows the
forward/backward peak, so every bucket starts in its host or disk home. Once
every store of the rank has stepped, the device's largest use so far (the
allocator's ``max_memory_reserved``, plus what other processes, NCCL and the
CUDA context hold now), against what the process may use
(``set_per_process_memory_fraction``'s cap), says what the step never needed;
less the margin, that is the pool. Buckets move to the device from the last one
a step visits backwards, as with a fixed budget. A bucket that moves keeps its
place below (its files, or its host buffer), so giving it back never needs
memory: after each later step, if the use grew past what was seen by more than
an eighth of the margin (a larger batch, longer sequences, a new NCCL
communicator), buckets go back to their places until the growth is covered,
with a warning. The moves run between steps, on the training thread, through
one staging chunk: the step they follow takes that much longer.

What it cannot see: a growth larger than the margin within one step (the
allocation that fails is the model's own: size the margin for it), phases that
did not run before the first step (a checkpoint save, an evaluation), and peaks
hidden by ``torch.cuda.reset_peak_memory_stats`` (warned about when seen).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
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
    """Bytes this process's memory cgroup (and its ancestors) may still charge before a
    limit is hit: the least ``limit - usage`` along the path, under cgroup v2
    (``memory.max``, ``memory.current``) or v1's memory controller
    (``memory.limit_in_bytes``, ``memory.usage_in_bytes``, mounted at ``root/memory``);
    None where no limit applies or no memory cgroup is found."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    v1 = next((path for _, controllers, path in lines if "memory" in controllers.split(",")), None)
    if v1 is not None:
        return _room_along(os.path.join(root, "memory"), v1, "memory.limit_in_bytes", "memory.usage_in_bytes")
    v2 = next((path for hierarchy, controllers, path in lines if hierarchy == "0" and not controllers), None)
    if v2 is not None:
        return _room_along(root, v2, "memory.max", "memory.current")
    return None


def _room_along(root: str, path: str, limit_file: str, usage_file: str) -> int | None:
    room = None
    directory = os.path.join(root, path.lstrip("/"))
    while True:
        try:
            with open(os.path.join(directory, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(directory, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            limit = "max"
        # v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages): count it as none.
        if limit != "max" and int(limit) < 1 << 60:
            left = max(0, int(limit) - usage)
            room = left if room is None else min(room, left)
        if os.path.normpath(directory) == os.path.normpath(root) or not directory.startswith(root):
            return room
        directory = os.path.dirname(directory)


def local_ranks() -> tuple[int, str]:
    """Ranks sharing this node's host memory, and how that was found: torchrun's
    ``LOCAL_WORLD_SIZE``, Slurm's ``SLURM_NTASKS_PER_NODE``, else (an initialized
    process group: every rank calls this) the ranks that report this host's name;
    else 1, this process alone."""
    for variable in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(variable, "").split("(")[0]  # Slurm may write "8(x2)"
        if value.isdigit() and int(value) > 0:
            return int(value), variable
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        hosts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(hosts, socket.gethostname())
        return hosts.count(socket.gethostname()), "ranks on this host in the process group"
    return 1, "one process: no LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE or process group"


def host_budget(margin_bytes: int, *, available: int | None = None, room: int | None = None) -> tuple[int, str]:
    """This rank's share of the host memory pinned state may take, and why (for the log)."""
    available = _meminfo_bytes("MemAvailable") if available is None else available
    room = cgroup_room() if room is None else room
    usable = available if room is None else min(available, room)
    ranks, counted = local_ranks()
    budget = max(0, usable - margin_bytes) // ranks
    limit = "no cgroup memory limit" if room is None else f"{room / GB:.1f} GB left under the cgroup's limit"
    why = (
        f"{available / GB:.1f} GB available, {limit}, less a {margin_bytes / GB:.1f} GB margin, "
        f"shared by {ranks} rank{'s' if ranks > 1 else ''} on this node ({counted})"
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

    def limit(self) -> int:
        """The most this process may use of the device."""

    def used(self) -> int:
        """The largest use so far: this process's peak plus what others hold now."""


class CudaMemory:
    """The CUDA caching allocator's view of one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def limit(self) -> int:
        total = torch.cuda.mem_get_info(self.device)[1]
        # A launcher sharing the GPU (a colocated inference engine) may cap this process's share.
        return min(total, int(total * torch.cuda.get_per_process_memory_fraction(self.device)))

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)  # the CUDA context, NCCL, other processes
        return torch.cuda.max_memory_reserved(self.device) + others


class AutoGpuBudget:
    """The ``gpu`` home's measured budget, shared by a process's stores (a Megatron
    chain has two; :meth:`for_process`). Stores call :meth:`after_step` after each
    step; the work happens after the last registered store's, once per training
    step: the first time, fill the device up to the margin; after that, when the
    use grew past what was seen by more than an eighth of the margin (allocator
    rounding is not growth), give buckets back until the growth is covered."""

    def __init__(self, margin_bytes: int, memory: DeviceMemory | None = None) -> None:
        self.margin = margin_bytes
        self.memory = memory  # None until a store on a CUDA device registers (CudaMemory)
        self.stores: list = []
        self._seen: int | None = None  # the use the gpu home was sized against; None: size it next
        self._last_used = 0  # a smaller use later means the peak statistics were reset
        self._credit = 0  # bytes given back for an offload: the peak still counts them
        self._reset_seen = False  # warned once that someone resets the peak statistics

    @classmethod
    def for_process(cls, margin_bytes: int) -> AutoGpuBudget:
        """The process's one budget (its stores share one device's memory), made on first use."""
        global _PROCESS_BUDGET
        if _PROCESS_BUDGET is None:
            _PROCESS_BUDGET = cls(margin_bytes)
        elif _PROCESS_BUDGET.margin != margin_bytes:
            logger.warning(
                "auto GPU budget: this process's stores share one budget with a %.1f GB margin; a store's %.1f GB "
                "is not used",
                _PROCESS_BUDGET.margin / GB,
                margin_bytes / GB,
            )
        return _PROCESS_BUDGET

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

    def unregister(self, store) -> None:
        """A store closed; with the last one gone, the process's budget starts over."""
        global _PROCESS_BUDGET
        if store in self.stores:
            self.stores.remove(store)
        if not self.stores and _PROCESS_BUDGET is self:
            _PROCESS_BUDGET = None

    def released(self, nbytes: int) -> None:
        """A store gave ``nbytes`` back for an offload (an RL rollout wants the GPU): size
        the home again after the next step, counting them as free although the peak
        statistics still hold them."""
        self._credit += nbytes
        self._seen = None

    def after_step(self, store) -> None:
        if self.memory is None or store is not self.stores[-1] or any(s.steps_taken < 1 for s in self.stores):
            return
        used = self.memory.used()
        if used < self._last_used and self._seen is not None:
            if not self._reset_seen:
                logger.warning(
                    "auto GPU budget: the allocator's peak statistics were reset (reset_peak_memory_stats): "
                    "peaks from before are no longer seen; growth is measured from each reset on"
                )
                self._reset_seen = True
            self._seen = used
        self._last_used = used
        if self._seen is None:
            self._fill(used)
        else:
            self._cover_growth(used)

    def _fill(self, used: int) -> None:
        pool = max(0, self.memory.limit() - used - self.margin + self._credit)
        moved = 0
        try:
            for store in reversed(self.stores):  # the last store's buckets are the last a step visits
                moved += store.move_to_gpu_home(pool - moved)
        finally:
            # What the moves allocate is use the next peak will show; the credit was in the peak already.
            self._seen = max(used, used - self._credit + moved)
            self._credit = 0
        logger.info(
            "auto GPU budget: the largest use so far left %.2f GB beyond the %.1f GB margin; %d buckets "
            "(%.2f GB) now stay on the device",
            pool / GB,
            self.margin / GB,
            sum(s.placement["gpu"] for s in self.stores),
            moved / GB,
        )

    def _cover_growth(self, used: int) -> None:
        growth = used - self._seen
        if growth <= self.margin // 8:
            return  # allocator rounding, or too little to matter yet: it adds up until it is not
        self._seen = used
        freed = 0
        for store in self.stores:  # the first store's device buckets are the first a step visits
            if freed >= growth:
                break
            freed += store.move_from_gpu_home(growth - freed)
        logger.warning(
            "auto GPU budget: the device's use grew by %.2f GB since the budget was set; gave %.2f GB of "
            "buckets back to their host or disk homes to keep the %.1f GB margin%s",
            growth / GB,
            freed / GB,
            self.margin / GB,
            "" if freed >= growth else " (all there were: the margin is what is left)",
        )


_PROCESS_BUDGET: AutoGpuBudget | None = None
