"""What this process can measure of the memory it may use; reads only, decides nothing.

Host: ``MemAvailable`` (:func:`host_room`), the room left under the memory limits
of this process's cgroup and its ancestors (:func:`cgroup_room`, v2 or v1's
memory controller), and the ranks of this node that share its memory
(:func:`local_ranks`, from a process group, the launcher's environment or the
node's GPUs). Device: the CUDA caching allocator's view (:class:`CudaMemory`).
The budgets built on them are in ``auto_budget.py``.
"""

from __future__ import annotations

import logging
import os
import socket

import torch

logger = logging.getLogger(__name__)


def _meminfo_bytes(field: str, path: str = "/proc/meminfo") -> int:
    """One field of ``/proc/meminfo``, in bytes."""
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name == field:
                return int(rest.split()[0]) * 1024  # kB
    raise OSError(f"{path} has no {field}")


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup (and its ancestors) may still charge before a
    limit is hit: the least ``limit - (usage - inactive file cache)`` along the path
    (the kernel reclaims that cache before it kills), under cgroup v2 (``memory.max``,
    ``memory.current``, ``memory.stat``) or v1's memory controller (mounted at
    ``root/memory``); None where no limit applies or no memory cgroup is found."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    v1 = next((path for _, controllers, path in lines if "memory" in controllers.split(",")), None)
    if v1 is not None:
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        return _room_along(os.path.join(root, "memory"), v1, *files)
    v2 = next((path for hierarchy, controllers, path in lines if hierarchy == "0" and not controllers), None)
    if v2 is not None:
        return _room_along(root, v2, "memory.max", "memory.current", "inactive_file")
    return None


def _room_along(root: str, path: str, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
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
            left = max(0, int(limit) - usage + _stat(directory, inactive_key))
            room = left if room is None else min(room, left)
        if os.path.normpath(directory) == os.path.normpath(root) or not directory.startswith(root):
            return room
        directory = os.path.dirname(directory)


def _stat(directory: str, key: str) -> int:
    """One counter of a cgroup's ``memory.stat`` (0 where it is not there)."""
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


# Launcher variables that give the ranks on this node exactly: torchrun's, and
# Open MPI mpirun's (which sets no LOCAL_WORLD_SIZE).
EXACT_LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
# Where the node's GPUs are listed (absent in most containers, where only the GPUs
# this process sees can be counted).
NODE_GPUS = "/proc/driver/nvidia/gpus"


def local_ranks(group: bool = False) -> tuple[int, str]:
    """Ranks sharing this node's host memory, and what decided the count (for the log).

    ``group``: every rank of an initialized process group is here at once (Megatron's
    ``attach``), so the ranks that report this host's name are counted, exactly (a
    collective; it also keeps a rank from pinning before the slowest has measured).
    Otherwise no collective is safe: torchrun's ``LOCAL_WORLD_SIZE`` or Open MPI's
    ``OMPI_COMM_WORLD_LOCAL_SIZE``; else, with a process group of several ranks, the
    larger of Slurm's ``SLURM_NTASKS_PER_NODE`` and one rank per GPU of the node (at
    most the world); else ``SLURM_NTASKS_PER_NODE``; else 1, this process alone."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if group and world > 1:
        hosts = [None] * world
        torch.distributed.all_gather_object(hosts, socket.gethostname())
        return hosts.count(socket.gethostname()), "ranks on this host in the process group"
    for variable in EXACT_LOCAL_SIZE_VARIABLES:
        if count := _count_in(variable):
            return count, variable
    slurm = _count_in("SLURM_NTASKS_PER_NODE")
    if world > 1:
        # Neither count is exact: Slurm's is 1 in every worker of Ray on Slurm (one
        # `ray start` per node); the GPUs are the node's only where NODE_GPUS lists them,
        # elsewhere the ones this process sees, one each under srun. The larger errs
        # toward a smaller share, never toward ranks that together pin more than the node has.
        gpus, which = _gpus_on_this_node()
        if slurm > max(1, gpus):
            return min(world, slurm), "SLURM_NTASKS_PER_NODE"
        return min(world, max(1, gpus)), f"one rank per GPU {which}"
    if slurm:
        return slurm, "SLURM_NTASKS_PER_NODE"
    return 1, "one process: no process group, LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE or SLURM_NTASKS_PER_NODE"


def _count_in(variable: str) -> int:
    """The positive count an environment variable holds, else 0 (Slurm may write "8(x2)")."""
    value = os.environ.get(variable, "").split("(")[0]
    return int(value) if value.isdigit() else 0


def _gpus_on_this_node() -> tuple[int, str]:
    """The node's GPUs, not the ones this process sees (a launcher may hide the others
    with ``CUDA_VISIBLE_DEVICES``, as Ray does per actor), and where they were counted;
    the ones it sees where the node's are not listed."""
    try:
        return len(os.listdir(NODE_GPUS)), f"of this node ({NODE_GPUS})"
    except OSError:
        return torch.cuda.device_count(), (
            f"this process sees (no {NODE_GPUS} here: if the launcher hides the node's other GPUs from each rank, "
            "set LOCAL_WORLD_SIZE)"
        )


def host_room(available: int | None = None, room: int | None = None) -> tuple[int, int | None, int]:
    """MemAvailable, the room left under the cgroup's limit (None without one) and the
    smaller of the two, measured where not given."""
    available = _meminfo_bytes("MemAvailable") if available is None else available
    room = cgroup_room() if room is None else room
    return available, room, available if room is None else min(available, room)


class CudaMemory:
    """The CUDA caching allocator's view of one device, as ``auto_budget.DeviceMemory`` reads it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if self._fraction is None:
            logger.warning(
                "auto GPU budget: this torch has no get_per_process_memory_fraction (torch < 2.6): a cap set "
                "with set_per_process_memory_fraction is not seen; lower the margin's share yourself"
            )

    def peak(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def limit(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)  # the CUDA context, NCCL, other processes
        capped = int(total * (self._fraction(self.device) if self._fraction else 1.0))
        return min(capped, total - others)

    def new_interval(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cache(self) -> None:
        torch.cuda.empty_cache()
