"""The store's backing: each bucket routed to the backing of the place it lives in.

:class:`PlacedBacking` satisfies
:class:`~miles_plugins.optimizers.homes.protocols.Backing` by handing each call
for a bucket to its place's backing (``placement.Placement.keys`` gives the
places). It also moves a bucket's bytes between its place and the ``gpu`` home
(:meth:`PlacedBacking.move_to_device`, :meth:`PlacedBacking.move_back`); which
buckets move is decided in ``device_home_moves.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import cast

import torch

from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.backings import FileBacking
from miles_plugins.optimizers.homes.device_backing import DeviceBacking
from miles_plugins.optimizers.homes.file_io import BlockCrc
from miles_plugins.optimizers.homes.host_memory import HostMemory
from miles_plugins.optimizers.homes.protocols import Backing, Handle


class PlacedBacking:
    """One backing per place in use (a key: ``"gpu"``, ``"host"``, or
    ``("disk", i)`` for state directory ``i``), each holding its buckets; every
    call for a bucket goes to its place's backing. ``build(key, buckets)`` makes
    a place's backing; if one fails, those built are released."""

    def __init__(
        self,
        buckets: Sequence[BucketLayout],
        keys: Sequence[Hashable],
        build: Callable[[Hashable, list[BucketLayout]], Backing],
    ) -> None:
        self.keys = list(keys)
        self.by_key: dict[Hashable, Backing] = {}
        self._build = build
        # A bucket moved to the device keeps its place below (files, host buffer) there.
        self.below: dict[int, Hashable] = {}
        try:
            for key in dict.fromkeys(self.keys):  # in order of first use
                self.by_key[key] = build(key, [b for b in buckets if self.keys[b.index] == key])
        except BaseException:
            self.release()
            raise

    def _of(self, bucket: BucketLayout) -> Backing:
        return self.by_key[self.keys[bucket.index]]

    def keeps_previous_state_of(self, bucket: BucketLayout) -> bool:
        """Whether the bucket has a spare to fill while its live state stays (disk, two slots)."""
        return self._of(bucket).keeps_previous_state_of(bucket)

    def lends(self, bucket: BucketLayout, device: torch.device) -> bool:
        """Whether the bucket's place lends its bytes to tensors on ``device`` (the gpu home)."""
        return self._of(bucket).lends(bucket, device)

    def file_backing(self, bucket: BucketLayout) -> FileBacking:
        """The files of a disk bucket."""
        return cast(FileBacking, self._of(bucket))

    @property
    def direct(self) -> bool:
        """Whether the disk buckets use direct I/O (False with none on disk)."""
        files = [cast(FileBacking, b) for key, b in self.by_key.items() if isinstance(key, tuple)]
        return bool(files) and all(b.direct for b in files)

    def move_to_device(self, bucket: BucketLayout, staging: HostMemory) -> None:
        """Copy a bucket's live bytes into new device memory (the ``"gpu"`` place, made
        if not yet in use) and route it there. Its place below keeps its files or host
        buffer: :meth:`move_back` needs no memory. On a failure nothing has moved."""
        if "gpu" not in self.by_key:
            self.by_key["gpu"] = self._build("gpu", [])
        device_home = cast(DeviceBacking, self.by_key["gpu"])
        buffer = device_home.add(bucket)
        try:
            _copy_bucket(self._of(bucket).open(bucket, in_place=True), buffer, staging, to_buffer=True)
        except BaseException:
            device_home.remove(bucket)
            raise
        self.below[bucket.index] = self.keys[bucket.index]
        self.keys[bucket.index] = "gpu"

    def move_back(self, bucket: BucketLayout, staging: HostMemory) -> Hashable:
        """Copy a bucket :meth:`move_to_device` moved back to its place below, route it
        there and free its device memory; returns the place. On a failure it stays."""
        below = self.below[bucket.index]
        device_home = cast(DeviceBacking, self.by_key["gpu"])
        handle = self.by_key[below].open(bucket, in_place=True)
        _copy_bucket(handle, device_home.buffers[bucket.index], staging, to_buffer=False)
        device_home.remove(bucket)
        self.keys[bucket.index] = self.below.pop(bucket.index)
        return below

    def open(self, bucket: BucketLayout, in_place: bool = False) -> Handle:
        return self._of(bucket).open(bucket, in_place=in_place)

    def commit(self) -> None:
        for backing in self.by_key.values():
            backing.commit()

    def snapshot(self) -> dict[Hashable, object]:
        """Each place's snapshot (the places do not change while one is in use: moves wait for it)."""
        return {key: backing.snapshot() for key, backing in self.by_key.items()}

    def overwrites(self, bucket: BucketLayout, snapshot: dict[Hashable, object]) -> bool:
        return self._of(bucket).overwrites(bucket, snapshot[self.keys[bucket.index]])

    def export(
        self,
        bucket: BucketLayout,
        dst_fd: int,
        dst_path: str,
        buffer: HostMemory,
        crc: BlockCrc,
        snapshot: dict[Hashable, object] | None = None,
    ) -> None:
        place = None if snapshot is None else snapshot[self.keys[bucket.index]]
        self._of(bucket).export(bucket, dst_fd, dst_path, buffer, crc, snapshot=place)

    def restore(self, bucket: BucketLayout, src_fd: int, src_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        self._of(bucket).restore(bucket, src_fd, src_path, buffer, crc)

    def release(self) -> None:
        for backing in self.by_key.values():
            backing.release()


def _copy_bucket(handle: Handle, buffer: torch.Tensor, staging: HostMemory, to_buffer: bool) -> None:
    """A whole bucket between an open handle (its live bytes) and ``buffer``, in
    chunks of the staging buffer (aligned, as direct I/O needs); the handle is closed."""
    try:
        copy = handle.read if to_buffer else handle.write
        for start in range(0, buffer.numel(), staging.nbytes):
            copy(start, buffer[start : start + staging.nbytes], staging)
    finally:
        handle.close()
