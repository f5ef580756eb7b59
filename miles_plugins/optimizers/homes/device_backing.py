"""The ``gpu`` home's backing: the state in the compute device's memory, one buffer per bucket.

Besides the :class:`~miles_plugins.optimizers.homes.protocols.Backing` contract,
buckets join and leave it one at a time (an auto GPU budget moves them between
steps) and its buffers move to host memory and back whole (an offload while an RL
rollout wants the GPU).
"""

from __future__ import annotations

import errno
from collections.abc import Container, Sequence

import torch

from miles_plugins.optimizers.errors import StreamIOError
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.backings import BufferHandle, WrittenInPlace
from miles_plugins.optimizers.homes.file_io import BlockCrc, pread_full, pwrite_full
from miles_plugins.optimizers.homes.host_memory import HostMemory


class DeviceBacking(WrittenInPlace):
    """The state in one buffer per bucket in the compute device's memory (the
    ``gpu`` home): a step updates fp32-stored tensors in the buffer itself (their
    tensors share its bytes for the bucket's visit) and copies the others in and
    out on the device, with no PCIe transfer and no drive. The buffer holds the
    stored format, so a bucket here costs its stored size between steps and
    computes exactly as anywhere else. One copy, written in place, as the host home.

    A bucket's buffer is allocated at its first :meth:`open` (the store's first
    write of its mains), not here: by then the mains of every bucket written
    before it have given their device memory back, so a GPU home never sits on
    top of the fp32 mains Megatron's build allocated."""

    def __init__(self, buckets: Sequence[BucketLayout], device: torch.device) -> None:
        self.device = device
        self.buffers: dict[int, torch.Tensor] = {}
        self._offloaded: dict[int, HostMemory] = {}
        self._unallocated = {bucket.index: bucket for bucket in buckets}

    def add(self, bucket: BucketLayout) -> torch.Tensor:
        """Device memory for one more bucket, zeroed: bytes no write reaches (alignment
        padding, moments of entries that never got a grad) are saved as zeros, as from
        files and host memory. Raises ``StreamIOError`` (ENOMEM) where it does not fit."""
        try:
            buffer = torch.zeros(bucket.file_size, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            raise StreamIOError(
                f"cannot keep bucket {bucket.index} ({bucket.file_size} bytes) in {self.device} memory: {exc}; "
                "lower the GPU budget (--stream-optimizer-state-gpu-budget-gb, gpu_budget_bytes)",
                f"<device bucket {bucket.index}>",
                0,
                errno.ENOMEM,
            ) from exc
        self.buffers[bucket.index] = buffer
        return buffer

    def remove(self, bucket: BucketLayout) -> None:
        """Free one bucket's memory (it went back to its place below)."""
        del self.buffers[bucket.index]

    def lends(self, bucket: BucketLayout, device: torch.device) -> bool:
        """Whether :meth:`open`'s handle lends the bucket's bytes to tensors on ``device``
        (``BufferHandle.view_of``): not while the buffers are offloaded to host memory."""
        return bucket.index not in self._offloaded and self.device == device

    def _buffer(self, bucket: BucketLayout) -> torch.Tensor:
        if bucket.index in self._unallocated:
            self.add(self._unallocated.pop(bucket.index))
        return self.buffers[bucket.index]

    def open(self, bucket: BucketLayout, in_place: bool = False) -> BufferHandle:
        """The bucket's buffer, read and written in place (one copy, as the host home)."""
        # Device-to-device copies go on the caller's stream: ordered with the update
        # and with the caching allocator's reuse of freed bucket memory. Where a tensor's
        # stored form is its fp32 bytes, the step updates it in the buffer instead
        # (``view_of``; the pipeline's fetch), with no copy at all.
        name = f"<device memory of bucket {bucket.index}>"
        # Offloaded, the buffer is host memory standing in for the home: copied, never lent
        # (on the CPU too, where it would share the tensors' device).
        lends = bucket.index not in self._offloaded
        return BufferHandle(self._buffer(bucket), name, on_caller_stream=True, shared=lends)

    @property
    def offloaded(self) -> bool:
        """Whether :meth:`to_host` moved the buffers to host memory."""
        return bool(self._offloaded)

    def bytes_on_device(self, excluding: Container[int] = ()) -> int:
        """Bytes of the buffers still in device memory (what :meth:`to_host` would move),
        but those of the buckets ``excluding`` names."""
        return sum(b.numel() for i, b in self.buffers.items() if i not in self._offloaded and i not in excluding)

    def to_host(self, pin: bool) -> None:
        """Move every buffer to host memory and free the device's (an RL rollout
        phase wants the GPU); steps still work, copying over PCIe, until :meth:`to_device`."""
        for index, buffer in list(self.buffers.items()):
            if index in self._offloaded:
                continue
            memory = HostMemory(buffer.numel(), pin)
            memory.tensor.copy_(buffer)
            self._offloaded[index] = memory
            self.buffers[index] = memory.tensor

    def to_device(self) -> None:
        """Bring the buffers :meth:`to_host` moved back into device memory."""
        for index, memory in list(self._offloaded.items()):
            self.buffers[index] = memory.tensor.to(self.device)
            memory.release()
            del self._offloaded[index]

    def commit(self) -> None:
        pass

    def export(
        self, bucket: BucketLayout, dst_fd: int, dst_path: str, buffer: HostMemory, crc: BlockCrc, snapshot: None = None
    ) -> None:
        """Copy the bucket's bytes into an open file through the host ``buffer``, chunk by chunk."""
        data = self._buffer(bucket)
        for start in range(0, data.numel(), buffer.nbytes):
            n = min(buffer.nbytes, data.numel() - start)
            buffer.tensor[:n].copy_(data[start : start + n])
            pwrite_full(dst_fd, dst_path, start, buffer.view[:n])
            crc.update(buffer.view[:n])

    def restore(self, bucket: BucketLayout, src_fd: int, src_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        """Copy the bucket's bytes from an open file into its buffer, in place, through ``crc``."""
        data = self._buffer(bucket)
        for start in range(0, data.numel(), buffer.nbytes):
            n = min(buffer.nbytes, data.numel() - start)
            pread_full(src_fd, src_path, start, buffer.view[:n])
            crc.update(buffer.view[:n])
            data[start : start + n].copy_(buffer.tensor[:n])

    def release(self) -> None:
        self.buffers.clear()
        self._unallocated.clear()
        for memory in self._offloaded.values():
            memory.release()
        self._offloaded.clear()
