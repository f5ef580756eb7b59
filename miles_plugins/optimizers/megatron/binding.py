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

Built under :func:`deferred_mains` (the launcher does), a ``DistributedOptimizer``
allocates no fp32 mains at all: Megatron's build would otherwise hold bf16 params,
fp32 grads and fp32 mains at once (10 bytes per param, against 6 once streaming
took the mains), and that build-time peak, not the steady state, capped the model
size. The binding then fills each main from its param as the store writes it,
bucket by bucket.

Native-fp32 model params are their own mains (a view of the param buffer); their
moments stream in buckets of their own, or stay resident beside them under a small
optimizer of the same class (``fp32_param_moments``).

Reproduced upstream code is marked with its provenance: NVIDIA/Megatron-LM tag
``core_v0.19.0`` (commit 5be9626709af2722333bf54797c954c09edeada3), whose
``megatron/core/optimizer/distrib_optimizer.py`` is byte-identical to the
megatron-core 0.19.2 wheel's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_hooks import fingerprint
from megatron_hooks.checkpoint import check_patched
from megatron_hooks.contract import HOOK_ABI_VERSION, STORE_ATTR
from miles_plugins.optimizers.config import AUTO, StreamConfig
from miles_plugins.optimizers.errors import CheckpointMismatchError, StoreUnusableError, StreamConfigError
from miles_plugins.optimizers.homes import auto_budget
from miles_plugins.optimizers.homes.auto_budget import AutoGpuBudget
from miles_plugins.optimizers.megatron.args import refusals_of_optimizer
from miles_plugins.optimizers.megatron.pins import PINS
from miles_plugins.optimizers.step.adam import backend_for, bind_master
from miles_plugins.optimizers.step.entries import Entry, StepStats
from miles_plugins.optimizers.store.streaming_store import StreamingStore

logger = logging.getLogger(__name__)

# Marks a state dict written by a streamed optimizer: it holds param-group options
# and the grad scaler only; the param state is in the store's files.
STREAMED_STATE_KEY = "streamed_optimizer_state"


@dataclasses.dataclass
class MegatronEntry(Entry):
    """An :class:`Entry` that also knows its (unsharded) model param, the key of
    every Megatron range map."""

    model_param: torch.nn.Parameter | None = None


def _is_distributed_optimizer(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer)


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def chained_distributed_optimizers(optimizer: Any) -> list[tuple[int, Any]]:
    """(position in the chain, optimizer) for every non-stub ``DistributedOptimizer``.

    Walks ``optimizer.chained_optimizers`` (dense and expert optimizers) or takes
    ``optimizer`` itself. Stub optimizers (frozen sub-models, no params) are
    skipped. Anything else in the chain is refused, naming its type.
    """
    chain = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    found, refused = [], []
    for index, member in enumerate(chain):
        if getattr(member, "is_stub_optimizer", False):
            continue
        if _is_distributed_optimizer(member):
            found.append((index, member))
        else:
            refused.append(f"chain position {index}: {_type_name(member)}")
    if refused:
        raise StreamConfigError(
            "optimizer-state streaming binds to Megatron's DistributedOptimizer only (it streams its "
            "fp32 main shards); got " + "; ".join(refused) + ". Build the optimizer with "
            "use_distributed_optimizer=True"
        )
    return found


def check_supported(dist_opt: Any) -> None:
    """Refuse (all reasons at once) a ``DistributedOptimizer`` streaming cannot serve:
    the refusals of ``args.REFUSALS`` that can be seen on a built optimizer, and an
    inner optimizer whose exact update no backend reproduces."""
    reasons = refusals_of_optimizer(dist_opt)
    try:
        backend_for(dist_opt.optimizer)
    except StreamConfigError as e:
        reasons.append(str(e))
    if reasons:
        raise StreamConfigError(
            f"cannot stream the state of this {_type_name(dist_opt)}:\n  - " + "\n  - ".join(reasons)
        )


def check_upstream() -> None:
    """Refuse to stream on a Megatron this binding was not validated on: the
    checkpoint hooks must be in ``megatron/training/checkpointing.py`` at this
    ABI version, and every pinned upstream function must have a validated
    fingerprint (the tripwire; see ``pins.py``)."""
    check_patched()
    fingerprint.check_live(PINS)


class _MainsWithoutStorage(TorchFunctionMode):
    """Turns ``Tensor.float()`` of a bf16/fp16 tensor into an fp32 tensor of its shape
    whose storage is released (0 bytes), as the store keeps every streamed main
    between steps. Active only inside ``_build_model_and_main_param_groups``, where
    that call is how each main is made (``shard_model_param.clone().float()``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float and not kwargs and args[0].dtype in (torch.bfloat16, torch.float16):
            main = torch.empty(args[0].shape, dtype=torch.float32, device=args[0].device)
            # Allocated and at once given back to the caching allocator: the next main
            # reuses the block, so the build never holds more than one main.
            main.untyped_storage().resize_(0)
            return main
        return func(*args, **kwargs)


# Which threads are inside a deferred_mains() block, and how many blocks are open: the
# class attribute is wrapped while any is, and its wrapper defers only those threads' builds.
_deferring = threading.local()
_deferred_blocks = 0
_deferred_lock = threading.Lock()
_upstream_build = None  # the classmethod the wrapper stands in for, while it does


def _build_deferring_mains_on_deferring_threads(cls, *args, **kwargs):
    if getattr(_deferring, "depth", 0):
        with _MainsWithoutStorage():
            return _upstream_build.__func__(cls, *args, **kwargs)
    return _upstream_build.__func__(cls, *args, **kwargs)


@contextlib.contextmanager
def deferred_mains() -> Iterator[None]:
    r"""Build ``DistributedOptimizer``\ s inside this without device memory for their
    fp32 mains; :class:`MegatronBinding` (``setup_optimizer_state_streaming``) must
    then stream every one of them before anything steps or saves them::

        with deferred_mains():
            optimizer = get_megatron_optimizer(config, model_chunks)
        setup_optimizer_state_streaming(args, optimizer)

    Megatron's ``_build_model_and_main_param_groups`` (pinned: the tripwire runs
    first, so a drifted Megatron is refused before anything is built) makes each
    main as ``shard_model_param.clone().float()``; inside this context that call
    returns a storage-less fp32 tensor, and the binding later fills it with the
    same exact fp32 value from the bf16 param, one bucket at a time. The class
    attribute is wrapped while any block is open (blocks may nest or overlap, on
    any threads) and put back when the last one closes, whatever happens; only
    builds on a thread inside a block are deferred.
    """
    global _deferred_blocks, _upstream_build
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    check_upstream()
    with _deferred_lock:
        if _deferred_blocks == 0:
            _upstream_build = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
            DistributedOptimizer._build_model_and_main_param_groups = classmethod(
                _build_deferring_mains_on_deferring_threads
            )
        _deferred_blocks += 1
    _deferring.depth = getattr(_deferring, "depth", 0) + 1
    try:
        yield
    finally:
        _deferring.depth -= 1
        with _deferred_lock:
            _deferred_blocks -= 1
            if _deferred_blocks == 0:
                DistributedOptimizer._build_model_and_main_param_groups = _upstream_build
                _upstream_build = None


def _mains_deferred(entries: list[MegatronEntry]) -> bool:
    """Whether the mains were built by :func:`deferred_mains` (all of them, or none)."""
    deferred = [e.main.untyped_storage().nbytes() == 0 for e in entries if not e.resident and e.main.numel()]
    if any(deferred) and not all(deferred):
        raise StreamConfigError(
            f"{sum(deferred)} of the {len(deferred)} fp32 mains of this DistributedOptimizer have no storage: "
            "some were built under deferred_mains() and some not, or something released them; build the "
            "whole optimizer inside one deferred_mains() block (or none)"
        )
    return any(deferred)


def _main_from_param(param: torch.Tensor, main: torch.Tensor) -> None:
    # The value Megatron's build gives a main (shard_model_param.clone().float()): exact.
    main.copy_(param)


class MegatronBinding:
    """The streamed state of one ``DistributedOptimizer`` and its instance bindings.

    Build it right after ``get_megatron_optimizer(...)``, before the first step
    and before ``load_checkpoint``. Construction checks the optimizer
    (:func:`check_supported`), writes every fp32 main to the store's files and
    releases their device storage (mains built under :func:`deferred_mains` have
    none: each is filled from its param as its bucket is written), then rebinds the optimizer's state entry
    points (see the module docstring). The binding is the store the checkpoint
    hooks call (``megatron_hooks.contract.OptimizerStateStore``), reachable as
    ``getattr(dist_opt, megatron_hooks.contract.STORE_ATTR)``.
    """

    def __init__(self, dist_opt: Any, config: StreamConfig, auto_gpu: AutoGpuBudget | None = None) -> None:
        check_supported(dist_opt)
        self.dist_opt = dist_opt
        # A param's identity across DP sizes: its model chunk and name (same TP, PP, EP).
        self.names = {
            p: f"{i}/{name}" for i, chunk in enumerate(dist_opt.model_chunks) for name, p in chunk.named_parameters()
        }
        self.entries = self._entries()
        self.store = StreamingStore(
            self.entries,
            backend_for(dist_opt.optimizer),
            config,
            copy_to_model=self._copy_main_to_param_buffer,
            init_main=_main_from_param if _mains_deferred(self.entries) else None,
            topology=self._topology(),
            param_layout=param_layout(dist_opt, self.names),
            auto_gpu=auto_gpu,
        )
        # The streamed marker of a loaded optimizer state dict, until the load hook
        # has restored the files it promises (it stays set when that load fails).
        self._awaiting_state: dict | None = None
        self._load_failure: str | None = None
        self._bind()

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

    def save_to(self, base_dir: str) -> None:
        self.store.save_to(base_dir)

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

    def _topology(self) -> dict[str, int]:
        """Parallel sizes and this rank's coordinates: a checkpoint loads only into the same."""
        from megatron.core import parallel_state as mpu

        opt = self.dist_opt
        # The expert optimizer's params are split by expert-TP and EP rank; the dense
        # ones are replicated across EP ranks (they shard over the whole DP group).
        expert = any(
            not getattr(p, "allreduce", True)
            for group in opt.model_float16_groups + opt.model_fp32_groups
            for p in group
        )
        if expert:
            peers = {
                "expert_tp_size": mpu.get_expert_tensor_parallel_world_size(),
                "expert_tp_rank": mpu.get_expert_tensor_parallel_rank(),
                "ep_size": mpu.get_expert_model_parallel_world_size(),
                "ep_rank": mpu.get_expert_model_parallel_rank(),
            }
        else:
            peers = {
                "tp_size": mpu.get_tensor_model_parallel_world_size(),
                "tp_rank": mpu.get_tensor_model_parallel_rank(),
                "ep_size": mpu.get_expert_model_parallel_world_size(),
            }
        peers.update(
            pp_size=mpu.get_pipeline_model_parallel_world_size(),
            pp_rank=mpu.get_pipeline_model_parallel_rank(),
            # Each distributed-optimizer instance holds a whole copy of the state.
            optimizer_instance=opt.distributed_optimizer_instance_id,
        )
        return {
            # The saves this rank's state can be resharded from name the same peers (checkpoint/reshard_load.py).
            "shard_peers": peers,
            "world_size": torch.distributed.get_world_size(),
            "tp_size": mpu.get_tensor_model_parallel_world_size(),
            "tp_rank": mpu.get_tensor_model_parallel_rank(),
            "pp_size": mpu.get_pipeline_model_parallel_world_size(),
            "pp_rank": mpu.get_pipeline_model_parallel_rank(),
            "ep_size": mpu.get_expert_model_parallel_world_size(),
            "ep_rank": mpu.get_expert_model_parallel_rank(),
            "dp_size": opt.data_parallel_group.size(),
            "dp_rank": opt.data_parallel_group.rank(),
            "optimizer_instance": opt.distributed_optimizer_instance_id,
        }

    # ---- entries ---------------------------------------------------------------

    def _entries(self) -> list[MegatronEntry]:
        opt = self.dist_opt
        entries = []
        for group_index, (model_group, main_group) in enumerate(
            zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True)
        ):
            for model_param, main in zip(model_group, main_group, strict=True):
                entries.append(self._entry(model_param, self._model_shard(model_param), main, group_index))
        for group_index, (model_group, shard_group) in enumerate(
            zip(opt.model_fp32_groups, opt.shard_fp32_groups, strict=True)
        ):
            for model_param, shard in zip(model_group, shard_group, strict=True):
                # An fp32 param is its own main: the shard the optimizer updates must
                # alias the param buffer, or upstream's copy into the buffer (which
                # this binding skips for resident entries) would not be a no-op.
                if shard.data_ptr() != self._param_buffer_shard(model_param, shard.numel()).data_ptr():
                    raise StreamConfigError(
                        f"an fp32 param's main shard does not alias the DDP param buffer "
                        f"(shape {tuple(model_param.shape)}): this Megatron lays params out differently "
                        "than the binding was validated on"
                    )
                entries.append(self._entry(model_param, shard, shard, group_index))
        return entries

    def _entry(self, model_param, param: torch.Tensor, main: torch.Tensor, group_index: int) -> MegatronEntry:
        return MegatronEntry(
            param=param,
            main=main,
            group_index=group_index,
            bucket_key=self._ddp_bucket(model_param),
            name=self.names.get(model_param),
            start=self._param_range(model_param).start,
            model_param=model_param,
        )

    def _ddp_bucket(self, model_param: torch.nn.Parameter) -> tuple[int, int]:
        gbuf_index, _, bucket_index = self.dist_opt.model_param_gbuf_map[model_param]
        return gbuf_index, bucket_index

    def _param_range(self, model_param: torch.nn.Parameter):
        """The elements of ``model_param`` this rank's shard holds (Megatron's ``Range``)."""
        return self.dist_opt._get_model_param_range_map(model_param)["param"]

    def _model_shard(self, model_param: torch.nn.Parameter, source: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shard of ``model_param`` (or of ``source``, a tensor of its shape)."""
        param_range = self._param_range(model_param)
        base = model_param if source is None else source
        return base.detach().view(-1)[param_range.start : param_range.end]

    def _param_buffer_shard(self, model_param: torch.nn.Parameter, main_numel: int) -> torch.Tensor:
        # Reproduces, from DistributedOptimizer._copy_main_params_to_model_params at
        # core_v0.19.0 (copy_group_params, non-fp8 branch), how a main shard finds
        # its place in the DDP param buffer. Recheck on drift: the range map keys
        # ("gbuf_world_in_bucket"), model_param_gbuf_map's tuple order, and
        # buffers[i].buckets[j].param_data.
        opt = self.dist_opt
        world_range = opt._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
        if world_range.size != main_numel:
            raise RuntimeError(
                f"a main shard has {main_numel} elements but its world range in the param buffer has "
                f"{world_range.size}: the DistributedOptimizer range maps are not what the binding expects"
            )
        gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
        model_param_buffer = opt.buffers[gbuf_index].buckets[bucket_id].param_data
        return model_param_buffer.view(-1)[world_range.start : world_range.end]

    def _copy_main_to_param_buffer(self, entry: MegatronEntry) -> None:
        if not entry.resident:  # an fp32 param's main is its shard of the buffer already
            self._param_buffer_shard(entry.model_param, entry.main.numel()).copy_(entry.main)

    # ---- bindings --------------------------------------------------------------

    def _bind(self) -> None:
        opt, store = self.dist_opt, self.store
        bind_master(
            opt.optimizer,
            self.step,
            checkpoint_with="Megatron's save_checkpoint / load_checkpoint on a patched tree (their hooks "
            "call the store's save_to / load_from)",
        )
        upstream_step_with_ready_grads = opt.step_with_ready_grads
        upstream_prepare_grads = opt.prepare_grads
        upstream_zero_grad = opt.zero_grad

        def prepare_grads(self_: Any) -> bool:
            found_inf = upstream_prepare_grads()
            # Unless the step is about to be skipped (inf/nan grads), start reading its
            # first buckets: the reads overlap the grad-norm reduction and clipping.
            if not found_inf:
                store.prefetch()
            return found_inf

        def zero_grad(self_: Any, *args, **kwargs) -> None:
            # A new iteration: reads prefetched for a step that never ran (another
            # optimizer in the chain found inf/nan) must not stay on the device.
            store.drop_prefetch()
            return upstream_zero_grad(*args, **kwargs)

        def step_with_ready_grads(self_: Any) -> bool:
            before = store.steps_taken
            # Upstream's method: the inner step (now the streamed step, which also
            # copies mains into the param buffer), then the param all-gather tail.
            result = upstream_step_with_ready_grads()
            if store.steps_taken != before + 1:
                raise RuntimeError(
                    f"{_type_name(self_)}.step_with_ready_grads ran the streamed step "
                    f"{store.steps_taken - before} times instead of once: upstream's step no longer "
                    "calls self.optimizer.step() exactly once; recheck the binding against this Megatron"
                )
            return result

        def copy_main_params_to_model_params(self_: Any) -> None:
            # Each bucket's mains were copied into the param buffer as the bucket
            # finished its streamed step; outside a step the buffer already holds them.
            return None

        def reload_model_params(self_: Any, state_dict: dict | None = None) -> None:
            self._reload_mains(state_dict)

        def state_dict(self_: Any) -> dict:
            return self._state_dict()

        def load_state_dict(self_: Any, state_dict: dict) -> None:
            self._load_state_dict(state_dict)

        def sharded_state_dict(self_: Any, *args, **kwargs) -> dict:
            # Same dict whether saving or loading (upstream's signature varies by commit).
            return self._sharded_state_dict()

        def parameter_state_file(self_: Any, filename: str, **kwargs) -> None:
            # The legacy format's per-rank state file would read evicted storage; the
            # streamed state is saved and loaded by the checkpoint hooks instead.
            return None

        def offload_to_cpu(self_: Any) -> None:
            # Upstream moves every main and moment off the GPU (RL phases); the streamed
            # state is there already and its mains have no storage, except the buckets
            # kept on the GPU by its budget.
            self.store.offload_device_home()

        def restore_from_cpu(self_: Any) -> None:
            self.store.restore_device_home()

        for name, fn in (
            ("prepare_grads", prepare_grads),
            ("zero_grad", zero_grad),
            ("step_with_ready_grads", step_with_ready_grads),
            ("_copy_main_params_to_model_params", copy_main_params_to_model_params),
            ("reload_model_params", reload_model_params),
            ("state_dict", state_dict),
            ("load_state_dict", load_state_dict),
            ("sharded_state_dict", sharded_state_dict),
            ("save_parameter_state", parameter_state_file),
            ("load_parameter_state", parameter_state_file),
            ("offload_to_cpu", offload_to_cpu),
            ("restore_from_cpu", restore_from_cpu),
        ):
            setattr(opt, name, types.MethodType(fn, opt))
        setattr(opt, STORE_ATTR, self)
        if store.config.overlap_bytes:
            for chunk in opt.model_chunks:
                chunk.register_forward_pre_hook(lambda module, args: store.progress())

    @torch.no_grad()
    def _reload_mains(self, state_dict: dict | None) -> None:
        opt = self.dist_opt
        if state_dict is None:
            sources = {e.param: e.param for e in self.entries}
        else:
            # Upstream's own mapping from model params to the state dict's tensors
            # (present on commits whose reload_model_params takes a state_dict).
            by_model_param = opt._build_model_param_to_state_dict_param_map(state_dict)
            sources = {e.param: self._model_shard(e.model_param, by_model_param[e.model_param]) for e in self.entries}
        for entry in self.entries:
            if entry.resident and sources[entry.param] is not entry.param:
                entry.main.copy_(sources[entry.param])
        self.store.refresh_main_from_model_params(lambda param, main: main.copy_(sources[param]))

    def _state_dict(self) -> dict:
        opt = self.dist_opt
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
        # The marker sits inside "optimizer", the one object upstream's state dicts
        # also carry: loading a checkpoint written without streaming then reaches
        # _load_state_dict's refusal instead of a missing-key error from the loader.
        state = {
            "optimizer": {
                "param_groups": groups,
                STREAMED_STATE_KEY: {"hook_abi_version": HOOK_ABI_VERSION, "steps_taken": self.store.steps_taken},
            }
        }
        if opt.grad_scaler:
            state["grad_scaler"] = opt.grad_scaler.state_dict()
        return state

    def _load_state_dict(self, state_dict: dict) -> None:
        marker = (state_dict.get("optimizer") or {}).get(STREAMED_STATE_KEY)
        if marker is None:
            raise CheckpointMismatchError(
                "this checkpoint's optimizer state was written without optimizer-state streaming: loading it "
                "here would restart Adam from zero behind your back. Resume it without streaming, or load "
                "with --no-load-optim to start the optimizer fresh from the loaded params"
            )
        if marker.get("hook_abi_version") != HOOK_ABI_VERSION:
            raise CheckpointMismatchError(
                f"this checkpoint's streamed optimizer state was written with hook ABI "
                f"{marker.get('hook_abi_version')}, this version reads {HOOK_ABI_VERSION}"
            )
        groups = self.dist_opt.optimizer.param_groups
        saved_groups = state_dict["optimizer"]["param_groups"]
        if len(saved_groups) != len(groups):
            raise CheckpointMismatchError(
                f"the checkpoint has {len(saved_groups)} optimizer param groups, this optimizer {len(groups)}"
            )
        for group, saved in zip(groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if self.dist_opt.grad_scaler and "grad_scaler" in state_dict:
            self.dist_opt.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        self._awaiting_state = dict(marker)

    def _sharded_state_dict(self) -> dict:
        # The same wrapping upstream gives its non-reshardable formats' common state
        # (DistributedOptimizer.sharded_state_dict at core_v0.19.0): one object per
        # data-parallel group, replicated over this instance's DP ranks.
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        opt = self.dist_opt
        return {
            k: ShardedObject(
                f"optimizer.distributed.dp_group_idx_{opt.data_parallel_group_idx}.{k}",
                v,
                (1,),
                (0,),
                replica_id=(opt.distributed_optimizer_instance_id, 0, opt.data_parallel_group.rank()),
            )
            for k, v in self._state_dict().items()
        }

    # ---- reading the state back ----------------------------------------------

    def iter_state(self) -> Iterator[tuple[MegatronEntry, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Yield (entry, main, exp_avg, exp_avg_sq) as fp32 CPU copies, one bucket at a time."""
        for index, main, exp_avg, exp_avg_sq in self.store.iter_state():
            yield self.entries[index], main, exp_avg, exp_avg_sq


def param_layout(dist_opt: Any, names: dict) -> dict | None:
    """Every param of each DDP bucket ``dist_opt`` shards, in the order the range maps
    list them ([name, start in the bucket, numel]), with the bucket's unpadded size
    and the padding rule: from it, ``ckpt reshard`` computes Megatron's sharding at
    another DP size (each bucket padded to a multiple of lcm(dp, 128[, 2**16]), cut
    into dp equal ranges). None where the buffers do not expose ``param_index_map``."""
    buckets = []
    for gbuf_index, buffer in enumerate(dist_opt.buffers):
        index_map = getattr(buffer, "param_index_map", None)
        if index_map is None:
            return None
        for bucket_index, bucket in enumerate(buffer.buckets):
            params = [
                [names.get(p), start - bucket.offset, end - start]
                for p, (start, end, b) in index_map.items()
                if b == bucket_index
            ]
            size = max((start + numel for _, start, numel in params), default=0)
            buckets.append({"key": [gbuf_index, bucket_index], "params": params, "size": size})
    ddp_config = getattr(dist_opt, "ddp_config", None)
    return {
        "buckets": buckets,
        "pad_for_high_nccl_busbw": bool(getattr(ddp_config, "pad_buckets_for_high_nccl_busbw", False)),
        # Megatron's default grows with DP above 40 (max(4e7, 1e6 * dp)): then another DP buckets differently.
        "ddp_bucket_size": getattr(ddp_config, "bucket_size", None),
    }


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
        config = dataclasses.replace(config, drive_ranks=auto_budget.local_ranks(group=True)[0])
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
