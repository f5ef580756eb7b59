"""Command-line flags for Megatron/miles-style launchers, and their validation.

``add_arguments(parser)`` adds the streaming flags; ``validate_args(args)``
refuses, when streaming is on, exactly the settings it cannot work with, each
with its reason, and fills in the default directory. With streaming off it
changes nothing. Fields a given Megatron or miles lacks are read with their
defaults, so the same code serves every launcher version.
"""

from __future__ import annotations

import argparse
import os

from miles_plugins.optimizers.config import (
    DEFAULT_BUCKET_CAP_ELEMENTS,
    DEFAULT_BUCKETS_IN_FLIGHT,
    DEFAULT_IO_THREADS,
    DEFAULT_IO_TIMEOUT_S,
    DEFAULT_STAGING_CHUNK_MB,
    ENGINES,
    MAIN_STORAGES,
    MOMENT_DTYPES,
    TIERS,
    StreamConfig,
    StreamConfigError,
)

STREAM_FLAG = "stream_optimizer_state_to_disk"
DEFAULT_DIR_NAME = "optimizer_state"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the streaming flags. The disk-offload directory flags are shared with
    miles' disk offload: where the parser already has them, they are left as they are."""
    group = parser.add_argument_group("optimizer-state streaming")
    group.add_argument(
        "--stream-optimizer-state-to-disk",
        action="store_true",
        help="keep fp32 mains and Adam moments in per-bucket files and stream them through optimizer.step()",
    )
    group.add_argument(
        "--stream-optimizer-state-moment-dtype",
        choices=list(MOMENT_DTYPES),
        default="fp32",
        help="storage dtype of the Adam moments (fp32 is bit-exact; bf16 halves their bytes)",
    )
    group.add_argument(
        "--stream-optimizer-state-tier",
        choices=list(TIERS),
        default="disk",
        help="where the state lives between steps: per-bucket files (disk) or pinned host memory (host)",
    )
    group.add_argument(
        "--stream-optimizer-state-engine",
        choices=list(ENGINES),
        default="pipelined",
        help="pipelined (overlapped reads/compute/writes, direct I/O) or sync (one bucket at a time; a baseline)",
    )
    group.add_argument(
        "--stream-optimizer-state-main-storage",
        choices=list(MAIN_STORAGES),
        default="fp32",
        help="fp32 mains, or remainder: 16 bits beside the bf16 param, still bit-exact (bf16 params only)",
    )
    group.add_argument(
        "--stream-optimizer-state-buckets-in-flight",
        type=int,
        default=DEFAULT_BUCKETS_IN_FLIGHT,
        help="buckets on the GPU at once (pipelined): GPU memory traded for overlap",
    )
    group.add_argument(
        "--stream-optimizer-state-io-threads",
        type=int,
        default=DEFAULT_IO_THREADS,
        help="requests in flight per direction (pipelined)",
    )
    group.add_argument(
        "--stream-optimizer-state-bucket-cap",
        type=int,
        default=DEFAULT_BUCKET_CAP_ELEMENTS,
        help="most elements in one streaming bucket",
    )
    group.add_argument(
        "--stream-optimizer-state-io-timeout",
        type=float,
        default=DEFAULT_IO_TIMEOUT_S,
        help="seconds a bucket's transfers may take before the step fails (a hung drive; pipelined)",
    )
    group.add_argument(
        "--no-stream-optimizer-state-direct-io",
        dest="stream_optimizer_state_direct_io",
        action="store_false",
        help="use buffered I/O for the bucket files even where O_DIRECT works",
    )
    shared = [
        (
            "--offload-train-disk-dir",
            dict(
                default=None,
                help="node-local directory for offloaded and streamed state "
                "(default: $SCRATCH/optimizer_state_<uid>, /scratch when SCRATCH is unset)",
            ),
        ),
        (
            "--offload-train-disk-chunk-mb",
            dict(type=int, default=DEFAULT_STAGING_CHUNK_MB, help="host staging chunk for disk transfers, MiB"),
        ),
    ]
    for flag, kwargs in shared:
        try:
            group.add_argument(flag, **kwargs)
        except argparse.ArgumentError:
            pass  # the launcher already defines this shared flag
    return parser


def default_directory() -> str:
    return os.path.join(os.environ.get("SCRATCH") or "/scratch", f"{DEFAULT_DIR_NAME}_{os.getuid()}")


def _get(args: argparse.Namespace, name: str, default=None):
    return getattr(args, name, default)


# (predicate over args, why it cannot work with streaming); each refusal names its flag.
_REFUSALS = [
    (
        lambda a: not _get(a, "use_distributed_optimizer", False),
        "--use-distributed-optimizer is off: streaming binds to Megatron's DistributedOptimizer, "
        "whose fp32 main shards it streams",
    ),
    (
        lambda a: (_get(a, "optimizer", "adam") or "adam") != "adam",
        "--optimizer is {optimizer!r}: the per-bucket step reproduces Adam's math only",
    ),
    (
        lambda a: (_get(a, "lora_rank", 0) or 0) > 0 or _get(a, "lora_adapter_path") or _get(a, "multi_lora", False),
        "LoRA / multi-LoRA is on: its checkpoint path bypasses the hooks that save the streamed state",
    ),
    (
        lambda a: _get(a, "optimizer_cpu_offload", False),
        "--optimizer-cpu-offload is on: the state would be offloaded twice; use one or the other",
    ),
    (
        lambda a: _get(a, "offload_optimizer_states", False),
        "--offload-optimizer-states is on: it moves the same state between phases; streaming already "
        "keeps it off the GPU",
    ),
    (
        lambda a: _get(a, "use_precision_aware_optimizer", False),
        "--use-precision-aware-optimizer is on: streaming needs Megatron to hold fp32 mains, which it then does not",
    ),
    (
        lambda a: _get(a, "reset_optimizer_states", False),
        "--reset-optimizer-states is on: it resets the (evicted) in-memory state and would silently do "
        "nothing to the streamed state",
    ),
    (
        lambda a: _get(a, "save_local_weight_checksum", False),
        "--save-local-weight-checksum is on: it reads optimizer tensors whose storage is evicted",
    ),
    (
        lambda a: _get(a, "enable_witness", False),
        "--enable-witness is on: it reads optimizer tensors whose storage is evicted",
    ),
    (
        lambda a: _get(a, "log_params_norm", False),
        "--log-params-norm is on: it reads every param's fp32 main (param.main_param) at once, whose "
        "storage streaming evicts",
    ),
    (
        lambda a: _get(a, "non_persistent_ckpt_type") == "local",
        "--non-persistent-ckpt-type is 'local': local checkpoints bypass the directory the hooks save the "
        "streamed state into; use 'global'",
    ),
    (
        lambda a: _get(a, "indep_dp", False),
        "--indep-dp is on: rank numbering restarts per cell, so streaming directories of different "
        "processes would collide",
    ),
    (
        lambda a: _get(a, "stream_optimizer_state_main_storage") == "remainder" and not _get(a, "bf16", False),
        "--stream-optimizer-state-main-storage is 'remainder' without --bf16: the remainder rebuilds an fp32 "
        "main from its bf16 param; use fp32 main storage",
    ),
    (
        lambda a: _get(a, "offload_train", False) and _get(a, "offload_train_target") != "disk",
        "--offload-train targets {offload_train_target!r}: with streaming, training offload must target "
        "disk (--offload-train-target disk)",
    ),
]


def validate_args(args: argparse.Namespace) -> None:
    """Refuse settings streaming cannot work with (all at once); fill the default directory.

    Does nothing when ``--stream-optimizer-state-to-disk`` is off.
    """
    if not _get(args, STREAM_FLAG, False):
        return
    reasons = [
        why.format(optimizer=_get(args, "optimizer"), offload_train_target=_get(args, "offload_train_target"))
        for refuses, why in _REFUSALS
        if refuses(args)
    ]
    chunk = _get(args, "offload_train_disk_chunk_mb", DEFAULT_STAGING_CHUNK_MB)
    if not isinstance(chunk, int) or chunk <= 0:
        reasons.append(f"--offload-train-disk-chunk-mb is {chunk!r}: it must be a positive number of MiB")
    if reasons:
        raise StreamConfigError("--stream-optimizer-state-to-disk cannot be used with:\n  - " + "\n  - ".join(reasons))
    if not _get(args, "offload_train_disk_dir"):
        args.offload_train_disk_dir = default_directory()


def config_from_args(args: argparse.Namespace, name: str) -> StreamConfig:
    """The :class:`StreamConfig` an argparse namespace asks for (after :func:`validate_args`).

    ``name`` is this process's scratch subdirectory (e.g. ``rank3``). With
    ``--no-load-optim`` a checkpoint without streamed state starts the optimizer
    fresh instead of being refused.
    """
    return StreamConfig(
        directory=_get(args, "offload_train_disk_dir") or default_directory(),
        moment_dtype=_get(args, "stream_optimizer_state_moment_dtype", "fp32"),
        bucket_cap_elements=_get(args, "stream_optimizer_state_bucket_cap", DEFAULT_BUCKET_CAP_ELEMENTS),
        staging_chunk_mb=_get(args, "offload_train_disk_chunk_mb", DEFAULT_STAGING_CHUNK_MB),
        allow_fresh_state=bool(_get(args, "no_load_optim", False)),
        name=name,
        tier=_get(args, "stream_optimizer_state_tier", "disk"),
        engine=_get(args, "stream_optimizer_state_engine", "pipelined"),
        buckets_in_flight=_get(args, "stream_optimizer_state_buckets_in_flight", DEFAULT_BUCKETS_IN_FLIGHT),
        io_threads=_get(args, "stream_optimizer_state_io_threads", DEFAULT_IO_THREADS),
        direct_io=_get(args, "stream_optimizer_state_direct_io", True),
        main_storage=_get(args, "stream_optimizer_state_main_storage", "fp32"),
        io_timeout_s=_get(args, "stream_optimizer_state_io_timeout", DEFAULT_IO_TIMEOUT_S),
    )
