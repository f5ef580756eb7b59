"""Checkpoints of one store's state: what a save holds, where it goes, and the parts
of the store it is read from and written into.

A saved store is one directory (see ``manifest.py`` for its files)::

    <base_dir>/<name>/             the complete save
    <base_dir>/.<name>.partial-<host>-<pid>-<token>/
                                   a save being written (never read; one per saver)
    <base_dir>/.<name>.partial.lock held (flock) by the process writing it
    <base_dir>/.<name>.previous/   the previous save, while a replace without
                                   RENAME_EXCHANGE is under way (dir_replace.replace_dir)

The save (``writer.py``) writes everything into the partial directory, fsynced,
manifest last, and then replaces the previous save in one step
(``dir_replace.replace_dir``). The load (``reader.py``) is a transaction: it verifies
everything before the live state changes, and a failure after that marks the
store damaged. Both work on a :class:`Persistence`, the store's parts a
checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles_plugins.optimizers.errors import StreamConfigError
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.host_memory import HostMemory
from miles_plugins.optimizers.homes.scratch import live_scratch_overlap
from miles_plugins.optimizers.step.bucket_optimizer import BucketOptimizer
from miles_plugins.optimizers.step.codec import Codec

if TYPE_CHECKING:
    from miles_plugins.optimizers.homes.protocols import Backing


@dataclass(frozen=True, kw_only=True, eq=False)
class Persistence:
    """The parts of one store that its checkpoints hold.

    Args:
        name: the store's name: its directory under a checkpoint's base directory.
        description: the manifest fields a load must match (``description.py``,
            ``manifest.COMPARED_FIELDS``).
        buckets, backing, bucket_optimizers: the layout, where the bucket bytes
            live, and each bucket's optimizer (its step counts).
        buffer: returns a host buffer free for the caller (the engine's idle staging).
        codec: the storage formats (``remainder``: its exceptions are state).
        remainder: whether the mains are stored as remainders.
        resident_optimizer, resident_mains: the fp32-native entries' optimizer
            and mains (their moments are saved as one file), or None and [].
        master_groups: the master optimizer's param groups, when their options
            (lr as a scheduler left it, weight decay, ...) are saved and restored
            here; None where the caller's own checkpoint carries them (Megatron's
            optimizer state dict).
    """

    name: str
    description: dict
    buckets: Sequence[BucketLayout]
    backing: Backing
    bucket_optimizers: Sequence[BucketOptimizer]
    buffer: Callable[[], HostMemory]
    codec: Codec
    remainder: bool
    resident_optimizer: BucketOptimizer | None
    resident_mains: Sequence[torch.Tensor]
    master_groups: list[dict] | None = None

    def resident_moments(self) -> Iterator[torch.Tensor]:
        """The resident entries' moments, in the order of the resident file."""
        for main in self.resident_mains:
            yield from self.resident_optimizer.moments(main) or ()

    def resident_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.resident_moments())


def refuse_live_scratch(path: str, what: str, consequence: str) -> None:
    """Refuse a save or load at ``path`` (a checkpoint's ``base_dir/<name>``) that is,
    holds or lies inside the scratch of a live store of this process, any store's:
    e.g. ``save_to(d)`` with ``d`` the store's own ``StreamConfig.directory``. A save
    there would swap the live bucket files out (the next step fails), and closing
    the store, or a restart's purge, would delete the save."""
    overlap = live_scratch_overlap(path)
    if overlap is not None:
        raise StreamConfigError(
            f"cannot {what} {path}: it {overlap} of a live optimizer-state store of this process ({consequence}); "
            "give save_to / load_from a checkpoint directory apart from every StreamConfig.directory (e.g. the "
            "training checkpoint's own directory)"
        )
