"""The store contract: what the checkpoint hooks and the optimizer bindings call.

A *store* owns one optimizer's streamed state (fp32 main params and Adam
moments kept in per-bucket files instead of on the accelerator). The plugin
attaches one store per ``DistributedOptimizer`` instance under ``STORE_ATTR``;
the checkpoint hooks find the stores there and call ``save_to`` / ``load_from``.

This module imports nothing heavy (no torch): it is the seam between the patched
Megatron tree and whatever plugin implements the store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

# The attribute under which a store hangs on an optimizer instance.
STORE_ATTR = "_miles_optimizer_state_store"
# Set (True) on the optimizer a plugin streamed, also where its chain holds no params on
# this rank (no store): that rank still joins the other ranks' agreement on a save.
STREAMING_ATTR = "_miles_optimizer_state_streaming"

# Bumped whenever the calls the patched Megatron lines make change shape. The
# patched tree records the version it was patched for; the plugin refuses a
# tree patched for a version it does not answer.
HOOK_ABI_VERSION = 2
# Versions whose calls this plugin answers: ABI 1's save passes no async request
# (its saves of the streamed state are synchronous, also with --async-save).
ANSWERED_HOOK_ABIS = (1, 2)


@runtime_checkable
class PendingSave(Protocol):
    """A save running in the background (``save_to(..., asynchronous=True)``)."""

    def wait(self) -> None:
        """Return once the save is durable and in place; raise its error where it failed."""

    def done(self) -> bool:
        """Whether the save has ended (``wait()`` then returns or raises at once)."""


@runtime_checkable
class OptimizerStateStore(Protocol):
    """The calls every streamed-state store answers.

    ``step()``
        Run one optimizer step over all of the store's state, bucket by bucket,
        leaving the updated params in the model and the state back in storage.
    ``refresh_main_from_model_params(copy_fn)``
        Rebuild the fp32 main params from the model params (after the model's
        weights were loaded or changed outside the optimizer). ``copy_fn(param,
        main)`` fills ``main`` from ``param``; moments are left as they are.
    ``save_to(base_dir, asynchronous=False)``
        Persist the full streamed state under ``base_dir`` (a checkpoint
        directory this store owns a subdirectory of). Returns when the bytes are
        durable; with ``asynchronous``, once the state is snapshotted, returning a
        :class:`PendingSave` whose ``wait()`` returns when they are.
    ``load_from(base_dir) -> bool``
        Restore the state saved by ``save_to``. Returns ``False`` when
        ``base_dir`` holds no streamed state for this store; raises when it holds
        state that does not match this store.
    ``before_next_step(check)``
        Call ``check()`` before the next step runs; an exception it raises
        refuses the step (and ``check`` runs again before the one after).
    """

    def step(self) -> Any: ...

    def refresh_main_from_model_params(self, copy_fn: Callable[[Any, Any], None]) -> None: ...

    def save_to(self, base_dir: str, asynchronous: bool = False) -> PendingSave | None: ...

    def load_from(self, base_dir: str) -> bool: ...

    def before_next_step(self, check: Callable[[], None]) -> None: ...
