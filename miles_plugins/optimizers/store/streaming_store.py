"""The store: the streamed optimizer state of one optimizer, and its step.

:class:`StreamingStore` holds the parts ``parts.py`` assembles and runs them:
the step (over the pipeline, with its roll-back), the transfers between steps
(prefetch, the overlap window's progress), the gpu home's moves and offload,
checkpoints, and reading the state back. Its health (``health.py``) says
whether it may go on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence

import torch

from miles_plugins.optimizers.checkpoint.background import BackgroundSave
from miles_plugins.optimizers.checkpoint.reader import CheckpointReader
from miles_plugins.optimizers.checkpoint.writer import CheckpointWriter
from miles_plugins.optimizers.config import AUTO, StreamConfig
from miles_plugins.optimizers.homes import auto_budget
from miles_plugins.optimizers.homes.auto_budget import AutoGpuBudget
from miles_plugins.optimizers.step.adam import AdamBackend
from miles_plugins.optimizers.step.entries import CopyFn, Entry, EntryFn, GradFn, StepStats
from miles_plugins.optimizers.store.assembled import AssembledStore
from miles_plugins.optimizers.store.between_steps import BetweenSteps
from miles_plugins.optimizers.store.health import StoreHealth
from miles_plugins.optimizers.store.log import log_step
from miles_plugins.optimizers.store.parts import assemble
from miles_plugins.optimizers.store.step_runner import StepRunner

logger = logging.getLogger(__name__)


class StreamingStore(AssembledStore):
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
        param_facts: where every param sits in the global tensors Megatron
            checkpoints (``megatron.param_facts``), for a load or an offline
            reshard at another TP, PP or EP size; or None (never resharded so).
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
        param_facts: dict | None = None,
        grad_bytes_per_element: int = 0,
        checkpoint_master_options: bool = False,
        auto_gpu: AutoGpuBudget | None = None,
    ) -> None:
        config = auto_budget.resolve_host(config)
        self.auto_gpu = None
        auto_gpu_wanted = config.gpu_budget_bytes == AUTO
        if auto_gpu_wanted:
            config = dataclasses.replace(config, gpu_budget_bytes=0)  # the buckets start below the device
        self.last_step, self.total, self.steps_taken = StepStats(), StepStats(), 0
        # Checks the next step must pass first (before_next_step).
        self._step_checks: list[Callable[[], None]] = []
        entries = list(entries)
        parts = assemble(
            entries,
            backend,
            config,
            auto_gpu_room=auto_gpu_wanted,
            finish_transfers=self._finish_transfers,
            topology=topology,
            param_layout=param_layout,
            param_facts=param_facts,
            master_options=backend.master.param_groups if checkpoint_master_options else None,
        )
        super().__init__(config=config, entries=entries, parts=parts, grad_bytes_per_element=grad_bytes_per_element)
        self.health = StoreHealth(self._pipeline, lambda: self.location)
        self._between_steps = BetweenSteps(
            parts=parts, config=config, health=self.health, steps_taken=lambda: self.steps_taken
        )
        self._steps = StepRunner(
            entries=entries,
            parts=parts,
            grad_fn=grad_fn or (lambda entry: entry.main.grad),
            copy_to_model=copy_to_model or (lambda entry: None),
            remainder_mains=config.main_storage == "remainder",
            health=self.health,
            between_steps=self._between_steps,
        )
        try:
            self._steps.write_mains(init_main)
        except BaseException:
            self._shut_down()
            raise
        if auto_gpu_wanted:
            # Shared by the device's stores in this process (a Megatron chain's, several optimizers').
            self.auto_gpu = auto_gpu or AutoGpuBudget.for_device(self._device, config.auto_gpu_margin_bytes)
            self.auto_gpu.register(self, self._device)
        self._log_setup()

    # ---- the contract --------------------------------------------------------

    def before_next_step(self, check: Callable[[], None]) -> None:
        """Run ``check()`` before the next step; while it raises, no step runs (it may arm
        itself again for the step after)."""
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
        self._before_step()
        stats = self._steps.run(self.steps_taken + 1)
        self.last_step = stats
        self.total.add(stats)
        self.steps_taken += 1
        log_step(self.steps_taken, stats)
        if self.auto_gpu is not None:
            try:
                self.auto_gpu.after_step(self)
            except Exception as exc:  # the step is done and committed; placement is an optimization
                logger.warning("auto GPU budget: not adjusted after step %d: %s", self.steps_taken, exc)
        return stats

    def _before_step(self) -> None:
        """Refuse a store that may not go on, send the previous step's deferred writes
        out, and run the checks :meth:`before_next_step` armed."""
        self.health.check_open()
        # The previous step's deferred writes go out now if no progress() sent them; the walk
        # waits for each just before reading its bucket, so they run beside its reads.
        self._between_steps.advance_deferred_writes()
        # The checks armed before this step; one may arm another (itself) for the step after.
        checks, self._step_checks = self._step_checks, []
        for at, check in enumerate(checks):
            try:
                check()
            except BaseException:
                self._step_checks[:0] = checks[at:]  # the step is refused; it and those after stay armed
                raise

    # ---- the gpu home (step/gpu_home.py) --------------------------------------

    def move_to_gpu_home(self, budget: int, home: str) -> tuple[int, bool]:
        """Move buckets of ``home`` (``"disk"`` or ``"host"``) into the ``gpu`` home while
        their stored sizes fit ``budget`` (``device_home_moves.move_to_device_home``); returns the
        bytes moved and whether device memory ran out. Call between steps."""
        return self._gpu_home.move_in(budget, home)

    def move_from_gpu_home(self, nbytes: int, home: str) -> int:
        """Give buckets of the ``gpu`` home whose place below is ``home`` back to it until
        ``nbytes`` are freed (``device_home_moves.move_from_device_home``); returns the bytes freed."""
        return self._gpu_home.move_out(nbytes, home)

    # ---- between steps (store/between_steps.py) ---------------------------

    def prefetch(self) -> None:
        """Start reading the first buckets of the next step now (pipelined engine;
        a no-op otherwise, or when already started). Call it as early as the
        caller can, e.g. before the grad-norm reduction: the reads then overlap it.
        Anything that changes the stored state first drops what was prefetched.
        With an overlap window the reads fill the window, stopping before a bucket
        whose deferred write is still landing (the step waits for that one)."""
        self._between_steps.prefetch()

    def progress(self) -> None:
        """Move the overlap window along without waiting (a no-op without one): submit
        the last step's deferred writes, release those that landed, and read the
        next step's first buckets into the room they left (never one still
        landing). Call it often between steps, during forward and backward (the
        Megatron binding does, before each model chunk's forward). A deferred write
        that failed is raised here, and the store then refuses to go on."""
        self._between_steps.progress()

    def drop_prefetch(self) -> None:
        """Release what :meth:`prefetch` read when no step will use it (e.g. the step
        was skipped for an inf/nan in the grads)."""
        self._between_steps.drop_prefetch()

    def offload_device_home(self) -> None:
        """Move the ``gpu`` home's buckets to pinned host memory and free their device
        memory (an RL rollout phase wants the GPU); :meth:`restore_device_home`
        brings them back. A step in between still works, over PCIe. With an auto
        GPU budget the buckets go back to their places below instead (no memory
        pinned; only those placed on the device at setup, which have none, go to
        pinned host memory), and the budget fills the home again when it is restored."""
        self._finish_transfers()
        self._pipeline.codec.release()
        self._gpu_home.offload(self, self.auto_gpu)
        if self._device.type == "cuda":
            # To the driver, for another process (as upstream's offload does): the home's
            # buffers, the codec graphs' pool and its exception slots, once for all.
            torch.cuda.empty_cache()

    def restore_device_home(self) -> None:
        """Bring what :meth:`offload_device_home` moved back into device memory (with an
        auto GPU budget: fill the home again, once the last store sharing it is restored)."""
        self._finish_transfers()
        self._gpu_home.restore()
        if self.auto_gpu is not None:
            self.auto_gpu.restored(self)

    def refresh_main_from_model_params(self, copy_fn: CopyFn) -> None:
        """Rebuild every streamed main from its model param; moments stay as they are."""
        self._finish_transfers()
        self._steps.write_mains(copy_fn)

    def save_to(self, base_dir: str, *, asynchronous: bool = False) -> BackgroundSave | None:
        """Save the full state under ``base_dir/<name>``; a previous save there is
        replaced in one step (see ``checkpoint/writer.py``). Call between steps.

        ``asynchronous``: return once the state is snapshotted (``checkpoint/background.py``)
        and write it on a thread of its own while training goes on; the returned
        :class:`BackgroundSave`'s ``wait()`` says when it is complete and in place. A save
        started before it has ended waits for it first, as do loads, refreshes, the gpu
        home's moves, reading the state back and :meth:`close`."""
        self._finish_transfers()
        writer = CheckpointWriter(self._parts.persistence)
        if not asynchronous:
            writer.save(base_dir, self.steps_taken)
            return None
        # Its own staging (the engine's is the steps' from now on), one chunk.
        save = BackgroundSave.begin(writer, base_dir, self.steps_taken, self.config.staging_bytes, self.buckets)
        self._between_steps.start_background(save)  # from here the save's thread owns its cleanup
        return save

    def load_from(self, base_dir: str, *, expected_steps: int | None = None) -> bool:
        """Restore the state ``save_to`` left under ``base_dir/<name>``; False when
        there is none. A state that does not fit (dtypes, layout, topology,
        checksums, small state, a step count other than ``expected_steps``:
        every problem at once) is refused with :class:`CheckpointMismatchError`
        before anything live changes, leaving the store as it was; a failure
        after that leaves it refusing to step."""
        self._finish_transfers()
        steps = CheckpointReader(self._parts.persistence).load(base_dir, self.health.mark_damaged, expected_steps)
        if steps is None:
            return False
        self.steps_taken = steps
        return True

    def close(self) -> None:
        """Delete the stored state (scratch files or host buffers) and release the directory lock."""
        if self.health.closed:
            return
        self._between_steps.end_background()  # it reads the state about to be deleted
        self._pipeline.drop_deferred_writes()  # the state is deleted: what has not gone out need not
        self._pipeline.drop_prefetch()
        if self.auto_gpu is not None:
            self.auto_gpu.unregister(self)
        self._shut_down()

    def _shut_down(self) -> None:
        self.health.mark_closed()
        self._parts.shut_down()
        self._backing = None

    def _finish_transfers(self) -> None:
        """Land the deferred writes and drop what was prefetched before the stored state
        is touched outside a step (``BetweenSteps.finish_transfers``)."""
        self._between_steps.finish_transfers()

    # ---- reading the state back (tests, the demo, checkpoint export) ---------

    @torch.no_grad()
    def iter_state(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Yield (entry index, main, exp_avg, exp_avg_sq) as fp32 CPU copies, one bucket
        in memory at a time; moments are None before the entry's first update."""
        self._finish_transfers()
        yield from _state_copies(self)


def _state_copies(
    store: StreamingStore,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """:meth:`StreamingStore.iter_state`'s walk, once the store's transfers are finished."""
    for i in store._resident_entries:
        moments = store._resident_optimizer.moments(store.entries[i].main)
        yield (i, store.entries[i].main.detach().cpu().clone(), *_cpu_copies(moments))
    for bucket in store.buckets:
        # The whole bucket is copied and released before anything is yielded: a
        # caller may step, load or refresh while this generator is suspended, or
        # run a forward whose progress() reads ahead: finished again each time.
        store._finish_transfers()
        with store._pipeline.read_one(bucket.index) as flight:
            copies = [
                (i, entry.main.cpu().clone(), *_cpu_copies(flight.optimizer.moments(entry.main)))
                for i, entry in zip(bucket.entry_indices, flight.entries, strict=True)
            ]
        yield from copies


def _cpu_copies(moments: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if moments is None:
        return None, None
    return tuple(m.cpu().clone() for m in moments)
