"""The bucket lifecycle: the streamed optimizer state and its step.

Between steps every streamed fp32 main and Adam moment has its storage released
(the tensor keeps its shape, its storage has 0 bytes); the bytes live in the
backing (one file per bucket, or pinned host memory). ``step()`` walks the
buckets as a pipeline: *fetch* (materialize the bucket's mains and moments and
read them; no moments on a bucket's first step, the optimizer creates them),
*compute* (attach the fp32 grads, run the master optimizer's exact update, copy
the updated mains into the model params), *store* (write mains and moments
back), *retire* (wait for the writes, release everything). With the pipelined
engine, bucket i+1 is being read and bucket i-1 written while bucket i
computes; at most ``buckets_in_flight`` buckets are materialized at once, which
bounds the optimizer state on the device. The sync engine is the same walk one
bucket at a time. On the disk tier a step reads one slot of each bucket and
writes the other, and commits only after the last write: a step that fails part
way is rolled back (see ``step``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import stat
import time
import types
import zlib
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from megatron_hooks.contract import OptimizerStateStore
from miles_plugins.optimizers import remainder
from miles_plugins.optimizers.adam import AdamBackend, BucketOptimizer
from miles_plugins.optimizers.config import StreamConfig, StreamConfigError
from miles_plugins.optimizers.convert import narrow_in_place, stored_view, widen_in_place
from miles_plugins.optimizers.io import (
    FileBacking,
    HostBacking,
    PipelinedEngine,
    StreamIOError,
    StreamIOTimeout,
    SyncEngine,
    Ticket,
    Transfer,
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
    """Measures the optimizer-state bytes materialized on the device at once.
    (Storage-format conversions run inside these tensors, with one small chunk
    of scratch: ``convert.CHUNK_ELEMENTS``.)"""

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


@dataclass
class _Flight:
    """One bucket between its fetch and its retirement.

    ``converts`` are tensors a read fills in their stored format (the first
    bytes of their own storage), to be widened or decoded once it is done.
    """

    bucket: BucketLayout
    optimizer: BucketOptimizer
    entries: list[Entry]
    handle: object
    reads: Ticket | None = None
    writes: Ticket | None = None
    converts: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)


class StreamingStore:
    """Optimizer state for ``entries``, streamed through a backing tier.

    Args:
        entries: the params and their fp32 mains. Streamed mains must be
            contiguous fp32 tensors owning their storage; their content at
            construction is the initial state unless ``init_main`` is given.
        backend: reproduces the master optimizer's update (see ``adam.py``).
        config: where and how to store the state (tier, engine, formats).
        grad_fn: the fp32 grad for an entry's main, or None when the param got
            no grad this step (it is then not updated, as in torch). Defaults to
            ``entry.main.grad``.
        copy_to_model: writes an updated main back into the model param.
            Called once per streamed entry per step, after its update. With
            remainder mains, ``entry.param`` must then hold the main rounded to
            bf16, and keep it until the next step (see ``remainder.py``).
        init_main: ``init_main(param, main)`` fills a main from its param; when
            given, the initial mains are built bucket by bucket through it, so
            they never all exist at once.
        topology: the parallel layout this state belongs to (sizes and this
            rank's coordinates), recorded by ``save_to`` and required equal by
            ``load_from``.

    Construction validates the directory and free space before writing
    anything (disk tier), then writes every bucket's initial mains and releases
    them. Entries whose model param is fp32 stay resident under one small
    optimizer of the same class.
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
        # Set when a step or a load failed in a way that left no consistent state.
        self._damaged: str | None = None
        # Set when transfers hung: their memory and threads are abandoned.
        self._hung = False
        self._closed = False
        self.entries = list(entries)
        self._grad_fn = grad_fn or (lambda entry: entry.main.grad)
        self._copy_to_model = copy_to_model or (lambda entry: None)
        self._residency = _Residency()
        self.last_step = StepStats()
        self.total = StepStats()
        self.steps_taken = 0
        # Buckets whose fetch prefetch() started, and what those reads moved.
        self._prefetched: deque[_Flight] = deque()
        self._prefetch_stats = StepStats()

        streamed = [i for i, e in enumerate(self.entries) if not e.resident]
        for i in streamed:
            main = self.entries[i].main
            if main.dtype != torch.float32 or not main.is_contiguous():
                raise ValueError(f"entry {i}: a streamed main must be a contiguous fp32 tensor, got {main.dtype}")
            if config.main_storage == "remainder" and self.entries[i].param.dtype != torch.bfloat16:
                raise StreamConfigError(
                    f"remainder mains need bf16 params (the main's high half), entry {i} is "
                    f"{self.entries[i].param.dtype}; use main_storage='fp32'"
                )
        self._device = self.entries[streamed[0]].main.device if streamed else torch.device("cpu")
        plan = plan_buckets(
            [self.entries[i].main.numel() for i in streamed],
            [self.entries[i].bucket_key for i in streamed],
            config.bucket_cap_elements,
        )
        main_dtype = remainder.STORAGE_DTYPE if config.main_storage == "remainder" else MAIN_DTYPE
        self.buckets: list[BucketLayout] = [
            layout_bucket(
                b,
                [streamed[j] for j in members],
                [self.entries[streamed[j]].main.numel() for j in members],
                config.moment_torch_dtype,
                main_dtype,
            )
            for b, members in enumerate(plan)
        ]
        # Remainder mains: per bucket, per entry, the elements the rounding rule misses.
        self._exceptions = [[remainder.Exceptions.none() for _ in b.numels] for b in self.buckets]
        self._bucket_optimizers = [backend.build(self._groups_of(b.entry_indices)) for b in self.buckets]
        self._resident_entries = [i for i, e in enumerate(self.entries) if e.resident]
        self._resident_optimizer = (
            backend.build(self._groups_of(self._resident_entries)) if self._resident_entries else None
        )
        self._warn_if_resident_large()

        pin = torch.cuda.is_available()
        # Disk tier: checks free space and the directory before anything is written.
        self.scratch = (
            ScratchDir(config.directory, config.name, FileBacking.bytes_needed(self.buckets))
            if config.tier == "disk"
            else None
        )
        self._engine = self._backing = None
        try:
            if self.scratch is not None:
                self._backing = FileBacking(
                    self.scratch.path, self.buckets, direct=config.pipelined and config.direct_io
                )
            else:
                self._backing = HostBacking(self.buckets, pin=pin)
            if config.pipelined:
                self._engine = PipelinedEngine(
                    config.io_threads, config.staging_bytes, pin, self._device, config.io_timeout_s
                )
            else:
                self._engine = SyncEngine(config.staging_bytes, pin)
            self._write_mains(init_main)
        except BaseException:
            self._shut_down()
            raise
        logger.info(
            "optimizer state streams through %s (%s engine%s): %d buckets, %.2f GB stored, %.2f GB "
            "materialized state total, largest bucket %.2f GB, %d in flight; %d fp32 params resident",
            self.location,
            config.engine,
            ", direct I/O" if getattr(self._backing, "direct", False) else "",
            len(self.buckets),
            self.file_bytes_total / 1e9,
            self.state_bytes_total / 1e9,
            self.bucket_bytes_max / 1e9,
            config.depth,
            len(self._resident_entries),
        )

    # ---- sizes ---------------------------------------------------------------

    @property
    def location(self) -> str:
        """Where the state lives: the scratch directory, or host memory."""
        return self.scratch.path if self.scratch is not None else "pinned host memory"

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
        """Bytes the stored state takes (its storage formats, alignment padding included)."""
        return sum(b.file_size for b in self.buckets)

    @property
    def max_resident_state_bytes(self) -> int:
        """Measured: the most streamed-state bytes materialized at once so far."""
        return self._residency.peak

    # ---- the contract --------------------------------------------------------

    @torch.no_grad()
    def step(self) -> StepStats:
        """One optimizer step over all state; returns what it moved (also in ``last_step``).

        On the disk tier the step writes every bucket to the other slot and
        commits only when all are written. A step that fails part way raises,
        and the store is as it was before the step: the bucket optimizers' step
        counts and the model params of the buckets it had updated are rolled
        back (their params rewritten from the committed mains), so the caller
        may save a checkpoint or run the whole optimizer step again, losing
        nothing but the step in progress. Where that cannot be done (the host
        tier writes in place; remainder mains need the params the step
        overwrote; transfers hung) the store refuses to step again.
        """
        self._check_open()
        start = time.perf_counter()
        stats, self._prefetch_stats = self._prefetch_stats, StepStats()
        ahead, self._prefetched = self._prefetched, deque()
        writing: deque[_Flight] = deque()
        current = None
        updated: list[tuple[_Flight, dict | None]] = []  # buckets whose params this step changed, their prior state
        try:
            for i in range(len(self.buckets)):
                self._read_ahead(i + self.config.depth - 1, ahead, writing, stats)
                current = ahead.popleft()
                self._finish_fetch(current)
                # The pre-update state a roll-back restores (not taken where none is possible).
                prior = current.optimizer.export_state() if self._rollback_blocker is None else None
                updated.append((current, prior))
                self._compute(current)
                self._start_store(current, stats)
                writing.append(current)
                current = None
            while writing:
                self._retire_oldest(writing)
            # Last: fp32-native params are updated in place, with no copy to roll back to.
            if self._resident_optimizer is not None:
                self._attach_grads(self._resident_entries)
                self._resident_optimizer.step()
        except BaseException as exc:
            self._hung = self._abort([*ahead, *writing, *([current] if current else [])])
            self._roll_back(updated, exc)
            raise
        self._backing.commit()
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

    @property
    def _rollback_blocker(self) -> str | None:
        """Why a failed step cannot be rolled back, or None when it can."""
        if not self._backing.keeps_previous_state:
            return "the host tier writes in place"
        if self.config.main_storage == "remainder":
            return "remainder mains need the params the step overwrote"
        return None

    def _roll_back(self, updated: list[tuple[_Flight, dict | None]], exc: BaseException) -> None:
        """After a failed step: restore the pre-step state, or mark the store damaged."""
        failed = f"step {self.steps_taken + 1} failed ({exc})"
        if self._hung:
            self._damaged = f"{failed}; transfers still hang, their memory cannot be reused"
            return
        if not updated:
            return  # no bucket was updated: nothing changed
        if self._rollback_blocker is not None:
            self._damaged = f"{failed} after updating {len(updated)} buckets, and {self._rollback_blocker}"
            return
        try:
            for flight, prior in updated:
                flight.optimizer.import_state(prior, materialize=False)
            self._restore_params([flight.bucket for flight, _ in updated])
        except BaseException as again:
            self._damaged = f"{failed}, and rolling back its {len(updated)} updated buckets failed too ({again})"
            return
        logger.warning(
            "%s; the optimizer state and the params of the %d buckets it had updated are back at step %d: "
            "only this step is lost",
            failed,
            len(updated),
            self.steps_taken,
        )

    def _restore_params(self, buckets: Sequence[BucketLayout]) -> None:
        """Rewrite the model params of ``buckets`` from their committed fp32 mains."""
        for bucket in buckets:
            flight = self._start_fetch(bucket, self._bucket_optimizers[bucket.index], StepStats(), moments=False)
            try:
                self._finish_fetch(flight)
                for entry in flight.entries:
                    self._copy_to_model(entry)
            finally:
                self._abort([flight])

    def prefetch(self) -> None:
        """Start reading the first buckets of the next step now (pipelined engine;
        a no-op otherwise, or when already started). Call it as early as the
        caller can, e.g. before the grad-norm reduction: the reads then overlap it.
        Anything that changes the stored state first drops what was prefetched."""
        self._check_open()
        if not self.config.pipelined or self._prefetched:
            return
        try:
            self._read_ahead(self.config.depth - 1, self._prefetched, deque(), self._prefetch_stats)
        except BaseException:
            self._drop_prefetch()
            raise

    def refresh_main_from_model_params(self, copy_fn: CopyFn) -> None:
        """Rebuild every streamed main from its model param; moments stay as they are."""
        self._check_open()
        self._drop_prefetch()
        self._write_mains(copy_fn)

    def close(self) -> None:
        """Delete the stored state (scratch files or host buffers) and release the directory lock."""
        if self._closed:
            return
        self._drop_prefetch()
        self._shut_down()

    def _shut_down(self) -> None:
        self._closed = True
        if self._engine is not None:
            self._engine.close(wait=not self._hung)
        if isinstance(self._backing, HostBacking):
            self._backing.release()
        self._backing = None
        if self.scratch is not None:
            self.scratch.remove()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the optimizer-state store at {self.location} was closed; its state is gone")
        if self._damaged:
            raise RuntimeError(
                f"the optimizer-state store at {self.location} holds no consistent state: {self._damaged}. "
                "Load a good checkpoint into a fresh process"
            )

    # ---- checkpoints ---------------------------------------------------------

    def _description(self) -> dict:
        """The manifest fields a load must match."""
        return {
            "store": self.config.name,
            "main_dtype": "fp32" if self.config.main_storage == "fp32" else "fp32 as bf16 param + int16 remainder",
            "moment_dtype": self.config.moment_dtype,
            "topology": self.topology,
            "layout": [{"file": b.file_name, "size": b.file_size, "numels": list(b.numels)} for b in self.buckets],
            "resident_numels": [self.entries[i].main.numel() for i in self._resident_entries],
            "optimizer_class": self._optimizer_class,
        }

    def save_to(self, base_dir: str) -> None:
        """Save the full state under ``base_dir/<name>``, atomically.

        Checks first that ``base_dir`` has room for the whole save beside any
        previous one. Everything goes to a private temporary directory
        (``.<name>.partial``: bucket files, resident moments, the manifest last,
        each fsynced), which then trades places with ``base_dir/<name>`` in one
        atomic exchange: at every instant, a crash included, ``<name>`` is the
        previous complete save or this one, never a mix, never missing. Call
        between steps.
        """
        self._check_open()
        self._drop_prefetch()
        start = time.perf_counter()
        final = os.path.join(base_dir, self.config.name)
        partial = os.path.join(base_dir, f".{self.config.name}.partial")
        os.makedirs(base_dir, mode=0o700, exist_ok=True)
        _remove_private_dir(partial)  # left by a save that was interrupted
        needed = self.file_bytes_total + self._resident_bytes()
        free = shutil.disk_usage(base_dir).free
        if free < needed:
            raise StreamIOError(
                f"not enough free space to save the optimizer state in {base_dir}: needs {needed} bytes, "
                f"{free} free; nothing was written (a previous save there is untouched)",
                base_dir,
                0,
                errno.ENOSPC,
            )
        os.mkdir(partial, 0o700)
        try:
            files = {}
            buffer = self._engine.idle_buffer()
            for bucket in self.buckets:
                with _create(partial, bucket.file_name) as dst:
                    crc = self._backing.export(bucket, dst, os.path.join(partial, bucket.file_name), buffer)
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
                    "main_exceptions": self._export_exceptions(),
                    "files": files,
                }
            )
            manifest.write(partial)
            _fsync_dir(partial)
            if os.path.lexists(final):
                _check_private_dir(final)
                _exchange(partial, final)  # the previous save is now at `partial`
            else:
                os.rename(partial, final)
            _fsync_dir(base_dir)
            _remove_private_dir(partial)
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
        self._drop_prefetch()
        source = os.path.join(base_dir, self.config.name)
        if not os.path.lexists(source):
            return False
        _check_private_dir(source)
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
        buffer = self._engine.idle_buffer()
        for bucket in self.buckets:
            src_path = os.path.join(source, bucket.file_name)
            src = os.open(src_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                crc = self._backing.restore(bucket, src, src_path, buffer)
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
        self._import_exceptions(manifest.data.get("main_exceptions"))
        self.steps_taken = manifest.data["steps_taken"]
        logger.info(
            "loaded streamed optimizer state %s (step %d) from %s in %.2f s",
            self.config.name,
            self.steps_taken,
            source,
            time.perf_counter() - start,
        )
        return True

    def _resident_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self._resident_moments()) if self._resident_optimizer else 0

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

    def _export_exceptions(self) -> list | None:
        """Remainder mains' exceptions as JSON: per bucket, per entry, [indices, high bits]."""
        if self.config.main_storage != "remainder":
            return None
        return [[[e.index.tolist(), e.high.tolist()] for e in bucket] for bucket in self._exceptions]

    def _import_exceptions(self, saved: list | None) -> None:
        if self.config.main_storage != "remainder":
            return
        self._exceptions = [
            [
                remainder.Exceptions(
                    torch.tensor(index, dtype=torch.int64), torch.tensor(high, dtype=remainder.STORAGE_DTYPE)
                )
                for index, high in bucket
            ]
            for bucket in saved
        ]

    # ---- reading the state back (tests, the demo, checkpoint export) ---------

    @torch.no_grad()
    def iter_state(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Yield (entry index, main, exp_avg, exp_avg_sq) as fp32 CPU copies, one bucket
        in memory at a time; moments are None before the entry's first update."""
        self._check_open()
        self._drop_prefetch()
        for i in self._resident_entries:
            moments = self._resident_optimizer.moments(self.entries[i].main)
            yield (i, self.entries[i].main.detach().cpu().clone(), *self._cpu_moments(moments))
        for bucket, optimizer in zip(self.buckets, self._bucket_optimizers, strict=True):
            flight = self._start_fetch(bucket, optimizer, StepStats())
            try:
                self._finish_fetch(flight)
                for i, entry in zip(bucket.entry_indices, flight.entries, strict=True):
                    yield (i, entry.main.cpu().clone(), *self._cpu_moments(optimizer.moments(entry.main)))
            finally:
                self._abort([flight])

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

    def _attach_grads(self, entry_indices: Sequence[int]) -> None:
        for i in entry_indices:
            entry = self.entries[i]
            grad = self._grad_fn(entry)
            if grad is not entry.main.grad:
                entry.main.grad = grad

    def _tensors(self, flight: _Flight, k: int, moments: bool = True) -> list[tuple[str, torch.Tensor]]:
        """(segment, fp32 tensor) of entry ``k``: its main, then its moments if it has any."""
        main = flight.entries[k].main
        state = flight.optimizer.moments(main) if moments else None
        return [("main", main), *(zip(MOMENT_SEGMENTS, state, strict=True) if state is not None else ())]

    def _read_ahead(self, last: int, ahead: deque[_Flight], writing: deque[_Flight], stats: StepStats) -> None:
        """Start fetching buckets up to index ``last``, after those in ``ahead``;
        while ``buckets_in_flight`` are materialized, retire the oldest write first."""
        started = (ahead[-1].bucket.index + 1) if ahead else (writing[-1].bucket.index + 1 if writing else 0)
        for index in range(started, min(last, len(self.buckets) - 1) + 1):
            while len(ahead) + len(writing) >= self.config.depth:
                if not writing:
                    return
                self._retire_oldest(writing)
            ahead.append(self._start_fetch(self.buckets[index], self._bucket_optimizers[index], stats))

    def _start_fetch(
        self, bucket: BucketLayout, optimizer: BucketOptimizer, stats: StepStats, moments: bool = True
    ) -> _Flight:
        """Materialize the bucket's mains and moments and submit their reads. A
        stored format other than fp32 lands in the first bytes of the tensor's
        own storage, converted in place by :meth:`_finish_fetch`."""
        flight = _Flight(bucket, optimizer, [self.entries[i] for i in bucket.entry_indices], None)
        transfers: list[Transfer] = []
        try:
            flight.handle = self._backing.open(bucket)
            for k in range(len(flight.entries)):
                for name, tensor in self._tensors(flight, k, moments):
                    segment = bucket.segments[name]
                    self._residency.materialize(tensor)
                    if segment.dtype != tensor.dtype:
                        flight.converts.append((name, k, tensor))
                    transfers.append((segment.entry_offsets[k], _bytes_of(stored_view(tensor, segment.dtype))))
                    stats.bytes_read += segment.entry_nbytes[k]
            flight.reads = self._engine.read(flight.handle, transfers, self._ready_event())
        except BaseException:
            self._abort([flight])
            raise
        return flight

    def _finish_fetch(self, flight: _Flight) -> None:
        flight.reads.wait()
        flight.reads = None
        for name, k, tensor in flight.converts:
            if name == "main":
                exceptions = self._exceptions[flight.bucket.index][k]
                remainder.decode_in_place(tensor, flight.entries[k].param, exceptions)
            else:
                widen_in_place(tensor, flight.bucket.segments[name].dtype)
        flight.converts.clear()

    def _compute(self, flight: _Flight) -> None:
        optimizer = flight.optimizer
        self._attach_grads(flight.bucket.entry_indices)
        fresh = [e for e in flight.entries if optimizer.moments(e.main) is None]
        optimizer.step()
        for entry in fresh:
            # Moments the optimizer created in this step (an entry's first update).
            for moment in optimizer.moments(entry.main) or ():
                self._residency.adopt(moment)
        for entry in flight.entries:
            entry.main.grad = None  # the fp32 grad is not state; drop it now
            self._copy_to_model(entry)

    def _start_store(self, flight: _Flight, stats: StepStats, moments: bool = True) -> None:
        """Submit the writes of the bucket's mains (and moments). Narrowing to the
        stored format happens on the device, in place, before the host copy: a
        same-dtype device->host copy is far faster than a converting one. The
        fp32 values are gone afterwards; the bucket is released at retirement."""
        bucket = flight.bucket
        transfers: list[Transfer] = []
        for k, entry in enumerate(flight.entries):
            for name, tensor in self._tensors(flight, k, moments):
                segment = bucket.segments[name]
                if name == "main" and segment.dtype == remainder.STORAGE_DTYPE:
                    self._exceptions[bucket.index][k] = remainder.encode_in_place(tensor, entry.param)
                elif segment.dtype != tensor.dtype:
                    narrow_in_place(tensor, segment.dtype)
                transfers.append((segment.entry_offsets[k], _bytes_of(stored_view(tensor, segment.dtype))))
                stats.bytes_written += segment.entry_nbytes[k]
        # The writer threads copy on their own streams, after the update, the
        # narrowing and the encoding queued on this one.
        flight.writes = self._engine.write(flight.handle, transfers, self._ready_event())
        stats.buckets += 1

    def _ready_event(self) -> torch.cuda.Event | None:
        """An event on the caller's stream after everything queued so far (CUDA only)."""
        if self._device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _retire_oldest(self, writing: deque[_Flight]) -> None:
        """Wait for the oldest bucket's writes, then release its device memory. It
        leaves ``writing`` only then: after a failure the caller still aborts it."""
        flight = writing[0]
        flight.writes.wait()
        flight.writes = None
        writing.popleft()
        self._release(flight)

    def _release(self, flight: _Flight) -> None:
        for entry in flight.entries:
            self._residency.release(entry.main)
            for moment in flight.optimizer.moments(entry.main) or ():
                self._residency.release(moment)
        flight.converts.clear()
        if flight.handle is not None:
            flight.handle.close()
            flight.handle = None

    def _abort(self, flights: Sequence[_Flight]) -> bool:
        """Stop using ``flights`` after a failure or when their state is not needed:
        wait until no transfer touches their memory, then release it. Errors of
        the transfers themselves were (or will be) reported by their owner.
        Returns True when some transfers hung: their flights' memory is then
        left allocated, since a late transfer may still write into it."""
        hung = False
        for flight in flights:
            stuck = False
            for ticket in (flight.reads, flight.writes):
                if ticket is None:
                    continue
                try:
                    ticket.wait()
                except StreamIOTimeout:
                    stuck = True
                except BaseException:  # noqa: BLE001 - reported by the transfer's owner
                    pass
            if stuck:
                hung = True
                continue
            flight.reads = flight.writes = None
            self._release(flight)
        return hung

    def _drop_prefetch(self) -> None:
        flights, self._prefetched = self._prefetched, deque()
        if self._abort(flights):
            self._hung = True
            self._damaged = "prefetched reads hang; their memory cannot be reused"
        self._prefetch_stats = StepStats()

    @torch.no_grad()
    def _write_mains(self, fill: CopyFn | None) -> None:
        """Write every bucket's mains (moments untouched), ``buckets_in_flight`` at a
        time: filled from the params by ``fill``, or as they are when it is None.
        In place: a failure part way leaves the mains mixed, and the store refuses
        to step (after construction: the caller's refresh can then not be trusted)."""
        writing: deque[_Flight] = deque()
        try:
            for bucket, optimizer in zip(self.buckets, self._bucket_optimizers, strict=True):
                while len(writing) >= self.config.depth:
                    self._retire_oldest(writing)
                flight = _Flight(bucket, optimizer, [self.entries[i] for i in bucket.entry_indices], None)
                writing.append(flight)
                # In place: the moments in the committed slot stay as they are.
                flight.handle = self._backing.open(bucket, in_place=True)
                for entry in flight.entries:
                    if fill is None:
                        self._residency.adopt(entry.main)  # already holds its initial value
                    else:
                        self._residency.materialize(entry.main)
                        fill(entry.param, entry.main)
                self._start_store(flight, StepStats(), moments=False)
            while writing:
                self._retire_oldest(writing)
        except BaseException as exc:
            self._hung = self._abort(writing) or self._hung
            self._damaged = f"rewriting the mains failed part way ({exc})"
            raise


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


def _check_private_dir(path: str) -> None:
    """Refuse a symlink or file where a directory of saved state belongs."""
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise StreamIOError(f"refusing to use {path}: not a plain directory (a symlink or file)", path, 0)


def _remove_private_dir(path: str) -> None:
    """Delete a directory this store made (never following symlinks inside it);
    refuse anything else found at that name."""
    if not os.path.lexists(path):
        return
    _check_private_dir(path)
    shutil.rmtree(path)


# renameat2(2): swap two paths atomically (Linux >= 3.15; ext4, xfs, btrfs, tmpfs, ...).
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


def _exchange(a: str, b: str) -> None:
    """Atomically swap the directories at ``a`` and ``b``."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise StreamIOError(
            f"cannot swap {a} into place at {b}: {os.strerror(err)} (renameat2 RENAME_EXCHANGE; the "
            f"previous save at {b} is untouched)",
            b,
            0,
            err,
        )


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
