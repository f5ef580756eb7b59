"""The contracts between the homes' parts and the code that drives them.

A :class:`Backing` keeps buckets' bytes between steps (files, host memory, device
memory) and opens a :class:`Handle` on one bucket for one pass; an :class:`Engine`
schedules a submission's transfers between a handle and device tensors and gives
back a :class:`PendingTransfers` to wait on. Any backing runs with any engine. The step and
the checkpoints take these types, not the concrete classes (``backings.py``,
``placed_backing.py``, ``engines.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch.cuda import Event

from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.file_io import BlockCrc
from miles_plugins.optimizers.homes.host_memory import HostMemory

# One transfer: (byte offset in the bucket, flat uint8 view of a device tensor).
Transfer = tuple[int, torch.Tensor]


@runtime_checkable
class PendingTransfers(Protocol):
    """Transfers submitted together (one :meth:`Engine.read` or :meth:`Engine.write`)."""

    def done(self) -> bool:
        """Whether every transfer has finished, successfully or not; never blocks."""

    def wait(self, timeout_s: float | None = None) -> None:
        """Return once every transfer is done. A failure is raised only after every
        transfer has stopped touching memory (the caller may then free its tensors),
        the first one submitted first. :class:`~miles_plugins.optimizers.errors.StreamIOTimeout`
        when they are not all done within ``timeout_s`` (default: the engine's timeout);
        the transfers may then still run, and their tensors must stay allocated."""


@runtime_checkable
class Handle(Protocol):
    """One bucket's bytes, opened for one pass by :meth:`Backing.open`.

    ``read`` fills a flat uint8 device tensor from the bucket's bytes at ``offset``;
    ``write`` puts one there. ``staging`` is host memory the engine lends the call for
    its duration; a handle ``on_caller_stream`` copies directly and is given None. A
    copy through host memory is complete when the call returns; a device-to-device
    copy is queued on the current stream. Errors are
    :class:`~miles_plugins.optimizers.errors.StreamIOError` naming the path and offset.
    ``close`` ends the pass; the handle is not used after it.

    The attributes route the handle's transfers in the engine: ``io_queue`` picks the
    I/O threads that serve it (one set per state directory), ``on_caller_stream``
    (device memory) runs its copies on the caller's thread and stream, ``dma``
    (pinned host memory) marks a :class:`DmaHandle`. ``read_path`` / ``write_path``
    name what is read and written in errors and timeouts."""

    read_path: str
    write_path: str
    io_queue: int
    on_caller_stream: bool
    dma: bool

    def read(self, offset: int, dst: torch.Tensor, staging: HostMemory | None) -> None:
        """Fill ``dst`` from the bucket's bytes at ``offset``."""

    def write(self, offset: int, src: torch.Tensor, staging: HostMemory | None) -> None:
        """Put ``src``'s bytes into the bucket at ``offset``."""

    def view_of(self, offset: int, tensor: torch.Tensor) -> torch.Tensor | None:
        """The bucket's bytes from ``offset`` as a tensor of ``tensor``'s dtype and shape,
        where the backing lends them to ``tensor``'s device; else None (the caller copies)."""

    def close(self) -> None:
        """End the pass (files closed once; the first error raised)."""


@runtime_checkable
class DmaHandle(Handle, Protocol):
    """A :class:`Handle` on pinned host memory (``dma`` True): besides the copies that
    complete on return, non-blocking ones the engine queues whole on its copy streams.
    They are ordered only by the current stream: the caller records an event after them
    and waits on it before the tensors are used or freed."""

    def read_async(self, offset: int, dst: torch.Tensor) -> None:
        """Queue the copy of the bucket's bytes at ``offset`` into ``dst``."""

    def write_async(self, offset: int, src: torch.Tensor) -> None:
        """Queue the copy of ``src`` into the bucket's bytes at ``offset``."""


@runtime_checkable
class Backing(Protocol):
    """Where a set of buckets' bytes live between steps.

    A bucket's *live* bytes are its state as of the last :meth:`commit`. A backing that
    :meth:`keeps_previous_state_of` a bucket writes a step to a spare and keeps the
    live bytes until the commit, so a failed step loses nothing; the others are written
    in place. Checkpoints go through :meth:`export` and :meth:`restore`, one whole
    bucket to or from the start of an open file, chunk by chunk through the host
    ``buffer`` given, every byte fed to ``crc``; their errors are
    :class:`~miles_plugins.optimizers.errors.StreamIOError` naming the file."""

    def open(self, bucket: BucketLayout, in_place: bool = False) -> Handle:
        """A handle whose reads come from the live bytes and whose writes go to the
        spare, or over the live bytes where ``in_place`` or where there is no spare."""

    def commit(self) -> None:
        """The spares a step wrote become the live bytes (nothing where none were written)."""

    def keeps_previous_state_of(self, bucket: BucketLayout) -> bool:
        """Whether a step's writes leave the bucket's live bytes as they are until :meth:`commit`."""

    def lends(self, bucket: BucketLayout, device: torch.device) -> bool:
        """Whether the handles lend the bucket's bytes to tensors on ``device`` (:meth:`Handle.view_of`)."""

    def snapshot(self) -> object:
        """A token naming every bucket's live bytes as they are now, for :meth:`export`
        while steps go on (a background save): they stay as they are until a step's
        write :meth:`overwrites` them, which the caller orders after their export."""

    def overwrites(self, bucket: BucketLayout, snapshot: object) -> bool:
        """Whether the next step's writes of ``bucket`` land on the bytes ``snapshot`` names
        (always where the bucket is written in place; on its next-but-one step for a spare)."""

    def export(
        self,
        bucket: BucketLayout,
        dst_fd: int,
        dst_path: str,
        buffer: HostMemory,
        crc: BlockCrc,
        snapshot: object = None,
    ) -> None:
        """Copy the bucket's live bytes (those ``snapshot`` names, when given) into the open file ``dst_fd``."""

    def restore(self, bucket: BucketLayout, src_fd: int, src_path: str, buffer: HostMemory, crc: BlockCrc) -> None:
        """Copy the bucket's bytes from the open file ``src_fd`` into its spare (live at
        the next :meth:`commit`) or, without one, over its live bytes."""

    def release(self) -> None:
        """Give back the memory the backing holds (files go with the scratch directory)."""


@runtime_checkable
class Engine(Protocol):
    """Schedules transfers between a :class:`Handle` and device tensors.

    :meth:`read` fills each transfer's tensor from the bucket's bytes at its offset;
    :meth:`write` copies each tensor there. The transfers may run after the call
    returns, in any order among themselves: a write's tensors must stay unchanged, and
    a read's unused, until the returned pending transfers' ``wait`` returns; every tensor stays
    allocated until then. ``ready`` is a CUDA event the caller recorded after the last
    work that must come first: each copy waits for it on the device. ``beside_training``
    marks the overlap window's transfers, which run during forward and backward and
    leave the training's own copies room. A failure is raised by the pending transfers' ``wait``,
    or by the call where nothing was left running."""

    def read(
        self, handle: Handle, transfers: Sequence[Transfer], ready: Event | None = None, beside_training: bool = False
    ) -> PendingTransfers:
        """Submit the reads of ``transfers`` from ``handle``."""

    def write(
        self, handle: Handle, transfers: Sequence[Transfer], ready: Event | None = None, beside_training: bool = False
    ) -> PendingTransfers:
        """Submit the writes of ``transfers`` to ``handle``."""

    def idle_buffer(self) -> HostMemory:
        """A staging chunk the caller may use while no transfer is in flight."""

    def close(self, wait: bool = True) -> None:
        """Stop; with ``wait`` False (after a timeout) hung transfers are abandoned and
        the memory they may still touch stays allocated."""
