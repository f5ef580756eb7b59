"""Which buckets an auto GPU budget moves into the ``gpu`` home, and back, between steps.

Buckets move one home at a time (``placement.DEVICE_FILL_ORDER``): into the
device from the end of the walk backwards, so what stays in a home is still the
run it was (the disk home the one the walk starts with); back, first visited
first, so the home grows again as that run. The bytes move through
:class:`~miles_plugins.optimizers.homes.placed_backing.PlacedBacking`; the
placement records each bucket's new home.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.host_memory import HostMemory
from miles_plugins.optimizers.homes.placed_backing import PlacedBacking
from miles_plugins.optimizers.homes.placement import DEVICE_FILL_ORDER, Placement

logger = logging.getLogger(__name__)


def _check_home(home: str) -> None:
    if home not in DEVICE_FILL_ORDER:
        raise ValueError(f"a bucket moves between the gpu home and one of {DEVICE_FILL_ORDER}, not {home!r}")


def move_to_device_home(
    placed: Placement,
    backing: PlacedBacking,
    buckets: Sequence[BucketLayout],
    budget: int,
    staging: HostMemory,
    home: str,
) -> tuple[int, bool]:
    """Move buckets of ``home`` into the ``gpu`` home while their stored sizes fit
    ``budget``, from the last one a step visits backwards (what stays in ``home`` is
    still the run it was: the disk home the one the walk starts with), up to the
    first that does not fit. Returns the bytes moved and whether a move failed: a
    bucket whose device memory cannot be had stops it, with a warning (a step never
    fails for it), and the caller should try no more moves until the next fill."""
    _check_home(home)
    moved = 0
    for bucket in [b for b in reversed(buckets) if placed.homes[b.index] == home]:
        if bucket.file_size > budget - moved:
            break
        try:
            backing.move_to_device(bucket, staging)
        except Exception as exc:
            logger.warning(
                "auto GPU budget: bucket %d stays where it is, and no more move this time: %s", bucket.index, exc
            )
            return moved, True
        placed.move(bucket.index, "gpu")
        moved += bucket.file_size
    return moved, False


def move_from_device_home(
    placed: Placement,
    backing: PlacedBacking,
    buckets: Sequence[BucketLayout],
    nbytes: int,
    staging: HostMemory,
    home: str,
) -> int:
    """Give buckets of the ``gpu`` home whose place below is ``home`` back to it, first
    visited first (``home`` grows as the run it was), until ``nbytes`` are freed or
    none are left; returns the bytes freed."""
    _check_home(home)
    freed = 0
    for bucket in [b for b in buckets if placed.homes[b.index] == "gpu"]:
        if freed >= nbytes:
            break
        below = backing.below.get(bucket.index)  # None: placed on the device at setup, nothing below
        if below is None or (below == "host") != (home == "host"):  # disk places are ("disk", i)
            continue
        try:
            backing.move_back(bucket, staging)
        except Exception as exc:
            logger.warning("auto GPU budget: bucket %d stays on the device: %s", bucket.index, exc)
            break
        placed.move(bucket.index, home)
        freed += bucket.file_size
    return freed
