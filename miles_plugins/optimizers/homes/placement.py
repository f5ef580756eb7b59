"""Where each bucket lives between steps: its *home*, decided from the budgets.

Homes (``config.HOMES``): ``gpu`` (the compute device's memory,
:class:`~miles_plugins.optimizers.homes.device_backing.DeviceBacking`), ``host``
(pinned host memory, ``HostBacking``) and ``disk`` (two slots of files,
``FileBacking``). :func:`assign_homes` fills the GPU budget, then the host
budget, from the last bucket a step visits backwards; the rest go to the tier.
The step walks buckets in order, so the disk buckets come first: their reads
start with the prefetch and stream while they compute, and the buckets at home
in memory update at the end, once the disk writes have drained (below). An auto
GPU budget moves buckets between steps (``device_home_moves.py``, one home at a
time: disk buckets from the end of the disk run, then host ones,
:data:`DEVICE_FILL_ORDER`), so the disk home stays the run the walk starts with
while the gpu and host homes may alternate after it.

This module is the policy: it moves no bytes. The backing that routes each
bucket to its home's backing is ``placed_backing.PlacedBacking``.

Each home keeps its failure semantics: the disk home writes a step to the spare
slots and commits at the end; the host and gpu homes write in place, so a step
that fails after updating one of their buckets cannot be rolled back (the store
then refuses to step again). Before the first in-memory bucket is updated the
walk waits for every disk write (``Pipeline``'s ``drain_before``): a failure up
to there rolls back as on disk, except in the writes an overlap window defers
past the step (``store.py``). Stored bytes are the same in every home:
checkpoints do not depend on placement.

With several state directories, :func:`spread_over_directories` deals the disk
buckets round robin over those with room; each directory has its own file
backing and its own I/O threads in the engine (``io_queue``).

Where the directories cannot hold two slots per disk bucket, :func:`plan_disk`
keeps the last disk buckets of the walk in one slot, as many as it takes (they
are written in place: a step that fails after updating one cannot be rolled
back, as for host and gpu buckets). Where even one slot each does not fit, an
auto GPU budget gives the gpu home, at setup, what the device can spare (free
memory after the model, its grads and the released mains, less the margin).
Only when gpu, host and disk together cannot hold the state is it refused,
saying how much is missing.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
from collections.abc import Hashable, Sequence

import torch

from miles_plugins.optimizers.config import HOMES, StreamConfig
from miles_plugins.optimizers.errors import StreamIOError
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.backings import FileBacking
from miles_plugins.optimizers.homes.fs import format_bytes
from miles_plugins.optimizers.homes.scratch import ScratchDir

logger = logging.getLogger(__name__)

# The homes an auto GPU budget takes buckets from, costliest to stream first: a disk
# bucket on the device saves a step its drive transfers, a host one only PCIe.
# Buckets go back in the reverse order.
DEVICE_FILL_ORDER = ("disk", "host")


def assign_homes(buckets: Sequence[BucketLayout], config: StreamConfig) -> tuple[list[str], dict[str, int]]:
    """The home of each bucket (by index), and what is left of each budget: from the
    last bucket backwards, stored sizes fill ``gpu_budget_bytes`` up to the first
    bucket that does not fit, then ``host_budget_bytes`` the same way; the rest go
    to ``tier``. Each home is a run of consecutive buckets (disk, then host, then
    gpu, in walk order), so every disk bucket comes before every in-memory one."""
    left = {"gpu": config.gpu_budget_bytes, "host": config.host_budget_bytes}
    homes = [config.tier] * len(buckets)
    filling = iter(("gpu", "host"))
    home = next(filling)
    for bucket in reversed(buckets):
        while home is not None and bucket.file_size > left[home]:
            home = next(filling, None)
        if home is None:
            break
        left[home] -= bucket.file_size
        homes[bucket.index] = home
    return homes, left


def spread_over_directories(
    buckets: Sequence[BucketLayout],
    homes: Sequence[str],
    free: Sequence[int],
    one_slot: frozenset[int] = frozenset(),
) -> list:
    """The state directory (an index into ``free``, their free bytes) of each disk
    bucket, None for the others: in walk order, round robin over the directories
    with room left for its slots (two, one for those in ``one_slot``), so
    consecutive buckets stream from different drives whatever their sizes; where
    none has room, the one with the most (:func:`plan_disk` counts what is missing)."""
    left = list(free)
    where: list = [None] * len(buckets)
    turn = 0
    for bucket in buckets:
        if homes[bucket.index] != "disk":
            continue
        need = FileBacking.bytes_needed([bucket], one_slot)
        order = [(turn + d) % len(left) for d in range(len(left))]
        i = next((d for d in order if left[d] >= need), max(order, key=lambda d: left[d]))
        left[i] -= need
        where[bucket.index] = i
        turn = i + 1
    return where


def plan_disk(
    buckets: Sequence[BucketLayout], homes: Sequence[str], free: Sequence[int]
) -> tuple[list, frozenset[int], int]:
    """Each disk bucket's directory (:func:`spread_over_directories`), the disk
    buckets kept in one slot, and the bytes the directories still lack. Two slots
    per bucket where the directories hold them; otherwise the last disk buckets of
    the walk keep one, as many as it takes (they come after every two-slot one, so
    a failed step still rolls back up to them)."""
    disk = [b for b in buckets if homes[b.index] == "disk"]
    one_slot: set[int] = set()
    while True:
        kept = frozenset(one_slot)
        where = spread_over_directories(buckets, homes, free, kept)
        used = [0] * len(free)
        for bucket in disk:
            used[where[bucket.index]] += FileBacking.bytes_needed([bucket], kept)
        short = sum(max(0, u - f) for u, f in zip(used, free, strict=True))
        two_slots = [b for b in reversed(disk) if b.index not in kept]
        if not short or not two_slots:
            return where, kept, short
        spared = 0
        for bucket in two_slots:  # from the end of the walk, until the slots given up cover the lack
            one_slot.add(bucket.index)
            spared += bucket.file_size
            if spared >= short:
                break


class Placement:
    """Where one store's buckets live between steps: each bucket's home
    (:func:`assign_homes`, with what is left of each budget), a disk bucket's
    state directory (:func:`spread_over_directories`), and each directory's
    scratch. On the disk tier every directory gets a scratch, used or not: its
    lock keeps another process of the name out, and what a killed run left there
    is purged. Free space is measured once every directory's scratch is locked and
    its stale files purged (what a killed run of this name left is room for this
    one); each scratch checks its own before its files are made. A failure part
    way removes those made. :meth:`remove` removes them all.

    Where the disk is short, the last disk buckets keep one slot (``one_slot``,
    :func:`plan_disk`), and then, with ``gpu_room`` (an auto GPU budget's room at
    setup, :func:`auto_budget.setup_gpu_room`), the gpu home takes what is still
    missing (``setup_gpu_bytes``); what no home can hold is refused. Each of the
    ``config.drive_ranks`` processes sharing the directories plans with its share
    of the free space it measures."""

    def __init__(
        self,
        buckets: Sequence[BucketLayout],
        config: StreamConfig,
        gpu_room: int | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self.homes, self.budgets_left = assign_homes(buckets, config)
        directories = config.directories if config.tier == "disk" else ()
        self.scratches: list[ScratchDir] = []  # one per directory, by index
        self.setup_gpu_bytes = 0
        try:
            for directory in directories:
                self.scratches.append(ScratchDir(directory, config.name))  # locked, stale scratch purged
            # Ranks of a node that share the directories (``config.drive_ranks``) each plan with their share.
            free = [shutil.disk_usage(scratch.directory).free // config.drive_ranks for scratch in self.scratches]
            self.directory_of, self.one_slot, short = plan_disk(buckets, self.homes, free)
            if short and gpu_room:
                short = self._give_the_gpu(config, free, gpu_room, short)
            if short:
                message = _no_room(self, config, free, gpu_room, short)
                raise StreamIOError(message, self.scratches[0].directory, 0, errno.ENOSPC)
            self._log_fallbacks(free, gpu_room)
            for i, scratch in enumerate(self.scratches):
                mine = [b for b in buckets if self.directory_of[b.index] == i]
                scratch.create(FileBacking.bytes_needed(mine, self.one_slot))
        except BaseException:
            self.remove()
            raise
        _warn_about_shared_filesystems([scratch.directory for scratch in self.scratches])

    def _give_the_gpu(self, config: StreamConfig, free: Sequence[int], gpu_room: int, short: int) -> int:
        """Give the gpu home (an auto budget's, empty so far) what the disk lacks, up to
        ``gpu_room``, until the disk holds the rest; returns what is still missing."""
        budget = 0
        while short and budget < gpu_room:
            budget = min(gpu_room, budget + short)
            homes, left = assign_homes(self.buckets, dataclasses.replace(config, gpu_budget_bytes=budget))
            directory_of, one_slot, short = plan_disk(self.buckets, homes, free)
        self.homes, self.directory_of, self.one_slot = homes, directory_of, one_slot
        self.budgets_left = {**left, "gpu": 0}  # an auto budget: nothing for another store to count on
        self.setup_gpu_bytes = self.home_bytes()["gpu"]
        return short

    def _log_fallbacks(self, free: Sequence[int], gpu_room: int | None) -> None:
        if self.one_slot:
            kept = sum(b.file_size for b in self.buckets if b.index in self.one_slot)
            disk = [b for b in self.buckets if self.homes[b.index] == "disk"]
            logger.warning(
                "%s: the state directories have %.2f GB free, two slots per disk bucket need %.2f GB: %d of the "
                "%d disk buckets (%.2f GB) keep one slot, written in place; a step that fails after updating one "
                "of them cannot be rolled back (the store then refuses to go on, as for host and gpu buckets)",
                self.scratches[0].path if self.scratches else "the store",
                sum(free) / 1e9,
                FileBacking.bytes_needed(disk) / 1e9,
                len(self.one_slot),
                len(disk),
                kept / 1e9,
            )
        if self.setup_gpu_bytes:
            logger.warning(
                "host memory and the disk cannot hold the whole state: the gpu home takes %.2f GB of it from setup "
                "on (of %.2f GB the device could spare beyond the auto margin); the first forward and backward "
                "must fit in what is left, and these buckets have no place below to go back to",
                self.setup_gpu_bytes / 1e9,
                gpu_room / 1e9,
            )

    def move(self, index: int, home: str) -> None:
        """Bucket ``index`` now lives in ``home`` (an auto GPU budget moved it)."""
        self.homes[index] = home

    def keys(self) -> list[Hashable]:
        """Each bucket's place, as ``placed_backing.PlacedBacking`` keys it."""
        return [("disk", d) if d is not None else h for h, d in zip(self.homes, self.directory_of, strict=True)]

    def counts(self) -> dict[str, int]:
        """Buckets per home (``gpu``, ``host``, ``disk``)."""
        return {home: self.homes.count(home) for home in HOMES}

    def home_bytes(self) -> dict[str, int]:
        """Stored bytes per home: what the ``gpu`` home holds in device memory between
        steps, the ``host`` home in pinned host memory (the disk home: one slot)."""
        held = dict.fromkeys(HOMES, 0)
        for bucket in self.buckets:
            held[self.homes[bucket.index]] += bucket.file_size
        return held

    def location(self, device: torch.device) -> str:
        """Where the state lives: the scratch directories, host memory, device memory
        (those in use, with their bucket counts when more than one)."""
        places = {"gpu": f"{device.type} memory", "host": "pinned host memory"}
        where = {places[home]: n for home, n in self.counts().items() if n and home != "disk"}
        for i, scratch in enumerate(self.scratches):
            if n := sum(d == i and h == "disk" for d, h in zip(self.directory_of, self.homes, strict=True)):
                where[scratch.path] = n
        if len(where) <= 1:
            return next(iter(where), self.scratches[0].path if self.scratches else places["host"])
        return ", ".join(f"{place} ({n} buckets)" for place, n in where.items())

    def remove(self) -> None:
        for scratch in self.scratches:
            scratch.remove()


def _no_room(placed: Placement, config: StreamConfig, free: Sequence[int], gpu_room: int | None, short: int) -> str:
    """The refusal when no home can hold what is left: what each holds, and what is missing."""
    held = placed.home_bytes()
    gpu = (
        "all an auto GPU budget could spare at setup beyond its margin"
        if gpu_room is not None
        else "its budget; 'auto' would count the device's free memory"
    )
    need, free_total = sum(free) + short, sum(free)
    return (
        f"not enough free space for the optimizer state in {', '.join(s.directory for s in placed.scratches)}: "
        f"it needs {format_bytes(need)} ({need} bytes) for its disk buckets, one slot each, "
        f"{format_bytes(free_total)} ({free_total} bytes) free; nothing was written. The GPU holds "
        f"{format_bytes(held['gpu'])} ({gpu}), host memory {format_bytes(held['host'])} (a budget of "
        f"{format_bytes(config.host_budget_bytes)}). Free {format_bytes(short)} or add a directory on another "
        "drive, give host memory more (--stream-optimizer-state-host-budget-gb, host_budget_bytes), or store "
        "fewer bytes per param (--stream-optimizer-state-main-storage remainder, "
        "--stream-optimizer-state-moment-dtype 8bit)"
    )


def _warn_about_shared_filesystems(directories: list[str]) -> None:
    """Directories on one filesystem share its drive: spreading over them gains nothing."""
    by_device: dict[int, list[str]] = {}
    for directory in directories:
        by_device.setdefault(os.stat(directory).st_dev, []).append(directory)
    for same in by_device.values():
        if len(same) > 1:
            logger.warning(
                "state directories %s are on one filesystem: spreading buckets over them gains no bandwidth; "
                "give one directory per drive",
                ", ".join(same),
            )
