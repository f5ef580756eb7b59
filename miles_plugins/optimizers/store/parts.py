"""The parts a store is assembled from, and the factory that builds them.

:func:`assemble` plans the buckets (``plan.py``), places them in their homes
(checking the directories' free space before anything is written), and opens
the backing and the engine; over those it builds the pipeline that walks the
buckets, the overlap window, the gpu home's moves and what a checkpoint holds.
A failure part way releases what was built.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles_plugins.optimizers.checkpoint.description import describe_store
from miles_plugins.optimizers.checkpoint.persistence import Persistence
from miles_plugins.optimizers.config import StreamConfig
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes import auto_budget
from miles_plugins.optimizers.homes.backings import FileBacking, HostBacking
from miles_plugins.optimizers.homes.device_backing import DeviceBacking
from miles_plugins.optimizers.homes.engines import PipelinedEngine, SyncEngine
from miles_plugins.optimizers.homes.placed_backing import PlacedBacking
from miles_plugins.optimizers.homes.placement import Placement
from miles_plugins.optimizers.step.adam import AdamBackend
from miles_plugins.optimizers.step.codec import Codec
from miles_plugins.optimizers.step.entries import Entry
from miles_plugins.optimizers.step.gpu_home import GpuHome
from miles_plugins.optimizers.step.overlap import OverlapWindow
from miles_plugins.optimizers.step.pipeline import Pipeline
from miles_plugins.optimizers.step.rollback import first_written_in_place
from miles_plugins.optimizers.store.plan import BucketPlan, plan_buckets

if TYPE_CHECKING:
    from miles_plugins.optimizers.homes.protocols import Engine

# Backings of stores closed while transfers hung: a late copy may still write into them.
_ABANDONED: list = []


@dataclass(frozen=True, kw_only=True, eq=False)
class StoreParts:
    """What a store is made of.

    Args:
        plan: what its entries became (:class:`~miles_plugins.optimizers.store.plan.BucketPlan`).
        placed, backing, engine: each bucket's home, where its bytes live, how they move.
        pipeline, window, gpu_home: the walk, the overlap window, the gpu home's moves.
        persistence: what its checkpoints hold.
    """

    plan: BucketPlan
    placed: Placement
    backing: PlacedBacking
    engine: Engine
    pipeline: Pipeline
    window: OverlapWindow
    gpu_home: GpuHome
    persistence: Persistence

    def shut_down(self) -> None:
        """Release what the parts hold: the codec's graphs, the engine's threads, the
        backing's memory or files (kept for the process after a hang: a late copy may
        still write there), the scratch directories."""
        _shut_down(self.placed, self.backing, self.engine, self.pipeline)


def assemble(
    entries: list[Entry],
    backend: AdamBackend,
    config: StreamConfig,
    *,
    auto_gpu_room: bool,
    finish_transfers: Callable[[], None],
    topology: dict[str, int] | None,
    param_layout: dict | None,
    param_facts: dict | None,
    master_options: list[dict] | None,
) -> StoreParts:
    """The parts of a store over ``entries`` (``StreamingStore``'s arguments);
    ``auto_gpu_room``: lend the gpu home the device's room at setup where host and
    disk cannot hold the state; ``finish_transfers``: the store's, run before a bucket changes place."""
    plan = plan_buckets(entries, backend, config)
    buckets, device = plan.buckets, plan.device
    # Each bucket's home and a disk bucket's directory, with the directories' scratches:
    # their free space is checked before anything is written. An auto GPU budget lends
    # the device's room at setup where host and disk cannot hold the state.
    gpu_room = _setup_gpu_room(entries, buckets, device, config) if auto_gpu_room else None
    placed = Placement(buckets, config, gpu_room)
    backing = engine = pipeline = None
    try:
        backing, engine = _open_backing_and_engine(config, buckets, placed, device)
        codec = Codec(buckets, device)
        pipeline = _pipeline(entries, plan, placed, backing, engine, codec, config)
        description = describe_store(
            config, entries, buckets, plan.resident_entries, backend.master, topology, param_layout, param_facts
        )
        return StoreParts(
            plan=plan,
            placed=placed,
            backing=backing,
            engine=engine,
            pipeline=pipeline,
            window=OverlapWindow(window_bytes=config.overlap_bytes, buckets=buckets, placed=placed, pipeline=pipeline),
            gpu_home=GpuHome(
                placed=placed,
                backing=backing,
                buckets=buckets,
                engine=engine,
                pipeline=pipeline,
                device=device,
                finish_transfers=finish_transfers,
            ),
            persistence=_persistence(entries, config, plan, description, backing, engine, codec, master_options),
        )
    except BaseException:
        _shut_down(placed, backing, engine, pipeline)
        raise


def _pipeline(
    entries: list[Entry],
    plan: BucketPlan,
    placed: Placement,
    backing: PlacedBacking,
    engine: Engine,
    codec: Codec,
    config: StreamConfig,
) -> Pipeline:
    """The walk over the plan's buckets, ``buckets_in_flight`` at a time; it drains the
    disk writes before the first bucket whose update cannot be undone."""
    return Pipeline(
        entries=entries,
        buckets=plan.buckets,
        optimizers=plan.bucket_optimizers,
        backing=backing,
        engine=engine,
        codec=codec,
        device=plan.device,
        io_timeout_s=config.io_timeout_s,
        max_in_flight=config.max_in_flight,
        drain_before=first_written_in_place(plan.buckets, placed),
    )


def _persistence(
    entries: list[Entry],
    config: StreamConfig,
    plan: BucketPlan,
    description: dict,
    backing: PlacedBacking,
    engine: Engine,
    codec: Codec,
    master_options: list[dict] | None,
) -> Persistence:
    """What the store's checkpoints hold (``checkpoint/persistence.py``)."""
    return Persistence(
        name=config.name,
        description=description,
        buckets=plan.buckets,
        backing=backing,
        bucket_optimizers=plan.bucket_optimizers,
        buffer=engine.idle_buffer,
        codec=codec,
        remainder=config.main_storage == "remainder",
        resident_optimizer=plan.resident_optimizer,
        resident_mains=[entries[i].main for i in plan.resident_entries],
        master_groups=master_options,
    )


def _shut_down(
    placed: Placement, backing: PlacedBacking | None, engine: Engine | None, pipeline: Pipeline | None
) -> None:
    if pipeline is not None:
        pipeline.codec.release()
    hung = pipeline is not None and pipeline.hung
    if engine is not None:
        engine.close(wait=not hung)
    if backing is not None and hung:
        # A late copy may still reach the host home's pinned buffers: they stay pinned and
        # mapped for the rest of the process (held here, past this store), as the staging is.
        _ABANDONED.append(backing)
    elif backing is not None:
        backing.release()
    placed.remove()


def _setup_gpu_room(entries: Sequence[Entry], buckets: Sequence[BucketLayout], device, config: StreamConfig) -> int:
    """What an auto GPU budget lends the gpu home at setup (``auto_budget.setup_gpu_room``),
    counting the device bytes of the streamed mains, which the store writes out and releases."""
    releasable = sum(
        entries[i].main.untyped_storage().nbytes() for b in buckets if b.streams_main for i in b.entry_indices
    )
    return auto_budget.setup_gpu_room(device, config.auto_gpu_margin_bytes, releasable)


def _open_backing_and_engine(config: StreamConfig, buckets, placed: Placement, device: torch.device):
    """The backing (each bucket in its place: files in a directory's scratch, pinned
    host memory, device memory) and the engine (a set of I/O threads per directory)."""
    pin = torch.cuda.is_available()

    def build(key: Hashable, mine: list[BucketLayout]) -> HostBacking | DeviceBacking | FileBacking:
        if key == "host":
            return HostBacking(mine, pin=pin)
        if key == "gpu":
            return DeviceBacking(mine, device)
        directory = key[1]
        direct = config.pipelined and config.direct_io
        return FileBacking(placed.scratches[directory].path, mine, direct, io_queue=directory, one_slot=placed.one_slot)

    backing = PlacedBacking(buckets, placed.keys(), build)
    try:
        if config.pipelined:
            engine = PipelinedEngine(
                threads=config.transfer_threads,
                chunk_bytes=config.staging_bytes,
                pin=pin,
                device=device,
                timeout_s=config.io_timeout_s,
                queues=config.io_queues,  # one per directory, as the staging budget is split
            )
        else:
            engine = SyncEngine(config.staging_bytes, pin)
    except BaseException:
        backing.release()
        raise
    return backing, engine
