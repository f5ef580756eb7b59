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
slots and commits at the end; the host and gpu homes write in place, so a step
that fails after updating one of their buckets cannot be rolled back (the store
then refuses to step again, as the host tier always has). Before the first
in-memory bucket is updated the walk waits for every disk write (``Pipeline``'s
``drain_before``): a failure up to there rolls back as on disk. Stored bytes are
the same in every home: checkpoints do not depend on placement.

With several state directories, :func:`spread_over_directories` deals the disk
buckets round robin over those with room; each directory has its own file
backing and its own I/O threads in the engine (``io_queue``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from miles_plugins.optimizers.config import StreamConfig
from miles_plugins.optimizers.io import BlockCrc, HostMemory
from miles_plugins.optimizers.layout import BucketLayout


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


def spread_over_directories(buckets: Sequence[BucketLayout], homes: Sequence[str], free: Sequence[int]) -> list:
    """The state directory (an index into ``free``, their free bytes) of each disk
    bucket, None for the others: in walk order, round robin over the directories
    with room left for its two slots, so consecutive buckets stream from
    different drives whatever their sizes; where none has room, the one with the
    most (its scratch then refuses, saying how much is missing)."""
    left = list(free)
    where: list = [None] * len(buckets)
    turn = 0
    for bucket in buckets:
        if homes[bucket.index] != "disk":
            continue
        need = 2 * bucket.file_size
        order = [(turn + d) % len(left) for d in range(len(left))]
        i = next((d for d in order if left[d] >= need), max(order, key=lambda d: left[d]))
        left[i] -= need
        where[bucket.index] = i
        turn = i + 1
    return where


class PlacedBacking:
    """One backing per place in use (a key: ``"gpu"``, ``"host"``, or
    ``("disk", i)`` for state directory ``i``), each holding its buckets; every
    call for a bucket goes to its place's backing. ``build(key, buckets)`` makes
    a place's backing; if one fails, those built are released."""

    def __init__(
        self,
        buckets: Sequence[BucketLayout],
        keys: Sequence[Hashable],
        build: Callable[[Hashable, list[BucketLayout]], object],
    ) -> None:
        self.keys = list(keys)
        self.by_key: dict[Hashable, object] = {}
        try:
            for key in dict.fromkeys(self.keys):  # in order of first use
                self.by_key[key] = build(key, [b for b in buckets if self.keys[b.index] == key])
        except BaseException:
            self.release()
            raise

    def _of(self, bucket: BucketLayout):
        return self.by_key[self.keys[bucket.index]]

    def keeps_previous_state_of(self, bucket: BucketLayout) -> bool:
        """Whether the bucket has a spare to fill while its live state stays (disk)."""
        return self._of(bucket).keeps_previous_state

    def file_backing(self, bucket: BucketLayout):
        """The files of a disk bucket (``FileBacking``)."""
        return self._of(bucket)

    @property
    def direct(self) -> bool:
        """Whether the disk buckets use direct I/O (False with none on disk)."""
        files = [b for key, b in self.by_key.items() if isinstance(key, tuple)]
        return bool(files) and all(b.direct for b in files)

    def open(self, bucket: BucketLayout, in_place: bool = False):
        return self._of(bucket).open(bucket, in_place=in_place)

    def commit(self) -> None:
        for backing in self.by_key.values():
            backing.commit()

    def export(self, bucket: BucketLayout, dst_fd: int, dst_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        self._of(bucket).export(bucket, dst_fd, dst_path, buffer, crc)

    def restore(self, bucket: BucketLayout, src_fd: int, src_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        self._of(bucket).restore(bucket, src_fd, src_path, buffer, crc)

    def release(self) -> None:
        for backing in self.by_key.values():
            backing.release()
