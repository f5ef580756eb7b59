"""The streamed optimizer state and its step.

Between steps every streamed fp32 main and Adam moment has its storage released
(the tensor keeps its shape; its storage has 0 bytes); the bytes live in the
backing (two slots of files per bucket, or pinned host memory). ``step()`` walks
the buckets through the pipeline (``step/pipeline.py``): each bucket is fetched,
updated by the master optimizer's exact math (``step/adam.py``), its mains copied
into the model params, and written back, with at most ``buckets_in_flight``
buckets on the device at once. On the disk tier a step reads one slot of each
bucket and writes the other, and commits only after the last write: a step that
fails part way is rolled back.

With an overlap window (``config.overlap_bytes``) the step leaves its last
buckets' writes to :meth:`StreamingStore.progress`, which the caller runs during
the next forward and backward; as they land it reads the next step's first
buckets into the room they leave.

The parts, each in its own module: where bytes live and how they move
(``homes/``), the walk (``step/pipeline.py``), the storage formats
(``step/codec.py``, ``formats/``), checkpoints (``checkpoint/``),
what a failed step can undo (``step/rollback.py``), the gpu home's moves and
offload (``step/gpu_home.py``), the overlap window (``step/overlap.py``), files
and directories (``homes/fs.py``, ``homes/scratch.py``). This module builds them
and runs the step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from miles_plugins.optimizers.checkpoint.description import describe_store
from miles_plugins.optimizers.checkpoint.persistence import Persistence
from miles_plugins.optimizers.checkpoint.reader import CheckpointReader
from miles_plugins.optimizers.checkpoint.writer import CheckpointWriter
from miles_plugins.optimizers.config import AUTO, DEFAULT_BUCKET_CAP_ELEMENTS, STAGING_REQUEST_MB, StreamConfig
from miles_plugins.optimizers.errors import StoreUnusableError, StreamConfigError
from miles_plugins.optimizers.formats import quant8, remainder
from miles_plugins.optimizers.formats.convert import CHUNK_ELEMENTS
from miles_plugins.optimizers.formats.layout import (
    MAIN_DTYPE,
    MATERIALIZED_BYTES_PER_ELEMENT,
    BucketLayout,
    layout_store,
)
from miles_plugins.optimizers.homes import auto_budget
from miles_plugins.optimizers.homes.auto_budget import AutoGpuBudget
from miles_plugins.optimizers.homes.backings import DeviceBacking, FileBacking, HostBacking
from miles_plugins.optimizers.homes.engines import PipelinedEngine, SyncEngine
from miles_plugins.optimizers.homes.placement import PlacedBacking, Placement
from miles_plugins.optimizers.step.adam import AdamBackend
from miles_plugins.optimizers.step.codec import Codec
from miles_plugins.optimizers.step.entries import CopyFn, Entry, EntryFn, GradFn, StepStats
from miles_plugins.optimizers.step.flight import Flight
from miles_plugins.optimizers.step.gpu_home import GpuHome
from miles_plugins.optimizers.step.overlap import OverlapWindow
from miles_plugins.optimizers.step.pipeline import LandingError, Pipeline
from miles_plugins.optimizers.step.rollback import StepRollback, first_written_in_place

logger = logging.getLogger(__name__)

# Backings of stores closed while transfers hung: a late copy may still write into them.
_ABANDONED: list = []

# What a step may allocate on the device beyond the buckets in flight, stated so
# the GPU tier can assert it (docs/performance.md, "GPU memory during a step"):
# - torch's Adam keeps one fp32 temporary per element of the bucket it updates
#   (the denominator sqrt(exp_avg_sq) + eps): 4 bytes per element;
ADAM_TEMPORARY_BYTES_PER_ELEMENT = 4
# - storage-format conversions work in chunks of CHUNK_ELEMENTS; the remainder
#   codec's chunk temporaries are the largest, 12 bytes per element (the 8-bit
#   codec's at most 9, plus 1/64 byte per element of the entry for its scales;
#   the fused kernels' packed groups of small entries 8). Not counted: a chunk or
#   packed group whose remainder exceptions overflow the device's slots (NaN mains)
#   keeps its fp32 values while the reference path finds them, up to twice this.
CONVERSION_SCRATCH_BYTES = 12 * CHUNK_ELEMENTS


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
            ``load_from`` (``shard_peers``: which other ranks' saves a load at
            another data-parallel size may read, ``checkpoint/reshard_load.py``).
        param_layout: where every param sits in its data-parallel buffers
            (``megatron.param_layout``), for offline resharding; or None.
        grad_bytes_per_element: device bytes ``grad_fn`` allocates per element
            of the bucket being updated (4 where it widens bf16 grads to fp32;
            0 where the fp32 grads exist already, as Megatron's do): part of
            :attr:`step_device_bytes_bound`.
        checkpoint_master_options: save the master's param-group options (lr as
            a scheduler left it, weight decay, ...) with the state and restore
            them on load: for callers whose own checkpoint cannot carry them
            (the master's ``state_dict`` refuses). Megatron's carries them.
        auto_gpu: with ``gpu_budget_bytes="auto"``, the rank's
            :class:`~miles_plugins.optimizers.homes.auto_budget.AutoGpuBudget`, shared
            by its stores (a Megatron chain); by default the store makes its own.
            It moves buckets into and out of the ``gpu`` home between steps
            (:meth:`move_to_gpu_home`, :meth:`move_from_gpu_home`).

    Construction validates the directory and free space before writing
    anything (disk tier), then writes every bucket's initial mains and releases
    them. Entries whose model param is fp32 are their own mains: their moments
    stream in buckets of their own, last (``fp32_param_moments="streamed"``), or
    stay resident with them under one small optimizer of the same class.
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
        param_layout: dict | None = None,
        grad_bytes_per_element: int = 0,
        checkpoint_master_options: bool = False,
        auto_gpu: AutoGpuBudget | None = None,
    ) -> None:
        config = auto_budget.resolve_host(config)
        self.auto_gpu = None
        auto_gpu_wanted = config.gpu_budget_bytes == AUTO
        if auto_gpu_wanted:
            config = dataclasses.replace(config, gpu_budget_bytes=0)  # the buckets start below the device
        self.config = config
        self.entries = list(entries)
        self._grad_bytes_per_element = grad_bytes_per_element
        self._grad_fn = grad_fn or (lambda entry: entry.main.grad)
        self._copy_to_model = copy_to_model or (lambda entry: None)
        # Set when a step or a load failed in a way that left no consistent state.
        self._damaged: str | None = None
        self._closed = False
        self.placed = self._engine = self._backing = self._pipeline = None
        self.last_step = StepStats()
        self.total = StepStats()
        self.steps_taken = 0
        # Checks the next step must pass first (before_next_step).
        self._step_checks: list[Callable[[], None]] = []

        streamed = _streamed_entries(self.entries, config)
        self._device = self.entries[streamed[0]].main.device if streamed else torch.device("cpu")
        self.buckets = _layout(self.entries, streamed, config)
        self._bucket_optimizers = [backend.build(_groups_of(self.entries, b.entry_indices)) for b in self.buckets]
        self._resident_entries, self._resident_optimizer = _resident(self.entries, backend, config)
        _warn_about_residency(config, self.buckets, sum(self.entries[i].main.numel() for i in self._resident_entries))

        # Each bucket's home and a disk bucket's directory, with the directories' scratches:
        # their free space is checked before anything is written. An auto GPU budget lends
        # the device's room at setup where host and disk cannot hold the state.
        gpu_room = _setup_gpu_room(self.entries, self.buckets, self._device, config) if auto_gpu_wanted else None
        self.placed = Placement(self.buckets, config, gpu_room)
        try:
            self._backing, self._engine = _open_backing_and_engine(config, self.buckets, self.placed, self._device)
            codec = Codec(self.buckets)
            self._pipeline = Pipeline(
                entries=self.entries,
                buckets=self.buckets,
                optimizers=self._bucket_optimizers,
                backing=self._backing,
                engine=self._engine,
                codec=codec,
                device=self._device,
                io_timeout_s=config.io_timeout_s,
                depth=config.depth,
                drain_before=first_written_in_place(self.buckets, self.placed),
            )
            self._window = OverlapWindow(config.overlap_bytes, self.buckets, self.placed, self._pipeline)
            self._gpu_home = GpuHome(
                self.placed, self._backing, self.buckets, self._engine, self._pipeline, self._device, self._settle
            )
            master_options = backend.master.param_groups if checkpoint_master_options else None
            self._persistence = _persistence(self, codec, backend, topology, param_layout, master_options)
            self._write_mains(init_main)
        except BaseException:
            self._shut_down()
            raise
        if auto_gpu_wanted:
            # Shared by the device's stores in this process (a Megatron chain's, several optimizers').
            self.auto_gpu = auto_gpu or AutoGpuBudget.for_device(self._device, config.auto_gpu_margin_bytes)
            self.auto_gpu.register(self, self._device)
        _log_setup(self)

    # ---- sizes ---------------------------------------------------------------

    @property
    def location(self) -> str:
        """Where the state lives (``Placement.location``)."""
        return self.placed.location(self._device)

    @property
    def placement(self) -> dict[str, int]:
        """Buckets per home (``gpu``, ``host``, ``disk``)."""
        return self.placed.counts()

    @property
    def home_bytes(self) -> dict[str, int]:
        """Stored bytes per home (``Placement.home_bytes``)."""
        return self.placed.home_bytes()

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
    def accounted_max_state_bytes(self) -> int:
        """The store's own count (accounting, not a measurement) of the most
        streamed-state bytes materialized on the device at once so far."""
        return self._pipeline.accounting.peak

    @property
    def step_device_bytes_bound(self) -> int:
        """The most device memory a step adds to what was allocated before it:
        ``buckets_in_flight`` largest buckets, Adam's temporary and the grads
        ``grad_fn`` makes for one bucket, and the conversion scratch (see the
        constants above); with an overlap window, the window's buckets too
        (:attr:`overlap_bytes_bound`: the step ends holding them). On CUDA the codec's
        graphs keep about one bucket's conversion scratch reserved between steps, in a
        pool of their own (``step/graphs.py``), which this does not count again, and
        the remainder encoder's exception slots stay allocated (``fused.ExceptionSlots``:
        8 KiB per encoder run of the largest bucket, 2 bytes per 1024 elements of a run
        beyond 4M, and as much pinned host memory), not counted either."""
        largest = max((b.numel for b in self.buckets), default=0)
        per_element = ADAM_TEMPORARY_BYTES_PER_ELEMENT + self._grad_bytes_per_element
        scales = quant8.SCALE_DTYPE.itemsize * -(-largest // quant8.BLOCK) if self.config.blockwise_moments else 0
        in_flight = self.config.depth * self.bucket_bytes_max
        return in_flight + self.overlap_bytes_bound + per_element * largest + CONVERSION_SCRATCH_BYTES + scales

    @property
    def overlap_bytes_bound(self) -> int:
        """The most materialized state the overlap window holds on the device between
        steps (``OverlapWindow.bound``); 0 without a window."""
        return self._window.bound

    @property
    def carried_peak_bytes(self) -> int:
        """The most state the overlap window was seen holding between steps (accounting)."""
        return self._window.carried_peak_bytes

    # ---- the contract --------------------------------------------------------

    def before_next_step(self, check: Callable[[], None]) -> None:
        """Run ``check()`` before the next step; while it raises, no step runs."""
        self._step_checks.append(check)

    @torch.no_grad()
    def step(self) -> StepStats:
        """One optimizer step over all state; returns what it moved (also in ``last_step``).

        On the disk home the step writes every bucket to the other slot and
        commits only when all are written. A step that fails part way raises,
        and the store is as it was before the step: the bucket optimizers' step
        counts and the model params of the buckets it had updated are rolled
        back (their params rewritten from the committed mains), so the caller
        may save a checkpoint or run the whole optimizer step again, losing
        nothing but the step in progress. Where that cannot be done (it had
        updated a bucket at home in host or device memory, which is written in
        place, or a bucket of fp32 params, updated in place: those come last in
        the walk; remainder mains need the params the step overwrote; transfers
        hung) the store refuses to step again (``rollback.py``).
        """
        self._check_open()
        # The previous step's deferred writes go out now if no progress() sent them; the walk
        # waits for each just before reading its bucket, so they run beside its reads.
        self._land()
        while self._step_checks:
            self._step_checks[0]()  # raises to refuse the step; the check then stays armed
            self._step_checks.pop(0)
        start = time.perf_counter()
        stats = StepStats()
        rollback = StepRollback(
            self.steps_taken + 1,
            self._pipeline,
            self.placed,
            self._copy_to_model,
            remainder_mains=self.config.main_storage == "remainder",
        )

        def update(flight: Flight) -> None:
            rollback.record(flight)
            self._update(flight)

        walked = False
        graphs = self._pipeline.codec.graphs
        replays, eager = graphs.replays, graphs.eager
        graphs.take_eager_slots()  # those of conversions outside steps (a checkpoint's reads, say)
        try:
            self._pipeline.walk(update, stats, defer=self._window.deferred())
            # Added, not set: the walk's stats (the prefetched buckets' included) count none.
            stats.conversions_replayed += graphs.replays - replays
            stats.conversions_eager += graphs.eager - eager
            stats.eager_slots = tuple(graphs.take_eager_slots())
            walked = True
            # Last: fp32-native params are updated in place, with no copy to roll back to.
            if self._resident_optimizer is not None:
                self._attach_grads(self._resident_entries)
                rollback.resident_started()
                self._resident_optimizer.step()
        except LandingError as exc:
            # The previous step's deferred write, waited for by this walk: the stored state
            # is lost, so nothing is rolled back to it.
            raise self._late_failure(exc) from exc.__cause__
        except BaseException as exc:
            # Damaged until undone: an interrupt inside the undo must not leave a half-stepped store usable.
            self._damaged = f"step {self.steps_taken + 1} failed and its roll-back was interrupted"
            if walked:
                self._pipeline.drop_landing()  # this step's deferred writes must not land
            elif not self._pipeline.hung:
                # The previous step's must: they are the stored state, and one that failed
                # is reported (naming its step) instead of rolling back onto lost state.
                # Not after a hang: the roll-back refuses then, and waiting again would
                # double the time a hung drive takes to fail.
                self._land(block=True)
            self._damaged = rollback.undo(exc)
            raise
        # With deferred writes still landing too: no roll-back is left to need the previous
        # slot (a late failure leaves the store refusing), and their buckets are read only
        # once they have landed.
        self._backing.commit()
        self._window.note_carried()
        stats.seconds = time.perf_counter() - start
        self.last_step = stats
        self.total.add(stats)
        self.steps_taken += 1
        _log_step(self.steps_taken, stats)
        if self.auto_gpu is not None:
            try:
                self.auto_gpu.after_step(self)
            except Exception as exc:  # the step is done and committed; placement is an optimization
                logger.warning("auto GPU budget: not adjusted after step %d: %s", self.steps_taken, exc)
        return stats

    # ---- the gpu home (step/gpu_home.py) --------------------------------------

    def move_to_gpu_home(self, budget: int, home: str) -> tuple[int, bool]:
        """Move buckets of ``home`` (``"disk"`` or ``"host"``) into the ``gpu`` home while
        their stored sizes fit ``budget`` (``placement.move_to_device_home``); returns the
        bytes moved and whether device memory ran out. Call between steps."""
        return self._gpu_home.move_in(budget, home)

    def move_from_gpu_home(self, nbytes: int, home: str) -> int:
        """Give buckets of the ``gpu`` home whose place below is ``home`` back to it until
        ``nbytes`` are freed (``placement.move_from_device_home``); returns the bytes freed."""
        return self._gpu_home.move_out(nbytes, home)

    def _update(self, flight: Flight) -> None:
        """The Adam update of one materialized bucket; its mains then go to the model."""
        optimizer = flight.optimizer
        self._attach_grads(flight.bucket.entry_indices)
        fresh = [e for e in flight.entries if optimizer.moments(e.main) is None]
        optimizer.step()
        for entry in fresh:
            # Moments the optimizer created in this step (an entry's first update).
            for moment in optimizer.moments(entry.main) or ():
                self._pipeline.accounting.adopt(moment)
        for entry in flight.entries:
            if flight.bucket.streams_main:
                entry.main.grad = None  # the fp32 grad is not state; drop it now (an fp32 param's is the model's)
            self._copy_to_model(entry)

    def prefetch(self) -> None:
        """Start reading the first buckets of the next step now (pipelined engine;
        a no-op otherwise, or when already started). Call it as early as the
        caller can, e.g. before the grad-norm reduction: the reads then overlap it.
        Anything that changes the stored state first drops what was prefetched.
        With an overlap window the reads fill the window, stopping before a bucket
        whose deferred write is still landing (the step waits for that one)."""
        self._check_open()
        if self.config.pipelined:
            self._land()  # reads stop before a bucket still landing; the step waits for it
            try:
                self._pipeline.prefetch(self.config.overlap_bytes)
            finally:
                self._note_hang()

    def progress(self) -> None:
        """Move the overlap window along without waiting (a no-op without one): submit
        the last step's deferred writes, release those that landed, and read the
        next step's first buckets into the room they left (never one still
        landing). Call it often between steps, during forward and backward (the
        Megatron binding does, before each model chunk's forward). A deferred write
        that failed is raised here, and the store then refuses to go on."""
        # Nothing while a CUDA graph is captured; a damaged store was reported when found,
        # and step and save refuse it: forward passes (evaluation too) go on meanwhile.
        if not self.config.overlap_bytes or self._closed or self._damaged or _capturing():
            return
        self._check_open()
        self._land()
        try:
            self._window.read_ahead()
        finally:
            self._note_hang()

    def _land(self, block: bool = False) -> None:
        """Move the deferred writes along (``Pipeline.land``); a failure leaves the store refusing."""
        if not self._pipeline.landing:
            return
        try:
            self._pipeline.land(block)
        except LandingError as exc:
            raise self._late_failure(exc) from exc.__cause__

    def _late_failure(self, exc: LandingError) -> StoreUnusableError:
        """Mark the store damaged by a failed deferred write of step ``steps_taken``."""
        self._damaged = (
            f"writes of step {self.steps_taken}, deferred past its end by the overlap window, failed "
            f"({exc.__cause__}); the model's params are not the stored state's"
        )
        return StoreUnusableError(
            f"the optimizer-state store at {self.location}: {self._damaged}. Load a good checkpoint into a "
            "fresh process"
        )

    def drop_prefetch(self) -> None:
        """Release what :meth:`prefetch` read when no step will use it (e.g. the step
        was skipped for an inf/nan in the grads)."""
        if not self._closed:
            try:
                self._pipeline.drop_prefetch()
            finally:
                self._note_hang()

    def offload_device_home(self) -> None:
        """Move the ``gpu`` home's buckets to pinned host memory and free their device
        memory (an RL rollout phase wants the GPU); :meth:`restore_device_home`
        brings them back. A step in between still works, over PCIe. With an auto
        GPU budget the buckets go back to their places below instead (no memory
        pinned; only those placed on the device at setup, which have none, go to
        pinned host memory), and the budget fills the home again when it is restored."""
        self._settle()
        self._pipeline.codec.release()
        self._gpu_home.offload(self, self.auto_gpu)
        if self._device.type == "cuda":
            # To the driver, for another process (as upstream's offload does): the home's
            # buffers, the codec graphs' pool and its exception slots, once for all.
            torch.cuda.empty_cache()

    def restore_device_home(self) -> None:
        """Bring what :meth:`offload_device_home` moved back into device memory (with an
        auto GPU budget: fill the home again, once the last store sharing it is restored)."""
        self._settle()
        self._gpu_home.restore()
        if self.auto_gpu is not None:
            self.auto_gpu.restored(self)

    def refresh_main_from_model_params(self, copy_fn: CopyFn) -> None:
        """Rebuild every streamed main from its model param; moments stay as they are."""
        self._settle()
        self._write_mains(copy_fn)

    def save_to(self, base_dir: str) -> None:
        """Save the full state under ``base_dir/<name>``; a previous save there is
        replaced in one step (see ``checkpoint/writer.py``). Call between steps."""
        self._settle()
        CheckpointWriter(self._persistence).save(base_dir, self.steps_taken)

    def load_from(self, base_dir: str, *, expected_steps: int | None = None) -> bool:
        """Restore the state ``save_to`` left under ``base_dir/<name>``; False when
        there is none. A state that does not fit (dtypes, layout, topology,
        checksums, small state, a step count other than ``expected_steps``:
        every problem at once) is refused with :class:`CheckpointMismatchError`
        before anything live changes, leaving the store as it was; a failure
        after that leaves it refusing to step."""
        self._settle()
        steps = CheckpointReader(self._persistence).load(base_dir, self._mark_damaged, expected_steps)
        if steps is None:
            return False
        self.steps_taken = steps
        return True

    def close(self) -> None:
        """Delete the stored state (scratch files or host buffers) and release the directory lock."""
        if self._closed:
            return
        self._pipeline.drop_landing()  # the state is deleted: what has not gone out need not
        self._pipeline.drop_prefetch()
        if self.auto_gpu is not None:
            self.auto_gpu.unregister(self)
        self._shut_down()

    def _shut_down(self) -> None:
        self._closed = True
        if self._pipeline is not None:
            self._pipeline.codec.release()
        hung = self._pipeline is not None and self._pipeline.hung
        if self._engine is not None:
            self._engine.close(wait=not hung)
        if self._backing is not None and hung:
            # A late copy may still reach the host home's pinned buffers: they stay pinned and
            # mapped for the rest of the process (held here, past this store), as the staging is.
            _ABANDONED.append(self._backing)
        elif self._backing is not None:
            self._backing.release()
        self._backing = None
        if self.placed is not None:
            self.placed.remove()

    def _settle(self) -> None:
        """Before touching the stored state outside a step: forget prefetched reads
        (they may hang: the store then refuses), and check the store may go on."""
        self._check_open()
        self._land(block=True)
        self.drop_prefetch()
        self._check_open()

    def _mark_damaged(self, reason: str) -> None:
        self._damaged = reason

    def _note_hang(self) -> None:
        """Take transfers the pipeline abandoned, or a release it could not finish, as
        this store's damage, as soon as it is found."""
        if self._pipeline.hung and not self._damaged:
            cause = self._pipeline.hang_cause or "transfers hang (a stalled drive?)"
            self._damaged = f"{cause}; their memory cannot be reused"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnusableError(f"the optimizer-state store at {self.location} was closed; its state is gone")
        self._note_hang()
        if self._damaged:
            raise StoreUnusableError(
                f"the optimizer-state store at {self.location} holds no consistent state: {self._damaged}. "
                "Load a good checkpoint into a fresh process"
            )

    # ---- reading the state back (tests, the demo, checkpoint export) ---------

    @torch.no_grad()
    def iter_state(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Yield (entry index, main, exp_avg, exp_avg_sq) as fp32 CPU copies, one bucket
        in memory at a time; moments are None before the entry's first update."""
        self._settle()
        yield from _state_copies(self)

    # ---- construction helpers --------------------------------------------------

    def _attach_grads(self, entry_indices: Sequence[int]) -> None:
        for i in entry_indices:
            entry = self.entries[i]
            grad = self._grad_fn(entry)
            if grad is not entry.main.grad:
                entry.main.grad = grad

    @torch.no_grad()
    def _write_mains(self, fill: CopyFn | None) -> None:
        """Write every bucket's mains (moments untouched), ``buckets_in_flight`` at a
        time: filled from the params by ``fill``, or as they are when it is None.
        In place: a failure part way leaves the mains mixed, and the store refuses
        to step (after construction: the caller's refresh can then not be trusted)."""

        def fill_mains(flight: Flight) -> None:
            if fill is not None:
                for entry in flight.entries:
                    fill(entry.param, entry.main)

        try:
            self._pipeline.walk(fill_mains, StepStats(), mains_only=True)
        except BaseException as exc:
            self._damaged = f"rewriting the mains failed part way ({exc})"
            raise


def _resident(entries: Sequence[Entry], backend: AdamBackend, config: StreamConfig) -> tuple[list[int], object]:
    """The entries whose fp32 params keep their moments resident, and the one small
    optimizer (of the master's class) that steps them; ([], None) when there are none."""
    indices = [i for i, e in enumerate(entries) if e.resident and config.fp32_param_moments == "resident"]
    return indices, (backend.build(_groups_of(entries, indices)) if indices else None)


def _setup_gpu_room(entries: Sequence[Entry], buckets: Sequence[BucketLayout], device, config: StreamConfig) -> int:
    """What an auto GPU budget lends the gpu home at setup (``auto_budget.setup_gpu_room``),
    counting the device bytes of the streamed mains, which the store writes out and releases."""
    releasable = sum(
        entries[i].main.untyped_storage().nbytes() for b in buckets if b.streams_main for i in b.entry_indices
    )
    return auto_budget.setup_gpu_room(device, config.auto_gpu_margin_bytes, releasable)


def _persistence(store: StreamingStore, codec: Codec, backend: AdamBackend, topology, param_layout, master_options):
    """The store's parts its checkpoints hold (``checkpoint/persistence.py``)."""
    config, entries, resident = store.config, store.entries, store._resident_entries
    return Persistence(
        name=config.name,
        description=describe_store(config, entries, store.buckets, resident, backend.master, topology, param_layout),
        buckets=store.buckets,
        backing=store._backing,
        bucket_optimizers=store._bucket_optimizers,
        buffer=store._engine.idle_buffer,
        codec=codec,
        remainder=config.main_storage == "remainder",
        resident_optimizer=store._resident_optimizer,
        resident_mains=[entries[i].main for i in resident],
        master_groups=master_options,
    )


_EAGER_SLOTS_LOGGED = 4  # the step's log line names this many eager conversions, then counts the rest


def _log_step(steps_taken: int, stats: StepStats) -> None:
    graphs = ""
    if stats.conversions_replayed or stats.conversions_eager:
        slots = [f"{direction} {bucket}" for direction, bucket in stats.eager_slots[:_EAGER_SLOTS_LOGGED]]
        more = len(stats.eager_slots) - len(slots)
        which = f" ({', '.join(slots)}{f' and {more} more' if more else ''})" if slots else ""
        graphs = (
            f"; conversions: {stats.conversions_replayed} replayed from CUDA graphs (captures included),"
            f" {stats.conversions_eager} eager{which}"
        )
    logger.info(
        "streamed optimizer step %d: %d buckets, read %.1f MB, wrote %.1f MB in %.3f s%s",
        steps_taken,
        stats.buckets,
        stats.bytes_read / 1e6,
        stats.bytes_written / 1e6,
        stats.seconds,
        graphs,
    )


def _state_copies(
    store: StreamingStore,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """:meth:`StreamingStore.iter_state`'s walk, once the store is settled."""
    for i in store._resident_entries:
        moments = store._resident_optimizer.moments(store.entries[i].main)
        yield (i, store.entries[i].main.detach().cpu().clone(), *_cpu_copies(moments))
    for bucket in store.buckets:
        # The whole bucket is copied and released before anything is yielded: a
        # caller may step, load or refresh while this generator is suspended, or
        # run a forward whose progress() reads ahead: settled again each time.
        store._settle()
        with store._pipeline.read_one(bucket.index) as flight:
            copies = [
                (i, entry.main.cpu().clone(), *_cpu_copies(flight.optimizer.moments(entry.main)))
                for i, entry in zip(bucket.entry_indices, flight.entries, strict=True)
            ]
        yield from copies


def _groups_of(entries: Sequence[Entry], indices: Sequence[int]) -> list[tuple[int, list[torch.Tensor]]]:
    """(master group index, mains) for the entries at ``indices``, in order of first appearance."""
    groups: dict[int, list[torch.Tensor]] = {}
    for i in indices:
        groups.setdefault(entries[i].group_index, []).append(entries[i].main)
    return list(groups.items())


def _log_setup(store: StreamingStore) -> None:
    config = store.config
    logger.info(
        "optimizer state streams through %s (%s engine%s): %d buckets, %.2f GB stored, %.2f GB "
        "materialized state total, largest bucket %.2f GB, %d in flight; %d fp32 params resident; "
        "host staging %g MiB (%s)",
        store.location,
        config.engine,
        ", direct I/O" if store._backing.direct else "",
        len(store.buckets),
        store.file_bytes_total / 1e9,
        store.state_bytes_total / 1e9,
        store.bucket_bytes_max / 1e9,
        config.depth,
        len(store._resident_entries),
        round(config.staging_bytes_total / 2**20, 2),
        f"{2 * config.transfer_threads * config.io_queues} chunks of {config.staging_bytes / 2**20:g} MiB"
        if config.pipelined
        else "one chunk",
    )
    if config.pipelined and config.transfer_threads < config.io_threads:
        # By design (fewer, larger requests), so not a warning; said for whoever asked for more threads.
        logger.info(
            "%d MiB of staging (this store's) funds %d of the %d I/O threads per direction%s: requests of %g MiB "
            "(fewer threads with larger requests: smaller ones were slower on NVMe; each thread takes 2 x %d MiB)",
            config.staging_budget_mb,
            config.transfer_threads,
            config.io_threads,
            f" and directory ({config.io_queues} directories)" if config.io_queues > 1 else "",
            config.staging_bytes / 2**20,
            STAGING_REQUEST_MB,
        )


def _warn_about_residency(config: StreamConfig, buckets: Sequence[BucketLayout], resident_numel: int) -> None:
    """Say so when streaming keeps a lot of state on the device anyway."""
    if resident_numel > config.resident_warn_elements:
        logger.warning(
            "%d elements of fp32 params (%.2f GB of state) stay resident on the device "
            "(fp32_param_moments='resident'): their main is the model param itself; "
            "fp32_param_moments='streamed' streams their moments (8 of the 12 bytes)",
            resident_numel,
            resident_numel * MATERIALIZED_BYTES_PER_ELEMENT / 1e9,
        )
    # Every bucket in flight puts the whole streamed state on the device. Said where a
    # chosen cap did it and a lower one would not: a param is never split, so with no
    # more params than buckets in flight no cap helps; at the default cap (sized for
    # large models) a state this small is left unsaid.
    params = sum(len(b.entry_indices) for b in buckets)
    if len(buckets) <= config.depth < params and config.bucket_cap_elements != DEFAULT_BUCKET_CAP_ELEMENTS:
        logger.warning(
            "all %d buckets fit in the %d in flight: the whole streamed state (%.2f GB) is on the device "
            "during a step, as without streaming; lower the bucket cap (now %d elements; a param is never "
            "split, the largest bucket holds %d) to bound it",
            len(buckets),
            config.depth,
            sum(b.materialized_bytes for b in buckets) / 1e9,
            config.bucket_cap_elements,
            max(b.numel for b in buckets),
        )


# Param dtypes whose Adam state is fp32 (mains, moments): what the store keeps exactly.
STREAMABLE_PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _streamed_entries(entries: Sequence[Entry], config: StreamConfig) -> list[int]:
    """Indices of the entries to stream, after checking each can be."""
    for i, entry in enumerate(entries):
        if entry.param.dtype not in STREAMABLE_PARAM_DTYPES:
            raise StreamConfigError(
                f"param {entry.name or i!r} is {entry.param.dtype}: the streamed state is fp32 (mains and moments), "
                f"so it would train differently from resident Adam in its own dtype; stream only bf16, fp16 and "
                "fp32 params (keep the others in an optimizer of their own)"
            )
    with_mains = [i for i, e in enumerate(entries) if not e.resident]
    if config.main_storage == "remainder" and entries and not with_mains:
        raise StreamConfigError(
            "main_storage='remainder' stores the low half of fp32 mains beside bf16 params, and every param "
            "here is fp32 (its own main, which stays in the model): nothing to store that way; use "
            "main_storage='fp32'"
        )
    moments_only = [i for i, e in enumerate(entries) if e.resident and config.fp32_param_moments == "streamed"]
    streamed = with_mains + moments_only
    for i in streamed:
        main = entries[i].main
        if main.dtype != torch.float32 or not main.is_contiguous():
            raise ValueError(f"entry {i}: a streamed main must be a contiguous fp32 tensor, got {main.dtype}")
        if config.main_storage == "remainder" and i in with_mains and entries[i].param.dtype != torch.bfloat16:
            raise StreamConfigError(
                f"remainder mains need bf16 params (the main's high half), entry {i} is "
                f"{entries[i].param.dtype}; use main_storage='fp32'"
            )
    return streamed


def _layout(entries: Sequence[Entry], streamed: Sequence[int], config: StreamConfig) -> list[BucketLayout]:
    return layout_store(
        [(i, entries[i].main.numel(), entries[i].bucket_key, entries[i].resident) for i in streamed],
        config.bucket_cap_elements,
        config.moment_torch_dtype,
        remainder.STORAGE_DTYPE if config.main_storage == "remainder" else MAIN_DTYPE,
        config.blockwise_moments,
    )


def _open_backing_and_engine(config: StreamConfig, buckets, placed: Placement, device: torch.device):
    """The backing (each bucket in its place: files in a directory's scratch, pinned
    host memory, device memory) and the engine (a set of I/O threads per directory)."""
    pin = torch.cuda.is_available()

    def build(key, mine: list[BucketLayout]):
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
                config.transfer_threads,
                config.staging_bytes,
                pin,
                device,
                config.io_timeout_s,
                queues=config.io_queues,  # one per directory, as the staging budget is split
            )
        else:
            engine = SyncEngine(config.staging_bytes, pin)
    except BaseException:
        backing.release()
        raise
    return backing, engine


def _cpu_copies(moments: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if moments is None:
        return None, None
    return tuple(m.cpu().clone() for m in moments)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
