"""Where each bucket lives between steps: its *home*, and the backing that routes to it.

Homes (``config.HOMES``): ``gpu`` (the compute device's memory,
:class:`~miles_plugins.optimizers.io.DeviceBacking`), ``host`` (pinned host
memory, ``HostBacking``) and ``disk`` (two slots of files, ``FileBacking``).
:func:`assign_homes` fills the GPU budget, then the host budget, from the last
bucket a step visits backwards; the rest go to the tier. The step walks buckets
in order, so the disk buckets come first: their reads start with the prefetch
and stream while they compute, and the buckets at home in memory update at the
end, while the last disk writes drain.

Each home keeps its failure semantics: the disk home writes a step to the spare
slots and commits at the end; the host and gpu homes write in place, so a store
with any bucket there cannot roll a failed step back (the store then refuses to
step again, as the host tier always has). Stored bytes are the same in every
home: checkpoints do not depend on placement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from miles_plugins.optimizers.config import HOMES, StreamConfig
from miles_plugins.optimizers.io import BlockCrc, HostMemory
from miles_plugins.optimizers.layout import BucketLayout


def assign_homes(buckets: Sequence[BucketLayout], config: StreamConfig) -> list[str]:
    """The home of each bucket (by index): stored sizes fill ``gpu_budget_bytes``,
    then ``host_budget_bytes``, from the last bucket backwards; a bucket larger
    than what is left of a budget goes on to the next home; the rest go to ``tier``."""
    left = {"gpu": config.gpu_budget_bytes, "host": config.host_budget_bytes}
    homes = [config.tier] * len(buckets)
    for bucket in reversed(buckets):
        for home in ("gpu", "host"):
            if bucket.file_size <= left[home]:
                left[home] -= bucket.file_size
                homes[bucket.index] = home
                break
    return homes


class PlacedBacking:
    """One backing per home in use, each holding its buckets; every call for a
    bucket goes to its home's backing. ``build(home, buckets)`` makes a home's
    backing; if one fails, those built are released."""

    def __init__(
        self,
        buckets: Sequence[BucketLayout],
        homes: Sequence[str],
        build: Callable[[str, list[BucketLayout]], object],
    ) -> None:
        self.homes = list(homes)
        self.by_home: dict[str, object] = {}
        try:
            for home in HOMES:
                mine = [b for b in buckets if self.homes[b.index] == home]
                if mine:
                    self.by_home[home] = build(home, mine)
        except BaseException:
            self.release()
            raise
        # A failed step can be rolled back only where every bucket keeps its previous state.
        self.keeps_previous_state = all(b.keeps_previous_state for b in self.by_home.values())

    def _of(self, bucket: BucketLayout):
        return self.by_home[self.homes[bucket.index]]

    @property
    def disk(self):
        """The disk home's backing (its files), or None when no bucket is on disk."""
        return self.by_home.get("disk")

    def open(self, bucket: BucketLayout, in_place: bool = False):
        return self._of(bucket).open(bucket, in_place=in_place)

    def commit(self) -> None:
        for backing in self.by_home.values():
            backing.commit()

    def export(self, bucket: BucketLayout, dst_fd: int, dst_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        self._of(bucket).export(bucket, dst_fd, dst_path, buffer, crc)

    def restore(self, bucket: BucketLayout, src_fd: int, src_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        self._of(bucket).restore(bucket, src_fd, src_path, buffer, crc)

    def release(self) -> None:
        for backing in self.by_home.values():
            backing.release()
