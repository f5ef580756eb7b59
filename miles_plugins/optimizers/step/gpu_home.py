"""The store's ``gpu`` home between steps: buckets moved into and out of it, and its
device memory given up around an RL rollout.

An auto GPU budget (``homes/auto_budget.py``) moves buckets between the ``gpu``
home and their places below (``homes/placement.py``) after a step; an offload
gives the home's device memory up and a restore takes it back. Every move
changes which buckets are written in place, so the walk's ``drain_before`` is
recomputed after it (``rollback.py``).
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from miles_plugins.optimizers.errors import StreamIOError
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.auto_budget import AutoGpuBudget, check_host_room
from miles_plugins.optimizers.homes.device_backing import DeviceBacking
from miles_plugins.optimizers.homes.device_home_moves import move_from_device_home, move_to_device_home
from miles_plugins.optimizers.homes.placed_backing import PlacedBacking
from miles_plugins.optimizers.homes.placement import DEVICE_FILL_ORDER, Placement
from miles_plugins.optimizers.step.pipeline import Pipeline
from miles_plugins.optimizers.step.rollback import first_written_in_place

if TYPE_CHECKING:
    from miles_plugins.optimizers.homes.protocols import Engine


class GpuHome:
    """The ``gpu`` home of one store. ``finish_transfers`` is the store's: it runs before a
    bucket changes place (nothing prefetched may read a bucket whose place changes)."""

    def __init__(
        self,
        *,
        placed: Placement,
        backing: PlacedBacking,
        buckets: Sequence[BucketLayout],
        engine: Engine,
        pipeline: Pipeline,
        device: torch.device,
        finish_transfers: Callable[[], None],
    ) -> None:
        self._placed, self._backing, self._buckets = placed, backing, buckets
        self._engine, self._pipeline, self._device, self._finish_transfers = engine, pipeline, device, finish_transfers

    @property
    def backing(self) -> DeviceBacking | None:
        """The home's backing, once a bucket has lived there."""
        return self._backing.by_key.get("gpu")

    @property
    def offloaded(self) -> bool:
        return self.backing is not None and self.backing.offloaded

    def move_in(self, budget: int, home: str) -> tuple[int, bool]:
        """``StreamingStore.move_to_gpu_home``."""
        return self._move(move_to_device_home, budget, home) if not self.offloaded else (0, False)

    def move_out(self, nbytes: int, home: str) -> int:
        """``StreamingStore.move_from_gpu_home``."""
        return self._move(move_from_device_home, nbytes, home) if not self.offloaded else 0

    def _move(self, move, nbytes: int, home: str):
        self._finish_transfers()
        done = move(self._placed, self._backing, self._buckets, nbytes, self._engine.idle_buffer(), home)
        self._pipeline.drain_before = first_written_in_place(self._buckets, self._placed)
        return done

    def offload(self, store: object, auto_gpu: AutoGpuBudget | None) -> None:
        """``StreamingStore.offload_device_home``; ``auto_gpu`` the store's budget or None
        (which knows the store as ``store``)."""
        backing = self.backing
        if backing is not None:
            # What will be pinned: under an auto budget only the buckets placed on the device
            # at setup (the others go back to their places below, pinning nothing), else the
            # whole home. Checked before anything moves: host memory the node does not have
            # is refused here, not met by the kernel's OOM killer during the rollout.
            below = self._backing.below if auto_gpu is not None else {}
            check_host_room(backing.bytes_on_device(excluding=below), "the offload")
        if auto_gpu is not None:
            # Buckets with a place below go back to it, pinning nothing more.
            auto_gpu.offload(
                store,
                lambda: sum(
                    self.move_out(self._placed.home_bytes()["gpu"], home) for home in reversed(DEVICE_FILL_ORDER)
                ),
            )
            stuck = [i for i in self._backing.below if self._placed.homes[i] == "gpu"]
            if stuck:
                raise StreamIOError(
                    f"{len(stuck)} buckets of the device home could not go back to their places "
                    "below for the offload (see the warning above); they stay on the device",
                    "<device home>",
                    0,
                    errno.EIO,
                )
            if not self._placed.home_bytes()["gpu"]:
                return  # the budget gave the freed memory to the driver, for another process
            # What remains was placed on the device at setup (host and disk had no room): it
            # goes to pinned host memory, as a fixed GPU budget's buckets do.
        if backing is not None:
            backing.to_host(pin=torch.cuda.is_available())  # the store then empties the cache

    def restore(self) -> None:
        """``StreamingStore.restore_device_home``, before the budget's own restore."""
        backing = self.backing
        if backing is not None and backing.offloaded:
            backing.to_device()  # buckets of a fixed budget, or placed on the device at setup
