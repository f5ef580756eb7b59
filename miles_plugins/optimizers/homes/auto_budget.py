"""``"auto"`` budgets: how much of this rank's host and GPU memory the state may take, measured.

Host (:func:`host_budget`), once, at setup: the least of ``MemAvailable`` and the
room left under every memory limit of this process's cgroup (v2, or v1's memory
controller) and its ancestors, less the margin, divided among this node's ranks
(``memory_probes.local_ranks``). Pinned memory is charged to the cgroup, so this is what
the host home may pin without the kernel's OOM killer stepping in; host memory
something else pins later (another offload, a memory saver's backups) must fit
in the margin.

GPU (:class:`AutoGpuBudget`), after the first step: until then nobody knows the
forward/backward peak, so every bucket starts in its host or disk home. The
budget keeps what the process needs besides the home (the largest allocator
peak of any interval so far, less the home held in it), plus the home, plus the
margin, within what the process may use. Disk buckets move in first (each saves
a step its drive transfers), from the last one a step visits backwards, then
host buckets; host ones go back first. A bucket that moves keeps its
place below (its files, or its host buffer), so giving it back never needs
memory. The allocator's peak statistics are reset at the end of each interval
(a training step, an offload, a restore). The moves run on the training thread,
through one staging chunk: the step or restore they follow takes that much longer.

What it cannot see: a growth larger than the margin within one step (the
allocation that fails is the model's own: size the margin for it), and phases
that did not run before the first step (a checkpoint save, an evaluation).

This module decides; what it reads of the host and the device comes from
``memory_probes.py``.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import weakref
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from miles_plugins.optimizers.config import AUTO, StreamConfig
from miles_plugins.optimizers.errors import StreamIOError
from miles_plugins.optimizers.homes import memory_probes
from miles_plugins.optimizers.homes.placement import DEVICE_FILL_ORDER, Placement

logger = logging.getLogger(__name__)

GB = 1e9


def host_budget(
    margin_bytes: int, *, available: int | None = None, room: int | None = None, group: bool = False
) -> tuple[int, str]:
    """This rank's share of the host memory pinned state may take, and why (for the log).
    Measured before the ranks are counted: with ``group`` that count is a collective,
    so no rank pins its share before every rank has measured."""
    available, room, usable = memory_probes.host_room(available, room)
    ranks, counted = memory_probes.local_ranks(group)
    budget = max(0, usable - margin_bytes) // ranks
    limit = "no cgroup memory limit" if room is None else f"{room / GB:.1f} GB left under the cgroup's limit"
    why = (
        f"{available / GB:.1f} GB available, {limit}, less a {margin_bytes / GB:.1f} GB margin, "
        f"shared by {ranks} rank{'s' if ranks > 1 else ''} on this node ({counted})"
    )
    return budget, why


def check_host_room(nbytes: int, what: str) -> None:
    """Refuse (``StreamIOError``, ENOMEM) to put ``nbytes`` more in host memory (pinned,
    where CUDA is) when the node does not have them now (MemAvailable, and the cgroup's
    room): pinned pages cannot be swapped, and a node out of memory kills a rank with no
    error. Exact, not cautious: it refuses only what cannot fit (the auto host budget
    left its margin for such memory). Not a share: ranks that pinned before this one
    already lowered MemAvailable, and dividing it again would refuse the last ranks of
    an offload that fits; ranks measuring at the same instant are not counted against
    each other (no collective is safe here)."""
    available, room, usable = memory_probes.host_room()
    if nbytes > usable:
        limit = "" if room is None else f", {room / GB:.2f} GB left under the cgroup's limit"
        raise StreamIOError(
            f"{what} would put {nbytes / GB:.2f} GB in (pinned) host memory; the node has "
            f"{available / GB:.2f} GB available{limit}. Nothing was put there: the buckets stay on the device. "
            "Leave the host room for it (under an auto host budget: a larger "
            "--stream-optimizer-state-auto-host-margin-gb), or keep fewer buckets on the GPU",
            "<host memory>",
            0,
            errno.ENOMEM,
        )


def resolve_host(config: StreamConfig, group: bool = False) -> StreamConfig:
    """``config`` with an ``"auto"`` host budget measured (:func:`host_budget`), logged."""
    if config.host_budget_bytes != AUTO:
        return config
    budget, why = host_budget(config.auto_host_margin_bytes, group=group)
    logger.info("auto host budget: %.2f GB of pinned host memory for this rank (%s)", budget / GB, why)
    return dataclasses.replace(config, host_budget_bytes=budget)


def setup_gpu_room(device: torch.device, margin_bytes: int, releasable_bytes: int) -> int:
    """What a store's gpu home could take at setup, before any step has shown the
    forward/backward peak: the device memory this process may still allocate, plus
    ``releasable_bytes`` (mains the store is about to write out and release), less the
    margin. Used only where host memory and the disk cannot hold the state (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    free = memory_probes.CudaMemory(device).limit() - torch.cuda.memory_allocated(device)
    return max(0, free + releasable_bytes - margin_bytes)


@runtime_checkable
class DeviceMemory(Protocol):
    """What :class:`AutoGpuBudget` reads of the device (``memory_probes.CudaMemory`` on CUDA)."""

    def peak(self) -> int:
        """This process's largest reservation since :meth:`new_interval`."""

    def limit(self) -> int:
        """The most this process may reserve: its cap (``set_per_process_memory_fraction``,
        which counts only its own reservations) or the device less what others hold."""

    def new_interval(self) -> None:
        """Start the next interval's peak from what is reserved now."""

    def release_cache(self) -> None:
        """Give the allocator's cached free blocks back: freed buckets then leave the
        reservation, and new ones get blocks of their own rather than pieces of the
        activations' cached ones."""


@runtime_checkable
class BudgetedStore(Protocol):
    """What :class:`AutoGpuBudget` reads and calls of each store it serves (a ``StreamingStore``)."""

    placed: Placement  # where its buckets live; ``setup_gpu_bytes``: the gpu home's part with no place below

    @property
    def home_bytes(self) -> dict[str, int]:
        """Stored bytes per home; ``"gpu"``: what the store holds in device memory between steps."""

    @property
    def placement(self) -> dict[str, int]:
        """Buckets per home."""

    def move_to_gpu_home(self, budget: int, home: str) -> tuple[int, bool]:
        """Move buckets of ``home`` into the gpu home within ``budget`` bytes; the bytes
        moved, and whether device memory ran out."""

    def move_from_gpu_home(self, nbytes: int, home: str) -> int:
        """Give buckets whose place below is ``home`` back to it until ``nbytes`` are freed;
        the bytes freed."""


class AutoGpuBudget:
    """The ``gpu`` home's measured budget, one per device of a process, shared by the
    stores there (a Megatron chain's, several ``StreamedOptimizer``'s:
    :meth:`for_device`). It keeps one invariant: what the process needs besides the
    home, plus the home, plus the margin, fits the device.

    - *Need*: the largest peak, over the intervals read so far, less the home held in
      that interval. An interval ends at each training step (after the chain's last
      store), at an offload and at a restore; the allocator's peak statistics are
      reset at each end, so ``max_memory_reserved`` then describes the last interval.
      A need never shrinks: a batch that was once larger may come again.
    - *Limit*: the cap or the device less others, read after a training step (not
      while a colocated engine may hold memory during a rollout).
    - Fill (free = limit - need - home, beyond the margin) once every store has
      stepped; again after a store joins or closes, and at a restore after an
      offload (when the rollout before ran more than one step: with one, the moves
      would cost what the step saves).
    - After every other step: when free is below the margin by more than an eighth
      of it, buckets go back until it is not, each counted by its bytes in the home.
      Where the step sets the peak and fewer buckets stream than fit in flight, a
      bucket given back frees less there than that (its fp32 state shared the
      home's bytes; now it is materialized in flight): more go back at the next
      steps, each within the margin. Counting the other way would give back up
      to ``max_in_flight`` buckets too many where forward and backward set the peak.
    """

    def __init__(self, margin_bytes: int, memory: DeviceMemory | None = None) -> None:
        self.margin = margin_bytes
        self.memory = memory  # None until a store on a CUDA device registers (a CudaMemory)
        self._stores: list[weakref.ref] = []  # a store dropped without close() does not hold the rest up
        self._stepped: weakref.WeakSet = weakref.WeakSet()  # stores that stepped in this process
        self._need = 0
        self._limit = 0
        self._filled = False  # the home was sized once: from then on, shrinks are covered
        self._refill = False  # fill again after the next step (a store joined or closed)
        self._refill_on_restore = False  # an offload gave the home back: fill when it is restored
        self._steps_since_restore = 0
        self._warned: set[str] = set()
        self.free_at_last_fill: int | None = None  # what the last fill saw free (logs, tests)

    @classmethod
    def for_device(cls, device: torch.device, margin_bytes: int) -> AutoGpuBudget:
        """The budget of ``device`` in this process, made on first use; the largest
        margin asked for wins."""
        budget = _BUDGETS.get(str(device))
        if budget is None:
            budget = _BUDGETS[str(device)] = cls(margin_bytes)
        elif margin_bytes > budget.margin:
            logger.info("auto GPU budget: margin raised to %.1f GB by a store that asks for it", margin_bytes / GB)
            budget.margin = margin_bytes
        return budget

    @property
    def stores(self) -> list[BudgetedStore]:
        return [store for ref in self._stores if (store := ref()) is not None]

    def register(self, store: BudgetedStore, device: torch.device) -> None:
        self._stores.append(weakref.ref(store))
        self._refill = True  # a store that joins gets its share at the next fill
        if self.memory is None and device.type == "cuda":
            self.memory = memory_probes.CudaMemory(device)
        if self.memory is not None and not self._stepped:
            # The first interval starts at the last registration before any store steps: a peak
            # from before (loading a checkpoint, the model's initialization, the mains an earlier
            # store of the chain wrote out) is no part of what training needs besides the home. The
            # freed blocks go back first: they stay reserved otherwise, and the peak is read from
            # reserved memory (a model build's cached blocks would count as training's need).
            self.memory.release_cache()
            self.memory.new_interval()
        if self.memory is None:
            logger.info(
                "auto GPU budget: the state's device is the CPU, whose memory the host budget covers; "
                "nothing is kept in the device home"
            )
        else:
            logger.info(
                "auto GPU budget: decided after the first step, once the forward/backward peak is known "
                "(margin %.1f GB); until then every bucket stays in its host or disk home. The allocator's peak "
                "statistics are reset at each step from then on",
                self.margin / GB,
            )

    def unregister(self, store: BudgetedStore) -> None:
        """A store closed; with the last one gone, the device's budget starts over."""
        self._refill = True
        self._stores = [ref for ref in self._stores if ref() not in (None, store)]
        if not self._stores:
            for key, budget in list(_BUDGETS.items()):
                if budget is self:
                    del _BUDGETS[key]

    def _home(self, stores: list[BudgetedStore]) -> int:
        return sum(s.home_bytes["gpu"] for s in stores)

    def _read(self, stores: list[BudgetedStore]) -> None:
        """End an interval: what it needed besides the home it held."""
        self._need = max(self._need, self.memory.peak() - self._home(stores))

    def after_step(self, store: BudgetedStore) -> None:
        self._stepped.add(store)
        stores = self.stores
        # Once per training step, after the chain's last store; while a store that joined
        # has not stepped yet, after every store's (shrinks are covered meanwhile).
        if self.memory is None or not stores or (store is not stores[-1] and stores[-1] in self._stepped):
            return
        self._limit = self.memory.limit()
        self._read(stores)
        self._steps_since_restore += 1
        free = self._limit - self._need - self._home(stores)
        try:
            if not (self._filled and self._cover(stores, free)):
                if (not self._filled or self._refill) and all(s in self._stepped for s in stores):
                    self._fill(stores, free)
        finally:
            self.memory.new_interval()

    def offload(self, store: BudgetedStore, give_back: Callable[[], int]) -> None:
        """``give_back()`` returns ``store``'s home to its places below for an offload (an
        RL rollout wants the GPU); the home is filled again at the restore (:meth:`restored`)."""
        if self.memory is not None:
            self._read(self.stores)  # with the home still held
        try:
            give_back()
        finally:
            if self.memory is not None:
                self.memory.release_cache()
                self.memory.new_interval()
            self._refill_on_restore = True

    def restored(self, store: BudgetedStore) -> None:
        """After the chain's last store is restored: fill, so the steps until the next
        offload run with the home; not before the first fill (no step's need is known
        yet), and not after a rollout of one step (moving the home out and in costs
        what that step saves)."""
        stores = self.stores
        if self.memory is None or not self._refill_on_restore or not stores or store is not stores[-1]:
            return
        self._refill_on_restore = False
        self._read(stores)  # the rollout's interval: what this process needed meanwhile counts too
        steps, self._steps_since_restore = self._steps_since_restore, 0
        try:
            if not self._filled:
                return
            if steps <= 1:
                if "one step" not in self._warned:
                    logger.info(
                        "auto GPU budget: one training step between offloads: the device home is not filled at "
                        "the restore (moving it out and in would cost what the step saves)"
                    )
                    self._warned.add("one step")
                return
            self._fill(stores, self._limit - self._need - self._home(stores))
        finally:
            self.memory.new_interval()

    def _fill(self, stores: list[BudgetedStore], free: int) -> None:
        self.free_at_last_fill = free
        pool = max(0, free - self.margin)
        self.memory.release_cache()
        moved = 0
        try:
            # Every store's disk buckets before any store's host ones; within a home, the last
            # store's buckets are the last a step visits. Device memory that cannot be had
            # stops them all (another try would only fail again, warning again).
            moves = ((home, store) for home in DEVICE_FILL_ORDER for store in reversed(stores))
            for home, store in moves:
                done, out_of_memory = store.move_to_gpu_home(pool - moved, home)
                moved += done
                if out_of_memory:
                    break
        finally:
            self._filled, self._refill = True, False
        logger.info(
            "auto GPU budget: %.2f GB free beyond the %.1f GB margin (needed besides the home: %.2f GB); %d "
            "buckets (%.2f GB) now stay on the device",
            pool / GB,
            self.margin / GB,
            self._need / GB,
            sum(s.placement["gpu"] for s in stores),
            moved / GB,
        )

    def _cover(self, stores: list[BudgetedStore], free: int) -> bool:
        """Give buckets back when free fell below the margin; whether it did."""
        deficit = self.margin - free
        if deficit <= self.margin // 8:
            return False  # allocator rounding, or too little to matter yet: it adds up until it is not
        freed, held = 0, sum(s.placement["gpu"] for s in stores)
        for home in reversed(DEVICE_FILL_ORDER):  # host ones first: a step streams them back cheaper
            for store in stores:  # the first store's device buckets are the first a step visits
                if freed < deficit:
                    freed += store.move_from_gpu_home(deficit - freed, home)
        self.memory.release_cache()  # the freed buckets leave the reservation the next interval starts from
        if freed or "short" not in self._warned:
            # Buckets placed on the device at setup (host and disk had no room) cannot go back.
            stuck = sum(s.placed.setup_gpu_bytes for s in stores)
            logger.warning(
                "auto GPU budget: %.2f GB free, %.2f GB short of the %.1f GB margin (a larger batch, another "
                "process); gave %d buckets (%.2f GB) back to their host or disk homes%s",
                max(free, 0) / GB,
                deficit / GB,
                self.margin / GB,
                held - sum(s.placement["gpu"] for s in stores),
                freed / GB,
                ""
                if freed >= deficit
                else f" (all that could go: {stuck / GB:.2f} GB placed on the device at setup have no place below; "
                "the margin is what is left, and a step that grows further may run out of device memory)"
                if stuck
                else " (all there were: the margin is what is left)",
            )
            self._warned.add("short")
        return freed > 0


# One budget per device of this process (str(device) -> budget).
_BUDGETS: dict[str, AutoGpuBudget] = {}
