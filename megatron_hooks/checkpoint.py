"""What the patched lines of ``megatron/training/checkpointing.py`` call.

The patch series (``patches/``) adds, and this module answers, exactly::

    # near the top of checkpointing.py: the marker and this module
    MILES_OPTIMIZER_STATE_HOOK_ABI = 2
    try:
        from megatron_hooks import checkpoint as _optimizer_state_hooks
    except ModuleNotFoundError:  # no plugin installed: the hooks are inert
        _optimizer_state_hooks = None

    # save_checkpoint: after the checkpoint (and the optimizer state) is written, or
    # its asynchronous save requested, before rank 0 marks the iteration complete
    if _optimizer_state_hooks is not None:
        _optimizer_state_hooks.save(args, optimizer, checkpoint_name, ckpt_type, async_save_request)

    # load_checkpoint: after the model params and the optimizer's own state dict
    # are loaded (or the mains rebuilt from the params)
    if _optimizer_state_hooks is not None:
        _optimizer_state_hooks.load(args, optimizer, checkpoint_name, ckpt_type)

Both find the stores the plugin attached to the optimizer and to each chained
optimizer (``contract.STORE_ATTR``) and do nothing when there are none and the
optimizer is not marked streamed (``contract.STREAMING_ATTR``), so a patched tree
behaves as an unpatched one unless streaming is on. Each store
owns ``<iteration dir>/streamed_optimizer_state/<store name>/``. No torch here
(but in the finalize of an asynchronous save, which Megatron runs with torch loaded).

With ``--async-save`` Megatron hands the save an ``AsyncRequest`` whose finalize
functions run on every rank, in order, once its own part is written on all of
them; rank 0's writes the tracker that marks the iteration complete. The stores
then save in the background (``save_to(..., asynchronous=True)``), and a finalize
function added before the tracker's lets it run only once every rank's streamed
state is saved, without stopping training meanwhile (``async_finalize.py``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import weakref
from typing import Any

from megatron_hooks.async_finalize import (
    FinishStreamedSaves,
    clear_markers,
    finish_before_steps,
    finish_deferred,
    next_save_number,
)
from megatron_hooks.contract import (
    ANSWERED_HOOK_ABIS,
    HOOK_ABI_VERSION,
    STORE_ATTR,
    STREAMING_ATTR,
    OptimizerStateStore,
)

logger = logging.getLogger(__name__)

# The module-level name the patch gives the ABI version in checkpointing.py.
PATCH_MARKER = "MILES_OPTIMIZER_STATE_HOOK_ABI"
# The module-level name under which checkpointing.py holds this module.
HOOKS_NAME = "_optimizer_state_hooks"
STATE_DIRNAME = "streamed_optimizer_state"

# Megatron names an iteration directory iter_0000123 or release (get_checkpoint_name).
_ITERATION_DIR = re.compile(r"(iter_\d{7,}|release)")


class HooksNotInstalledError(RuntimeError):
    """The Megatron tree in use lacks the checkpoint hooks (or has another version)."""


def stores_of(optimizer: Any) -> list[OptimizerStateStore]:
    """The stores attached to ``optimizer`` or to its chained optimizers, in chain order."""
    if optimizer is None:
        return []
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [store for member in chain if (store := getattr(member, STORE_ATTR, None)) is not None]


def iteration_dir(checkpoint_name: str, ckpt_type: Any) -> str:
    """The iteration directory of a checkpoint, from the name ``save_checkpoint`` /
    ``load_checkpoint`` hold: the directory itself, except for the legacy format,
    whose name is this rank's file ``<iteration dir>/mp_rank_XX[...]/model_optim_rng.pt``
    (the streamed state must never go under that file's path)."""
    kind = getattr(ckpt_type, "name", ckpt_type)
    if kind == "LOCAL":
        raise RuntimeError(
            "non-persistent local checkpoints (--non-persistent-ckpt-type local) cannot carry the streamed "
            "optimizer state; use --non-persistent-ckpt-type global"
        )
    path = os.path.normpath(checkpoint_name)
    if kind == "LEGACY":
        path = os.path.dirname(os.path.dirname(path))
    if not _ITERATION_DIR.fullmatch(os.path.basename(path)):
        raise RuntimeError(
            f"cannot place the streamed optimizer state: {checkpoint_name!r} (checkpoint type {kind}) does not "
            "resolve to an iter_XXXXXXX or release directory; Megatron's checkpoint naming changed, "
            "recheck megatron_hooks.checkpoint.iteration_dir against get_checkpoint_name"
        )
    return path


def state_dir(checkpoint_name: str, ckpt_type: Any) -> str:
    return os.path.join(iteration_dir(checkpoint_name, ckpt_type), STATE_DIRNAME)


def save(args: Any, optimizer: Any, checkpoint_name: str, ckpt_type: Any, async_save_request: Any = None) -> None:
    """Persist every store's state into the checkpoint being saved (each rank its own):
    now, or with Megatron's ``async_save_request`` in the background, finished by a
    finalize function of that request (see the module docstring)."""
    stores = stores_of(optimizer)
    if not stores and not getattr(optimizer, STREAMING_ATTR, False):
        return  # not streamed (a rank streaming none of its chain still joins the ranks' agreement below)
    if getattr(args, "no_save_optim", False):
        logger.warning(
            "--no-save-optim: the streamed optimizer state is not saved, as Megatron saves no optimizer state"
        )
        return
    directory = state_dir(checkpoint_name, ckpt_type)
    for store in stores:
        if store in _awaiting_continuation:  # not stepped since its load: the run may count from elsewhere
            _check_continuation(*_awaiting_continuation[store])
    finish_deferred(block=True)  # an earlier checkpoint's tracker first (each store saves one at a time anyway)
    if async_save_request is None:
        for store in stores:
            store.save_to(directory)
        return
    rank, world_size = _rank_and_world_size()
    clear_markers(directory, rank)
    finish_before_steps(optimizer)
    number = next_save_number()
    pending = [store.save_to(directory, asynchronous=True) for store in stores]
    async_save_request.add_finalize_fn(FinishStreamedSaves(pending, directory, rank, world_size, number))


def _rank_and_world_size() -> tuple[int, int]:
    import torch  # noqa: PLC0415 - only here: the rest of this module stays torch-free

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def load(args: Any, optimizer: Any, checkpoint_name: str, ckpt_type: Any) -> None:
    """Restore every store's state from the checkpoint being loaded.

    Each store decides from what Megatron already did: when Megatron loaded the
    optimizer's state dict (the same conditions it applies to all optimizer
    state: ``--no-load-optim``, ``--finetune``, a release checkpoint), the store
    must find its state here or refuse; otherwise it keeps the mains Megatron
    rebuilt from the loaded params and starts its moments fresh. A store that
    loaded state then checks that the run continues from the iteration the
    state belongs to (:func:`_expect_continuation`).
    """
    stores = stores_of(optimizer)
    if not stores:
        return
    directory = state_dir(checkpoint_name, ckpt_type)
    loaded = False
    for store in stores:
        if store.load_from(directory):
            loaded = True
            _expect_continuation(args, store, iteration_dir(checkpoint_name, ckpt_type))
    if loaded:
        _check_legacy_count(args, ckpt_type, iteration_dir(checkpoint_name, ckpt_type))


# Stores loaded from a checkpoint that have not stepped since -> (the iteration
# their state belongs to, its directory, Megatron's args).
_awaiting_continuation: weakref.WeakKeyDictionary[Any, tuple[int, str, Any]] = weakref.WeakKeyDictionary()


def _iteration_of(directory: str) -> int | None:
    """The iteration an ``iter_XXXXXXX`` directory holds; None for ``release``."""
    name = os.path.basename(directory)
    return int(name[len("iter_") :]) if name.startswith("iter_") else None


def _expect_continuation(args: Any, store: OptimizerStateStore, directory: str) -> None:
    """Refuse to go on from an iteration other than the one the loaded state belongs to.

    ``load_checkpoint`` returns the iteration the run counts from; the streamed
    state comes from the directory the hook was given, and the two can differ (a
    legacy checkpoint with the distributed optimizer counts from its tracker file:
    :func:`_check_legacy_count`, docs/checkpoints.md). Megatron's ``args.iteration``
    holds that count (set by ``setup_model_and_optimizer``, not advanced by the
    training loop), so it is compared before the store's next step and by a save
    that comes before any step; a caller that does not set it gets no check. A run
    counting from exactly ``--override-ckpt-iteration`` is let through.
    """
    loaded = _iteration_of(directory)
    if loaded is None:
        _awaiting_continuation.pop(store, None)
        return
    armed = store in _awaiting_continuation
    _awaiting_continuation[store] = (loaded, directory, args)  # a reload replaces what an earlier load expected
    if armed:
        return

    def check() -> None:
        expected = _awaiting_continuation.get(store)
        if expected is not None:
            _check_continuation(*expected)
            del _awaiting_continuation[store]

    before_next_step = getattr(store, "before_next_step", None)
    if before_next_step is not None:
        before_next_step(check)


def _check_legacy_count(args: Any, ckpt_type: Any, directory: str) -> None:
    """Refuse, at the load, the known case of :func:`_expect_continuation` for callers
    that keep ``load_checkpoint``'s iteration to themselves (miles does): a legacy
    checkpoint (``ckpt_type`` LEGACY, whatever ``--ckpt-format`` said: Megatron
    detects the format on disk) with the distributed optimizer, where Megatron
    counts from the iteration its tracker file names, whatever was loaded
    (``--override-ckpt-iteration`` included: that branch overwrites it)."""
    if getattr(ckpt_type, "name", ckpt_type) != "LEGACY" or not getattr(args, "use_distributed_optimizer", False):
        return
    loaded = _iteration_of(directory)
    if loaded is None:
        return
    tracker = os.path.join(os.path.dirname(directory), "latest_checkpointed_iteration.txt")
    try:
        with open(tracker) as f:
            counted = f.read().strip()
    except OSError:
        return  # Megatron read it a moment ago; without it there is nothing to compare
    if counted.isdigit() and int(counted) != loaded:
        raise RuntimeError(_continuation_error(loaded, directory, int(counted)))


def _check_continuation(loaded: int, directory: str, args: Any) -> None:
    current = getattr(args, "iteration", None)
    if current is None or current == loaded or current == getattr(args, "override_ckpt_iteration", None):
        return
    raise RuntimeError(_continuation_error(loaded, directory, current))


def _continuation_error(loaded: int, directory: str, current: int) -> str:
    return (
        f"the streamed optimizer state was loaded from iteration {loaded} ({directory}), but Megatron continues "
        f"from iteration {current}: the optimizer state, and the params loaded with it, do not belong to the "
        "iteration this run counts from. From a legacy checkpoint (--ckpt-format torch) with the distributed "
        "optimizer, Megatron counts from the iteration latest_checkpointed_iteration.txt names, whatever "
        "--ckpt-step or --override-ckpt-iteration say: load that iteration, or write the one you want into "
        "the tracker file. Elsewhere, --override-ckpt-iteration (where this Megatron has it) counts from "
        "another iteration on purpose (or after the iteration directory was renamed)"
    )


def check_patched() -> None:
    """Refuse unless the imported ``megatron.training.checkpointing`` carries these
    hooks at this ABI version (streaming on an unpatched tree would write
    checkpoints without the optimizer state)."""
    fix = (
        "apply the patch series: `make apply-patches MEGATRON_DIR=<the tree that provides megatron/>` "
        "(or `python -m megatron_hooks apply --megatron-dir ...`), then restart"
    )
    try:
        import megatron.training.checkpointing as checkpointing
    except ImportError as exc:
        raise HooksNotInstalledError(
            f"megatron.training.checkpointing cannot be imported ({exc}): the streamed optimizer state is "
            "saved and loaded by hooks in that file, so streaming needs the Megatron-LM training package "
            f"(megatron-core >= 0.17 wheels include it); {fix}"
        ) from exc
    version = getattr(checkpointing, PATCH_MARKER, None)
    if version is None:
        raise HooksNotInstalledError(
            f"{checkpointing.__file__} lacks the optimizer-state checkpoint hooks: its checkpoints would "
            f"silently drop the streamed optimizer state; {fix}"
        )
    if version not in ANSWERED_HOOK_ABIS:
        raise HooksNotInstalledError(
            f"{checkpointing.__file__} carries checkpoint hooks for ABI {version}, this plugin speaks "
            f"{HOOK_ABI_VERSION}: revert them (`make revert-patches`) and apply this version's series"
        )
    if version != HOOK_ABI_VERSION:
        logger.warning(
            "%s carries checkpoint hooks for ABI %s: with --async-save the streamed optimizer state is saved "
            "synchronously there; `make revert-patches` and `make apply-patches` give it ABI %s (background saves)",
            checkpointing.__file__,
            version,
            HOOK_ABI_VERSION,
        )
    if getattr(checkpointing, HOOKS_NAME, None) is not sys.modules[__name__]:
        raise HooksNotInstalledError(
            f"{checkpointing.__file__} is patched but its hooks module is "
            f"{getattr(checkpointing, HOOKS_NAME, None)!r}, not {__name__}: megatron_hooks was not importable "
            "when checkpointing.py was first imported"
        )
