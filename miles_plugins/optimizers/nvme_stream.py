"""The entry point miles (or any Megatron launcher) calls at optimizer build.

::

    from miles_plugins.optimizers.nvme_stream import add_arguments, build_without_mains, setup_optimizer_state_streaming

    add_arguments(parser)                                # the streaming flags, where the launcher builds its parser
    with build_without_mains(args):                      # optional: no fp32 mains on the device at build
        optimizer = get_megatron_optimizer(config, model_chunks)
    setup_optimizer_state_streaming(args, optimizer)     # before load_checkpoint

Without ``build_without_mains`` Megatron's build allocates every fp32 main on
the device (4 bytes per param) before streaming takes them: the build then
needs 10 bytes per param (bf16 params, fp32 grads, fp32 mains) against 6 once
streaming runs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from typing import Any

from miles_plugins.optimizers.config import StreamConfig
from miles_plugins.optimizers.homes import scratch_purge
from miles_plugins.optimizers.megatron.args import STREAM_FLAG, add_arguments, config_from_args, validate_args
from miles_plugins.optimizers.megatron.binding import MegatronBinding, attach
from miles_plugins.optimizers.megatron.deferred_mains import deferred_mains

logger = logging.getLogger(__name__)

# What a launcher calls, from this one stable path (the modules behind it may move).
__all__ = ["add_arguments", "build_without_mains", "setup_optimizer_state_streaming", "stream_optimizer_state"]


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# Distributed optimizers this process streams through setup_optimizer_state_streaming
# (the launcher reads it: a script that calls it itself has streamed).
streamed_optimizers = 0


def build_without_mains(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    r"""Wrap the optimizer's build in this when ``args`` may stream: with
    ``--stream-optimizer-state-to-disk`` on, the ``DistributedOptimizer``\ s built
    inside get no device memory for their fp32 mains (``megatron.deferred_mains``),
    and :func:`setup_optimizer_state_streaming` must then run on the result before
    anything else uses it. With streaming off it changes nothing. The settings are
    validated first (``args.validate_args``): what streaming refuses (fp8 params, the
    CPU offload, ...) is refused before a build it would have left without mains."""
    if not getattr(args, STREAM_FLAG, False):
        return contextlib.nullcontext()
    validate_args(args)
    return deferred_mains()


def setup_optimizer_state_streaming(args: argparse.Namespace, optimizer: Any) -> list[MegatronBinding]:
    """Turn streaming on for ``optimizer`` when ``args`` asks for it.

    With ``--stream-optimizer-state-to-disk`` off this does nothing (but warn about
    streaming settings given without it) and returns ``[]``. Otherwise it validates ``args`` (:func:`args.validate_args`: every
    unsupported setting refused at once, with its reason) and streams the state
    of every ``DistributedOptimizer`` in the chain under
    ``<--offload-train-disk-dir>/optimizer_state/rank<global rank>.opt<i>``.
    """
    validate_args(args)  # off: warns about streaming settings given without the switch
    if not getattr(args, STREAM_FLAG, False):
        return []
    name = f"rank{_global_rank()}"
    for directory in args.offload_train_disk_dir.split(","):  # one per drive
        _purge_previous_layout(directory.strip(), name)
    bindings = stream_optimizer_state(optimizer, config_from_args(args, name=name))
    global streamed_optimizers
    streamed_optimizers += len(bindings)
    return bindings


def _purge_previous_layout(directory: str, name: str) -> None:
    """Versions before the ``optimizer_state/`` subdirectory kept each rank's scratch
    directly in ``--offload-train-disk-dir``: remove what a killed run of this rank
    left there (unheld, marked and owned only, as the purge command does)."""
    if not os.path.isdir(directory) or os.path.islink(directory):
        return
    try:
        removed, _ = scratch_purge.purge(directory, prefix=f"{name}.")
    except OSError as exc:
        logger.warning("could not check %s for scratch of an earlier version: %s", directory, exc)
        return
    for line in removed:
        logger.warning("scratch of an earlier version (before the optimizer_state/ subdirectory): %s", line)


def stream_optimizer_state(optimizer: Any, config: StreamConfig) -> list[MegatronBinding]:
    """Stream the state of every ``DistributedOptimizer`` in ``optimizer``'s chain.

    The form for callers without an argparse namespace: ``config`` carries
    every setting (directory, tier, engine, formats, bucket cap, ...). ``config.name`` is the per-process prefix of the scratch
    subdirectories; make it unique per rank (e.g. ``rank<global rank>``).
    Returns one binding per streamed optimizer, in chain order.
    """
    bindings = attach(optimizer, config)
    if not bindings:
        logger.warning("optimizer-state streaming is on but the optimizer chain holds no params on this rank")
    for binding in bindings:
        store = binding.store
        kept = sum(b.materialized_bytes for b in store.buckets if store.placed.homes[b.index] == "gpu")
        logger.info(
            "optimizer-state streaming on for %s: %d buckets, %.2f GB of state off the GPU%s, under %s",
            store.config.name,
            len(store.buckets),
            (store.state_bytes_total - kept) / 1e9,
            f" ({kept / 1e9:.2f} GB, {store.home_bytes['gpu'] / 1e9:.2f} GB stored, kept there by the GPU budget)"
            if kept
            else "",
            store.location,
        )
    return bindings
