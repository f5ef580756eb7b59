"""Building ``DistributedOptimizer``s without device memory for their fp32 mains.

Megatron's build would otherwise hold bf16 params, fp32 grads and fp32 mains at
once (10 bytes per param, against 6 once streaming took the mains): that
build-time peak, not the steady state, caps the model size. Under
:func:`deferred_mains` each main is built storage-less, and the binding fills it
from its param as the store writes it, bucket by bucket.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from miles_plugins.optimizers.errors import StreamConfigError
from miles_plugins.optimizers.megatron.chain import check_upstream
from miles_plugins.optimizers.step.entries import Entry


class MainsWithoutStorage(TorchFunctionMode):
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
    if getattr(_deferring, "open_blocks", 0):
        with MainsWithoutStorage():
            return _upstream_build.__func__(cls, *args, **kwargs)
    return _upstream_build.__func__(cls, *args, **kwargs)


@contextlib.contextmanager
def deferred_mains() -> Iterator[None]:
    r"""Build ``DistributedOptimizer``\ s inside this without device memory for their
    fp32 mains; :class:`~miles_plugins.optimizers.megatron.binding.MegatronBinding`
    (``setup_optimizer_state_streaming``) must then stream every one of them before
    anything steps or saves them::

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
    _deferring.open_blocks = getattr(_deferring, "open_blocks", 0) + 1
    try:
        yield
    finally:
        _deferring.open_blocks -= 1
        with _deferred_lock:
            _deferred_blocks -= 1
            if _deferred_blocks == 0:
                DistributedOptimizer._build_model_and_main_param_groups = _upstream_build
                _upstream_build = None


def mains_deferred(entries: list[Entry]) -> bool:
    """Whether the mains were built by :func:`deferred_mains` (all of them, or none)."""
    deferred = [e.main.untyped_storage().nbytes() == 0 for e in entries if not e.resident and e.main.numel()]
    if any(deferred) and not all(deferred):
        raise StreamConfigError(
            f"{sum(deferred)} of the {len(deferred)} fp32 mains of this DistributedOptimizer have no storage: "
            "some were built under deferred_mains() and some not, or something released them; build the "
            "whole optimizer inside one deferred_mains() block (or none)"
        )
    return any(deferred)


def main_from_param(param: torch.Tensor, main: torch.Tensor) -> None:
    """Fill a deferred main: the value Megatron's build gives it (``shard_model_param.clone().float()``), exactly."""
    main.copy_(param)
