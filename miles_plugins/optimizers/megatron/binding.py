"""Binding of the streaming store to Megatron's ``DistributedOptimizer``.

:func:`attach` gives one ``DistributedOptimizer`` a :class:`StreamingStore` over
its fp32 main shards and rebinds, on that instance only (never on the class:
two optimizers in one process may differ), every entry point that touches
optimizer state:

- ``prepare_grads``: upstream's own method, then, unless it found inf/nan
  grads (the step is then skipped), the reads of the first buckets start
  (``store.prefetch()``), so they overlap the grad-norm reduction and the
  clipping that upstream runs before the step.
- ``zero_grad``: upstream's own method, after dropping reads prefetched for a
  step that never ran (another optimizer of the chain found inf/nan), so no
  bucket stays on the device through the next forward and backward.
- ``step_with_ready_grads``: upstream's own method still runs, all-gather tail
  included; inside it the inner optimizer's ``step`` is the streamed step, which
  copies each bucket's updated mains into the param buffer as the bucket
  finishes, so upstream's ``_copy_main_params_to_model_params`` has nothing left
  to do. A check after the call proves the streamed step ran exactly once.
- ``reload_model_params``: rebuilds the streamed mains from the model params (or
  from a state dict's params), bucket by bucket; moments are left as they are.
- ``state_dict`` / ``load_state_dict`` / ``sharded_state_dict``: the param-group
  options, the grad scaler and a marker with the step count, never the evicted
  mains or moments (those bytes travel through the store's ``save_to`` /
  ``load_from``, called by the checkpoint hooks in the patched
  ``megatron/training/checkpointing.py``). ``load_state_dict`` restores the
  group options and arms the load: the hook that runs after it must then find
  this store's files in the checkpoint, and the next step refuses if it did not
  run. A checkpoint written without streaming is refused (it would restart Adam
  from zero); ``--no-load-optim`` starts fresh instead.
- ``save_parameter_state`` / ``load_parameter_state`` (the legacy checkpoint
  format's per-rank state file): no-ops, for the same reason.
- with an overlap window (``--stream-optimizer-state-overlap-gb``), a forward
  pre-hook on each of the optimizer's ``model_chunks`` runs ``store.progress()``:
  the last step's deferred writes and the next step's first reads then move
  during forward and backward (once per micro-batch and chunk, never waiting).
- ``offload_to_cpu`` / ``restore_from_cpu`` (RL phase switches): the streamed
  state is off the GPU already, except the buckets its GPU budget keeps there,
  which move to pinned host memory and back (under an auto GPU budget: back to
  their places below, and the home is filled again at the restore).

Built under :func:`~miles_plugins.optimizers.megatron.deferred_mains.deferred_mains`
(the launcher does), a ``DistributedOptimizer`` allocates no fp32 mains at all; the
binding then fills each main from its param as the store writes it, bucket by bucket.

Native-fp32 model params are their own mains (a view of the param buffer); their
moments stream in buckets of their own, or stay resident beside them under a small
optimizer of the same class (``fp32_param_moments``).

The parts: the overrides themselves (``overrides.py``), where each main shard sits
in Megatron's buffers (``shard_map.py``), the state dicts (``state_dict.py``), the
recorded topology (``topology.py``) and each param's place in Megatron's checkpoint
tensors (``param_facts.py``), which optimizers of a chain stream and the
checks (``chain.py``), and the deferred build of the mains (``deferred_mains.py``).

Reproduced upstream code is marked with its provenance: NVIDIA/Megatron-LM tag
``core_v0.19.0`` (commit 5be9626709af2722333bf54797c954c09edeada3), whose
``megatron/core/optimizer/distrib_optimizer.py`` is byte-identical to the
megatron-core 0.19.2 wheel's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_hooks.contract import STREAMING_ATTR
from miles_plugins.optimizers.checkpoint.background import BackgroundSave
from miles_plugins.optimizers.config import AUTO, StreamConfig
from miles_plugins.optimizers.errors import CheckpointMismatchError, StoreUnusableError, StreamConfigError
from miles_plugins.optimizers.homes import auto_budget, memory_probes
from miles_plugins.optimizers.homes.auto_budget import AutoGpuBudget
from miles_plugins.optimizers.megatron import overrides
from miles_plugins.optimizers.megatron.chain import chained_distributed_optimizers, check_supported, check_upstream
from miles_plugins.optimizers.megatron.deferred_mains import main_from_param, mains_deferred
from miles_plugins.optimizers.megatron.param_facts import param_facts
from miles_plugins.optimizers.megatron.shard_map import MegatronEntry, ShardMap, buffered_params, param_layout
from miles_plugins.optimizers.megatron.topology import topology
from miles_plugins.optimizers.step.adam import backend_for, bind_master
from miles_plugins.optimizers.step.entries import StepStats
from miles_plugins.optimizers.store.streaming_store import StreamingStore

logger = logging.getLogger(__name__)


class MegatronBinding:
    """The streamed state of one ``DistributedOptimizer`` and its instance bindings.

    Build it right after ``get_megatron_optimizer(...)``, before the first step
    and before ``load_checkpoint``. Construction checks the optimizer
    (:func:`check_supported`), writes every fp32 main to the store's files and
    releases their device storage (mains built under :func:`~miles_plugins.optimizers.megatron.deferred_mains.deferred_mains` have
    none: each is filled from its param as its bucket is written), then rebinds the optimizer's state entry
    points (see the module docstring). The binding is the store the checkpoint
    hooks call (``megatron_hooks.contract.OptimizerStateStore``), reachable as
    ``getattr(dist_opt, megatron_hooks.contract.STORE_ATTR)``.
    """

    def __init__(self, dist_opt: Any, config: StreamConfig, auto_gpu: AutoGpuBudget | None = None) -> None:
        check_supported(dist_opt)
        self.dist_opt = dist_opt
        # A param's identity across DP sizes: its model chunk and name (same TP, PP, EP); across
        # TP, PP and EP sizes: the key and global coordinates Megatron checkpoints it by (param_facts).
        names = {
            p: f"{i}/{name}" for i, chunk in enumerate(dist_opt.model_chunks) for name, p in chunk.named_parameters()
        }
        self.shards = ShardMap(dist_opt, names)
        self.entries = self.shards.entries()
        self.store = StreamingStore(
            self.entries,
            backend_for(dist_opt.optimizer),
            config,
            copy_to_model=self.shards.copy_main_to_param_buffer,
            init_main=main_from_param if mains_deferred(self.entries) else None,
            topology=topology(dist_opt),
            param_layout=param_layout(dist_opt, names),
            param_facts=param_facts(dist_opt.model_chunks, {p: names[p] for p in buffered_params(dist_opt)}),
            auto_gpu=auto_gpu,
        )
        # The streamed marker of a loaded optimizer state dict, until the load hook
        # has restored the files it promises (it stays set when that load fails).
        self._awaiting_state: dict | None = None
        self._load_failure: str | None = None
        bind_master(
            dist_opt.optimizer,
            self.step,
            checkpoint_with="Megatron's save_checkpoint / load_checkpoint on a patched tree (their hooks "
            "call the store's save_to / load_from)",
        )
        self.upstream: dict[str, Callable] = overrides.install(dist_opt, self)
        if self.store.config.overlap_bytes:
            for chunk in dist_opt.model_chunks:
                chunk.register_forward_pre_hook(self._progress_before_forward)

    # ---- the store contract (called by the checkpoint hooks) -------------------

    def step(self) -> StepStats:
        if self._awaiting_state is not None:
            why = (
                f"its load failed ({self._load_failure})"
                if self._load_failure
                else "the load hook in megatron/training/checkpointing.py did not run (is this the patched tree?)"
            )
            raise StoreUnusableError(
                f"the optimizer's state dict was loaded from a checkpoint, but its streamed state was not: {why}. "
                "Stepping now would apply Adam to mains that do not belong to the loaded params"
            )
        return self.store.step()

    def refresh_main_from_model_params(self, copy_fn) -> None:
        self.store.refresh_main_from_model_params(copy_fn)

    def prefetch(self) -> None:
        """Start reading the next step's first buckets (``StreamingStore.prefetch``)."""
        self.store.prefetch()

    def before_next_step(self, check) -> None:
        self.store.before_next_step(check)

    def save_to(self, base_dir: str, *, asynchronous: bool = False) -> BackgroundSave | None:
        return self.store.save_to(base_dir, asynchronous=asynchronous)

    def load_from(self, base_dir: str) -> bool:
        expected = self._awaiting_state
        if expected is None:
            # Megatron did not load the optimizer state (--no-load-optim, --finetune, a
            # release checkpoint): the mains were rebuilt from the loaded params.
            logger.warning(
                "%s: the optimizer state is not loaded from this checkpoint (--no-load-optim, --finetune or a "
                "release checkpoint): the mains are rebuilt from the loaded params and the moments kept as they "
                "are; in a new run, Adam starts fresh from the loaded params",
                self.store.config.name,
            )
            return False
        try:
            loaded = self.store.load_from(base_dir, expected_steps=expected["steps_taken"])
            if not loaded:
                raise CheckpointMismatchError(
                    f"the checkpoint's optimizer state dict says its state was streamed (step "
                    f"{expected['steps_taken']}), but {base_dir} holds no state for {self.store.config.name}: the "
                    "files were removed, or this run's ranks or chain differ from the run that saved it"
                )
        except BaseException as exc:
            # The params and group options are the checkpoint's, the mains are not: stay armed.
            self._load_failure = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise
        self._awaiting_state = self._load_failure = None
        return True

    # ---- what the overrides call ----------------------------------------------

    def arm_load(self, marker: dict) -> None:
        """A loaded optimizer state dict promises the streamed state ``marker`` names:
        the load hook must then restore it before the next step (:meth:`step` refuses)."""
        self._awaiting_state = marker

    @torch.no_grad()
    def reload_mains(self, state_dict: dict | None) -> None:
        """Rebuild the mains from the model params (or a state dict's params), bucket by
        bucket; moments stay as they are (upstream's ``reload_model_params``)."""
        if state_dict is None:
            sources = {e.param: e.param for e in self.entries}
        else:
            # Upstream's own mapping from model params to the state dict's tensors
            # (present on commits whose reload_model_params takes a state_dict).
            by_model_param = self.dist_opt._build_model_param_to_state_dict_param_map(state_dict)
            sources = {
                e.param: self.shards.model_shard(e.model_param, by_model_param[e.model_param]) for e in self.entries
            }
        for entry in self.entries:
            if entry.resident and sources[entry.param] is not entry.param:
                entry.main.copy_(sources[entry.param])
        self.store.refresh_main_from_model_params(lambda param, main: main.copy_(sources[param]))

    def _progress_before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """The forward pre-hook of each model chunk, with an overlap window: the last step's
        deferred writes and the next step's first reads move during forward and backward."""
        self.store.progress()

    # ---- reading the state back ----------------------------------------------

    def iter_state(self) -> Iterator[tuple[MegatronEntry, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Yield (entry, main, exp_avg, exp_avg_sq) as fp32 CPU copies, one bucket at a time."""
        for index, main, exp_avg, exp_avg_sq in self.store.iter_state():
            yield self.entries[index], main, exp_avg, exp_avg_sq


def attach(optimizer: Any, config: StreamConfig) -> list[MegatronBinding]:
    """Stream the state of every ``DistributedOptimizer`` in ``optimizer``'s chain.

    Each chained optimizer gets its own store under ``config.directory``, named
    ``<config.name>.opt<position in chain>``: the dense and expert optimizers may
    share an instance id, never a directory. The stores share the rank's staging
    budget (``config.staging_budget_mb``) evenly, and fill its GPU and host budgets
    in turn (dense first: each store places buckets in what the ones before it
    left). All optimizers are checked before
    any is bound, so a refusal leaves every one of them as it was. A failure
    after binding began (e.g. an I/O error writing the initial mains) closes the
    stores already made and re-raises: the optimizer is then unusable.
    """
    # "auto" host memory is measured first, before any check that may refuse on one
    # rank and not another: counting the node's ranks is a collective every rank joins.
    config = auto_budget.resolve_host(config, group=True)
    # The node's ranks share --offload-train-disk-dir and set up at once: each plans its disk
    # buckets with its share of the free space (a collective too, before any refusal).
    if config.tier == "disk":
        config = dataclasses.replace(config, drive_ranks=memory_probes.local_ranks(group=True)[0])
        if config.drive_ranks > 1:
            logger.info("the state directories' free space is shared by %d ranks on this node", config.drive_ranks)
    members = chained_distributed_optimizers(optimizer)
    for _, member in members:
        check_supported(member)
    if members:
        check_upstream()
    share = _staging_share(config, len(members))
    # The GPU and host budgets are the rank's too: each store takes what it places
    # from what the stores before it (dense first) left; an auto GPU budget is the
    # device's AutoGpuBudget, which the stores share.
    budgets = {"gpu": config.gpu_budget_bytes, "host": config.host_budget_bytes}
    # So is the overlap window: each store may hold what the stores before it left of it.
    window_left = config.overlap_bytes
    bindings: list[MegatronBinding] = []
    try:
        for index, member in members:
            member_config = dataclasses.replace(
                config,
                name=f"{config.name}.opt{index}",
                staging_budget_mb=share,
                gpu_budget_bytes=AUTO if config.gpu_budget_bytes == AUTO else budgets["gpu"],
                host_budget_bytes=budgets["host"],
                overlap_bytes=window_left,
            )
            bindings.append(MegatronBinding(member, member_config))
            budgets = bindings[-1].store.placed.budgets_left
            window_left -= bindings[-1].store.overlap_bytes_bound
    except BaseException:
        for binding in bindings:
            binding.store.close()
        raise
    setattr(optimizer, STREAMING_ATTR, True)
    return bindings


def _staging_share(config: StreamConfig, stores: int) -> int:
    """Each store's part of the rank's staging budget: the budget bounds the rank's
    pinned host memory (what miles documents for --offload-train-disk-chunk-mb),
    however many distributed optimizers the chain holds (dense, expert, or a
    dense part split in two for an overlapped param gather)."""
    share = config.staging_budget_mb // max(stores, 1)
    if stores > 1:
        try:
            dataclasses.replace(config, staging_budget_mb=share)  # validates it
        except StreamConfigError as exc:
            raise StreamConfigError(
                f"the staging budget (--offload-train-disk-chunk-mb, staging_budget_mb) of "
                f"{config.staging_budget_mb} MiB is shared by this rank's {stores} distributed optimizers "
                f"(the chain's: dense, expert, ...), {share} MiB each: {exc}"
            ) from None
    return share
