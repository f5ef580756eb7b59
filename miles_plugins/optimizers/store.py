"""The bucket lifecycle: the streamed optimizer state and its step.

Between steps every streamed fp32 main and Adam moment has its storage released
(the tensor keeps its shape, its storage has 0 bytes); the bytes live in one file
per bucket. ``step()`` walks the buckets one at a time: materialize the bucket's
mains and read them, materialize and read its moments (none on a bucket's first
step: the optimizer creates them), attach the fp32 grads, run the master
optimizer's exact update, copy the updated mains into the model params, write
mains and moments back, release everything. Optimizer state on the device is
bounded by one bucket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import types
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch

from miles_plugins.optimizers.adam import AdamBackend, BucketOptimizer
from miles_plugins.optimizers.config import StreamConfig, StreamConfigError
from miles_plugins.optimizers.io import StagingBuffer, SyncFileEngine, open_bucket_file, preallocate
from miles_plugins.optimizers.layout import (
    MATERIALIZED_BYTES_PER_ELEMENT,
    MOMENT_SEGMENTS,
    BucketLayout,
    layout_bucket,
    plan_buckets,
)
from miles_plugins.optimizers.scratch import ScratchDir

logger = logging.getLogger(__name__)


@dataclass
class Entry:
    """One param's share of the optimizer state.

    ``main`` is the fp32 main the optimizer updates. For a param whose model dtype
    is fp32, ``main`` is the param itself (or a view of it): such entries stay
    resident. ``group_index`` names the master param group; ``bucket_key`` keeps
    entries of different keys (e.g. DDP buckets) in different streaming buckets.
    """

    param: torch.Tensor
    main: torch.Tensor
    group_index: int
    bucket_key: Hashable = None

    @property
    def resident(self) -> bool:
        return self.param.dtype == torch.float32


@dataclass
class StepStats:
    """What one step (or all steps, summed) moved and how long it took."""

    buckets: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0

    def add(self, other: StepStats) -> None:
        self.buckets += other.buckets
        self.bytes_read += other.bytes_read
        self.bytes_written += other.bytes_written
        self.seconds += other.seconds


GradFn = Callable[[Entry], torch.Tensor | None]
EntryFn = Callable[[Entry], None]
CopyFn = Callable[[torch.Tensor, torch.Tensor], None]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    return t.view(-1).view(torch.uint8)


@dataclass
class _Residency:
    """Measures the optimizer-state bytes materialized at once."""

    current: int = 0
    peak: int = 0

    def materialize(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        t.untyped_storage().resize_(nbytes)
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def adopt(self, t: torch.Tensor) -> None:
        """Count a tensor the optimizer allocated itself (lazily created moments)."""
        self.current += t.untyped_storage().nbytes()
        self.peak = max(self.peak, self.current)

    def release(self, t: torch.Tensor) -> None:
        self.current -= t.untyped_storage().nbytes()
        t.untyped_storage().resize_(0)


class StreamingStore:
    """Optimizer state for ``entries``, streamed through per-bucket files.

    Args:
        entries: the params and their fp32 mains. Streamed mains must be
            contiguous fp32 tensors owning their storage; their content at
            construction is the initial state unless ``init_main`` is given.
        backend: reproduces the master optimizer's update (see ``adam.py``).
        config: where and how to store the state.
        grad_fn: the fp32 grad for an entry's main, or None when the param got
            no grad this step (it is then not updated, as in torch). Defaults to
            ``entry.main.grad``.
        copy_to_model: writes an updated main back into the model param.
            Called once per streamed entry per step, after its update.
        init_main: ``init_main(param, main)`` fills a main from its param; when
            given, the initial mains are built bucket by bucket through it, so
            they never all exist at once.

    Construction validates the directory and free space before writing
    anything, then writes every bucket's initial mains and releases them.
    Entries whose model param is fp32 stay resident under one small optimizer
    of the same class.
    """

    def __init__(
        self,
        entries: Sequence[Entry],
        backend: AdamBackend,
        config: StreamConfig,
        *,
        grad_fn: GradFn | None = None,
        copy_to_model: EntryFn | None = None,
        init_main: CopyFn | None = None,
    ) -> None:
        self.config = config
        self.entries = list(entries)
        self._grad_fn = grad_fn or (lambda entry: entry.main.grad)
        self._copy_to_model = copy_to_model or (lambda entry: None)
        self._residency = _Residency()
        self.last_step = StepStats()
        self.total = StepStats()
        self.steps_taken = 0

        streamed = [i for i, e in enumerate(self.entries) if not e.resident]
        for i in streamed:
            main = self.entries[i].main
            if main.dtype != torch.float32 or not main.is_contiguous():
                raise ValueError(f"entry {i}: a streamed main must be a contiguous fp32 tensor, got {main.dtype}")
        plan = plan_buckets(
            [self.entries[i].main.numel() for i in streamed],
            [self.entries[i].bucket_key for i in streamed],
            config.bucket_cap_elements,
        )
        self.buckets: list[BucketLayout] = [
            layout_bucket(
                b,
                [streamed[j] for j in members],
                [self.entries[streamed[j]].main.numel() for j in members],
                config.moment_torch_dtype,
            )
            for b, members in enumerate(plan)
        ]
        self._bucket_optimizers = [backend.build(self._groups_of(b.entry_indices)) for b in self.buckets]
        self._resident_entries = [i for i, e in enumerate(self.entries) if e.resident]
        self._resident_optimizer = (
            backend.build(self._groups_of(self._resident_entries)) if self._resident_entries else None
        )
        self._warn_if_resident_large()

        # Checks free space and the directory before anything is written.
        self.scratch = ScratchDir(config.directory, config.name, sum(b.file_size for b in self.buckets))
        try:
            self._engine = SyncFileEngine(StagingBuffer(config.staging_bytes, pin=torch.cuda.is_available()))
            for bucket in self.buckets:
                path = self.scratch.file(bucket.file_name)
                fd = open_bucket_file(path, create=True)
                try:
                    preallocate(fd, path, bucket.file_size)
                finally:
                    os.close(fd)
            self._write_mains(init_main)
        except BaseException:
            self.scratch.remove()
            raise
        logger.info(
            "optimizer state streams through %s: %d buckets, %.2f GB on disk, %.2f GB materialized "
            "state total, largest bucket %.2f GB; %d fp32 params resident",
            self.scratch.path,
            len(self.buckets),
            self.file_bytes_total / 1e9,
            self.state_bytes_total / 1e9,
            self.bucket_bytes_max / 1e9,
            len(self._resident_entries),
        )

    # ---- sizes ---------------------------------------------------------------

    @property
    def state_bytes_total(self) -> int:
        """Bytes the streamed state would take fully materialized (fp32 main + moments)."""
        return sum(b.materialized_bytes for b in self.buckets)

    @property
    def bucket_bytes_max(self) -> int:
        """Materialized bytes of the largest bucket: the residency bound per bucket in flight."""
        return max((b.materialized_bytes for b in self.buckets), default=0)

    @property
    def file_bytes_total(self) -> int:
        return sum(b.file_size for b in self.buckets)

    @property
    def max_resident_state_bytes(self) -> int:
        """Measured: the most streamed-state bytes materialized at once so far."""
        return self._residency.peak

    # ---- the contract --------------------------------------------------------

    @torch.no_grad()
    def step(self) -> StepStats:
        """One optimizer step over all state; returns what it moved (also in ``last_step``)."""
        self._check_open()
        start = time.perf_counter()
        stats = StepStats()
        if self._resident_optimizer is not None:
            self._attach_grads(self._resident_entries)
            self._resident_optimizer.step()
        for bucket, optimizer in zip(self.buckets, self._bucket_optimizers, strict=True):
            self._step_bucket(bucket, optimizer, stats)
        stats.seconds = time.perf_counter() - start
        self.last_step = stats
        self.total.add(stats)
        self.steps_taken += 1
        logger.info(
            "streamed optimizer step %d: %d buckets, read %.1f MB, wrote %.1f MB in %.3f s",
            self.steps_taken,
            stats.buckets,
            stats.bytes_read / 1e6,
            stats.bytes_written / 1e6,
            stats.seconds,
        )
        return stats

    def refresh_main_from_model_params(self, copy_fn: CopyFn) -> None:
        """Rebuild every streamed main from its model param; moments stay as they are."""
        self._check_open()
        self._write_mains(copy_fn)

    def close(self) -> None:
        """Delete the scratch files and release the directory lock."""
        self.scratch.remove()

    def _check_open(self) -> None:
        if self.scratch.removed:
            raise RuntimeError(f"the optimizer-state store at {self.scratch.path} was closed; its state is gone")

    # ---- reading the state back (tests, the demo, checkpoint export) ---------

    @torch.no_grad()
    def iter_state(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Yield (entry index, main, exp_avg, exp_avg_sq) as fp32 CPU copies, one bucket
        in memory at a time; moments are None before the entry's first update."""
        self._check_open()
        for i in self._resident_entries:
            moments = self._resident_optimizer.moments(self.entries[i].main)
            yield (i, self.entries[i].main.detach().cpu().clone(), *self._cpu_moments(moments))
        for bucket, optimizer in zip(self.buckets, self._bucket_optimizers, strict=True):
            entries = [self.entries[i] for i in bucket.entry_indices]
            with self._open(bucket) as fd:
                try:
                    self._fetch(bucket, optimizer, entries, fd, StepStats())
                    for i, entry in zip(bucket.entry_indices, entries, strict=True):
                        yield (i, entry.main.cpu().clone(), *self._cpu_moments(optimizer.moments(entry.main)))
                finally:
                    self._release(entries, optimizer)

    @staticmethod
    def _cpu_moments(moments):
        if moments is None:
            return None, None
        return tuple(m.cpu().clone() for m in moments)

    # ---- the bucket lifecycle ------------------------------------------------

    def _groups_of(self, entry_indices: Sequence[int]) -> list[tuple[int, list[torch.Tensor]]]:
        groups: dict[int, list[torch.Tensor]] = {}
        for i in entry_indices:
            groups.setdefault(self.entries[i].group_index, []).append(self.entries[i].main)
        return list(groups.items())

    def _warn_if_resident_large(self) -> None:
        numel = sum(self.entries[i].main.numel() for i in self._resident_entries)
        if numel > self.config.resident_warn_elements:
            logger.warning(
                "%d elements of fp32 params (%.2f GB of state) stay resident on the device: their "
                "main is the model param itself, so it cannot be streamed; keep large params in "
                "bf16/fp16 with fp32 mains to stream them",
                numel,
                numel * MATERIALIZED_BYTES_PER_ELEMENT / 1e9,
            )

    @contextlib.contextmanager
    def _open(self, bucket: BucketLayout) -> Iterator[int]:
        fd = open_bucket_file(self.scratch.file(bucket.file_name))
        try:
            yield fd
        finally:
            os.close(fd)

    def _attach_grads(self, entry_indices: Sequence[int]) -> None:
        for i in entry_indices:
            entry = self.entries[i]
            grad = self._grad_fn(entry)
            if grad is not entry.main.grad:
                entry.main.grad = grad

    def _fetch(
        self, bucket: BucketLayout, optimizer: BucketOptimizer, entries: list[Entry], fd: int, stats: StepStats
    ) -> None:
        path = self.scratch.file(bucket.file_name)
        main_segment = bucket.segments["main"]
        for k, entry in enumerate(entries):
            self._residency.materialize(entry.main)
            self._engine.read(fd, path, main_segment.entry_offsets[k], _bytes_of(entry.main))
            stats.bytes_read += main_segment.entry_nbytes[k]
            moments = optimizer.moments(entry.main)
            if moments is None:
                continue  # no update yet: the optimizer creates the moments itself
            for name, moment in zip(MOMENT_SEGMENTS, moments, strict=True):
                segment = bucket.segments[name]
                self._residency.materialize(moment)
                self._read_cast(fd, path, segment.entry_offsets[k], moment, segment.dtype)
                stats.bytes_read += segment.entry_nbytes[k]

    def _read_cast(self, fd: int, path: str, offset: int, dst: torch.Tensor, stored: torch.dtype) -> None:
        if stored == dst.dtype:
            self._engine.read(fd, path, offset, _bytes_of(dst))
            return
        # Read the stored format into a device temporary, then widen on the device.
        tmp = torch.empty(dst.shape, dtype=stored, device=dst.device)
        self._engine.read(fd, path, offset, _bytes_of(tmp))
        dst.copy_(tmp)

    def _write_cast(self, fd: int, path: str, offset: int, src: torch.Tensor, stored: torch.dtype) -> None:
        # Narrow on the device before the host copy: a same-dtype device->host copy
        # is far faster than a converting one.
        data = src if stored == src.dtype else src.to(stored)
        self._engine.write(fd, path, offset, _bytes_of(data))

    def _step_bucket(self, bucket: BucketLayout, optimizer: BucketOptimizer, stats: StepStats) -> None:
        entries = [self.entries[i] for i in bucket.entry_indices]
        path = self.scratch.file(bucket.file_name)
        with self._open(bucket) as fd:
            try:
                self._fetch(bucket, optimizer, entries, fd, stats)
                self._attach_grads(bucket.entry_indices)
                fresh = [e for e in entries if optimizer.moments(e.main) is None]
                optimizer.step()
                for entry in fresh:
                    # Moments the optimizer created in this step (an entry's first update).
                    for moment in optimizer.moments(entry.main) or ():
                        self._residency.adopt(moment)
                for entry in entries:
                    entry.main.grad = None  # the fp32 grad is not state; drop it now
                for k, entry in enumerate(entries):
                    self._copy_to_model(entry)
                    self._engine.write(fd, path, bucket.segments["main"].entry_offsets[k], _bytes_of(entry.main))
                    stats.bytes_written += bucket.segments["main"].entry_nbytes[k]
                    moments = optimizer.moments(entry.main)
                    if moments is None:
                        continue
                    for name, moment in zip(MOMENT_SEGMENTS, moments, strict=True):
                        segment = bucket.segments[name]
                        self._write_cast(fd, path, segment.entry_offsets[k], moment, segment.dtype)
                        stats.bytes_written += segment.entry_nbytes[k]
            finally:
                self._release(entries, optimizer)
        stats.buckets += 1

    def _release(self, entries: list[Entry], optimizer: BucketOptimizer) -> None:
        for entry in entries:
            self._residency.release(entry.main)
            for moment in optimizer.moments(entry.main) or ():
                self._residency.release(moment)

    @torch.no_grad()
    def _write_mains(self, fill: CopyFn | None) -> None:
        for bucket in self.buckets:
            entries = [self.entries[i] for i in bucket.entry_indices]
            path = self.scratch.file(bucket.file_name)
            segment = bucket.segments["main"]
            with self._open(bucket) as fd:
                for k, entry in enumerate(entries):
                    if fill is None:
                        self._residency.adopt(entry.main)  # already holds its initial value
                    else:
                        self._residency.materialize(entry.main)
                        fill(entry.param, entry.main)
                    try:
                        self._engine.write(fd, path, segment.entry_offsets[k], _bytes_of(entry.main))
                    finally:
                        self._residency.release(entry.main)


def bind_master(master: torch.optim.Optimizer, store: StreamingStore, *, read_state_with: str) -> None:
    """Route ``master``'s own entry points to ``store``, on this instance only.

    The master optimizer holds no state once its state streams: its ``step``
    becomes the streamed step, and ``state_dict`` / ``load_state_dict`` refuse
    (they would claim a state without moments or mains). ``read_state_with``
    tells the caller where the state can be read instead.
    """

    def streamed_step(self: torch.optim.Optimizer, closure: None = None) -> StepStats:
        if closure is not None:
            raise StreamConfigError("a streamed optimizer step takes no closure: compute the loss before step()")
        return store.step()

    def refuse_state_dict(self: torch.optim.Optimizer, *args, **kwargs):
        raise StreamConfigError(
            "this optimizer's state is streamed: its state_dict would hold none of the moments "
            f"or fp32 mains; read them with {read_state_with}"
        )

    # Bound as methods of the instance (not of the class): LR schedulers re-wrap
    # `step` through its __func__, which must take the optimizer as first argument.
    master.step = types.MethodType(streamed_step, master)
    master.state_dict = types.MethodType(refuse_state_dict, master)
    master.load_state_dict = types.MethodType(refuse_state_dict, master)
