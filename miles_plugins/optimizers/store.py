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
import shutil
import stat
import time
import types
import zlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_hooks.contract import OptimizerStateStore
from miles_plugins.optimizers.adam import AdamBackend, BucketOptimizer
from miles_plugins.optimizers.config import StreamConfig, StreamConfigError
from miles_plugins.optimizers.io import (
    StagingBuffer,
    StreamIOError,
    SyncFileEngine,
    copy_file_crc32,
    open_bucket_file,
    preallocate,
    pwrite_full,
)
from miles_plugins.optimizers.layout import (
    MAIN_DTYPE,
    MATERIALIZED_BYTES_PER_ELEMENT,
    MOMENT_SEGMENTS,
    BucketLayout,
    layout_bucket,
    plan_buckets,
)
from miles_plugins.optimizers.manifest import (
    FORMAT as MANIFEST_FORMAT,
)
from miles_plugins.optimizers.manifest import (
    FORMAT_VERSION,
    RESIDENT_FILE,
    CheckpointMismatchError,
    Manifest,
    differences,
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
        topology: the parallel layout this state belongs to (sizes and this
            rank's coordinates), recorded by ``save_to`` and required equal by
            ``load_from``.

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
        topology: dict[str, int] | None = None,
    ) -> None:
        self.config = config
        self.topology = dict(topology or {})
        self._optimizer_class = f"{type(backend.master).__module__}.{type(backend.master).__qualname__}"
        # Set when a load failed after it began overwriting the scratch files.
        self._damaged: str | None = None
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
        if self._damaged:
            raise RuntimeError(
                f"the optimizer-state store at {self.scratch.path} holds no consistent state: {self._damaged}. "
                "Load a good checkpoint into a fresh process"
            )

    # ---- checkpoints ---------------------------------------------------------

    def _description(self) -> dict:
        """The manifest fields a load must match."""
        return {
            "store": self.config.name,
            "main_dtype": str(MAIN_DTYPE).removeprefix("torch."),
            "moment_dtype": self.config.moment_dtype,
            "topology": self.topology,
            "layout": [{"file": b.file_name, "size": b.file_size, "numels": list(b.numels)} for b in self.buckets],
            "resident_numels": [self.entries[i].main.numel() for i in self._resident_entries],
            "optimizer_class": self._optimizer_class,
        }

    def save_to(self, base_dir: str) -> None:
        """Save the full state under ``base_dir/<name>``, atomically.

        Everything goes to a private temporary directory first (bucket files,
        resident moments, the manifest last, each fsynced), which is then renamed
        into place: ``base_dir/<name>`` is either the previous complete save or
        this one, never a mix. Call between steps.
        """
        self._check_open()
        start = time.perf_counter()
        final = os.path.join(base_dir, self.config.name)
        partial = os.path.join(base_dir, f".{self.config.name}.partial")
        os.makedirs(base_dir, mode=0o700, exist_ok=True)
        _remove_private_dir(partial)  # left by a save that was interrupted
        os.mkdir(partial, 0o700)
        try:
            files = {}
            buffer = self._engine.staging.view
            for bucket in self.buckets:
                with self._open(bucket) as src, _create(partial, bucket.file_name) as dst:
                    crc = copy_file_crc32(
                        src,
                        self.scratch.file(bucket.file_name),
                        dst,
                        os.path.join(partial, bucket.file_name),
                        bucket.file_size,
                        buffer,
                    )
                    os.fsync(dst)
                files[bucket.file_name] = {"size": bucket.file_size, "crc32": crc}
            if self._resident_optimizer is not None:
                files[RESIDENT_FILE] = self._save_resident(partial)
            manifest = Manifest(
                {
                    "format": MANIFEST_FORMAT,
                    "format_version": FORMAT_VERSION,
                    **self._description(),
                    "steps_taken": self.steps_taken,
                    "bucket_state": [o.export_state() for o in self._bucket_optimizers],
                    "resident_state": self._resident_optimizer.export_state() if self._resident_optimizer else None,
                    "files": files,
                }
            )
            manifest.write(partial)
            _fsync_dir(partial)
            replaced = os.path.join(base_dir, f".{self.config.name}.replaced")
            _remove_private_dir(replaced)
            if os.path.lexists(final):
                os.rename(final, replaced)
            os.rename(partial, final)
            _fsync_dir(base_dir)
            _remove_private_dir(replaced)
        except BaseException:
            _remove_private_dir(partial)
            raise
        seconds = time.perf_counter() - start
        nbytes = sum(f["size"] for f in files.values())
        logger.info(
            "saved streamed optimizer state %s: %.2f GB in %.2f s (%.2f GB/s) to %s",
            self.config.name,
            nbytes / 1e9,
            seconds,
            nbytes / 1e9 / max(seconds, 1e-9),
            final,
        )

    def load_from(self, base_dir: str) -> bool:
        """Restore the state ``save_to`` left under ``base_dir/<name>``.

        Returns False when there is none. Verifies the manifest against this
        store (dtypes, layout, topology: every difference is reported at once)
        and each file's size before touching the live state, and each file's
        CRC-32 while copying it in; any mismatch raises
        :class:`CheckpointMismatchError`. A checksum that fails after copying
        began leaves the store refusing to step.
        """
        self._check_open()
        source = os.path.join(base_dir, self.config.name)
        if not os.path.isdir(source):
            return False
        manifest = Manifest.read(source)
        problems = differences(manifest.data, self._description())
        for name, expected in sorted(manifest.files.items()):
            try:
                size = os.lstat(os.path.join(source, name)).st_size
            except FileNotFoundError:
                problems.append(f"{name} is missing")
                continue
            if size != expected["size"]:
                problems.append(f"{name} has {size} bytes, the manifest says {expected['size']} (truncated?)")
        expected_files = {b.file_name for b in self.buckets} | ({RESIDENT_FILE} if self._resident_optimizer else set())
        if not problems and set(manifest.files) != expected_files:
            problems.append(
                f"the manifest lists files {sorted(manifest.files)}, this store needs {sorted(expected_files)}"
            )
        if problems:
            raise CheckpointMismatchError(
                f"cannot load the streamed optimizer state in {source}:\n  - " + "\n  - ".join(problems)
            )
        start = time.perf_counter()
        resident = self._read_resident(source, manifest) if self._resident_optimizer is not None else None
        buffer = self._engine.staging.view
        for bucket in self.buckets:
            src_path = os.path.join(source, bucket.file_name)
            src = os.open(src_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                with self._open(bucket) as dst:
                    crc = copy_file_crc32(
                        src, src_path, dst, self.scratch.file(bucket.file_name), bucket.file_size, buffer
                    )
            except BaseException as exc:
                self._damaged = f"loading {src_path} failed part way ({exc})"
                raise
            finally:
                os.close(src)
            if crc != manifest.files[bucket.file_name]["crc32"]:
                self._damaged = f"{src_path} failed its checksum while being loaded"
                raise CheckpointMismatchError(
                    f"{src_path}: CRC-32 {crc:#010x} does not match the manifest's "
                    f"{manifest.files[bucket.file_name]['crc32']:#010x}: the checkpoint is corrupt"
                )
        for optimizer, saved in zip(self._bucket_optimizers, manifest.data["bucket_state"], strict=True):
            optimizer.import_state(saved, materialize=False)
        if resident is not None:
            self._restore_resident(manifest.data["resident_state"], resident)
        self.steps_taken = manifest.data["steps_taken"]
        logger.info(
            "loaded streamed optimizer state %s (step %d) from %s in %.2f s",
            self.config.name,
            self.steps_taken,
            source,
            time.perf_counter() - start,
        )
        return True

    def _resident_moments(self) -> Iterator[torch.Tensor]:
        for i in self._resident_entries:
            yield from self._resident_optimizer.moments(self.entries[i].main) or ()

    def _save_resident(self, directory: str) -> dict[str, int]:
        # Small (a warning fires above resident_warn_elements): one CPU copy per moment.
        crc, size = 0, 0
        with _create(directory, RESIDENT_FILE) as fd:
            for moment in self._resident_moments():
                data = moment.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                pwrite_full(fd, os.path.join(directory, RESIDENT_FILE), size, memoryview(data))
                crc = zlib.crc32(data, crc)
                size += len(data)
            os.fsync(fd)
        return {"size": size, "crc32": crc}

    def _read_resident(self, source: str, manifest: Manifest) -> bytes:
        path = os.path.join(source, RESIDENT_FILE)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        expected = manifest.files[RESIDENT_FILE]["crc32"]
        if zlib.crc32(data) != expected:
            raise CheckpointMismatchError(
                f"{path}: CRC-32 {zlib.crc32(data):#010x} does not match the manifest's {expected:#010x}: "
                "the checkpoint is corrupt"
            )
        return data

    def _restore_resident(self, saved: dict, data: bytes) -> None:
        self._resident_optimizer.import_state(saved, materialize=True)
        offset = 0
        for moment in self._resident_moments():
            n = moment.numel() * moment.element_size()
            source = torch.frombuffer(bytearray(data[offset : offset + n]), dtype=torch.uint8)
            moment.view(-1).view(torch.uint8).copy_(source)
            offset += n
        if offset != len(data):
            raise CheckpointMismatchError(
                f"{RESIDENT_FILE} holds {len(data)} bytes, the restored moments take {offset}"
            )

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


@contextlib.contextmanager
def _create(directory: str, name: str) -> Iterator[int]:
    """A new private file in ``directory``, never through a symlink."""
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StreamIOError(f"cannot create {path}: {exc.strerror}", path, 0, exc.errno) from exc
    try:
        yield fd
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_private_dir(path: str) -> None:
    """Delete a directory this store made; refuse anything else found at that name."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise StreamIOError(f"refusing to delete {path}: not a plain directory (a symlink or file)", path, 0)
    shutil.rmtree(path)


def bind_master(master: torch.optim.Optimizer, store: OptimizerStateStore, *, read_state_with: str) -> None:
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
