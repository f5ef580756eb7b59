"""Command-line flags for Megatron/miles-style launchers.

``add_arguments(parser)`` adds the streaming flags; ``validate_args(args)``
refuses, when streaming is on, exactly the settings it cannot work with (the
table in ``refusals.py``, and the settings themselves as ``StreamConfig``
checks them), each with its reason, and fills in the default directory. With
streaming off it changes nothing. Fields a given Megatron or miles lacks are
read with their defaults, so the same code serves every launcher version.
"""

from __future__ import annotations

import argparse
import math
import os
import warnings
from typing import Any

from miles_plugins.optimizers.config import (
    AUTO,
    DEFAULT_AUTO_GPU_MARGIN_BYTES,
    DEFAULT_AUTO_HOST_MARGIN_BYTES,
    DEFAULT_BUCKET_CAP_ELEMENTS,
    DEFAULT_BUCKETS_IN_FLIGHT,
    DEFAULT_IO_THREADS,
    DEFAULT_IO_TIMEOUT_S,
    DEFAULT_STAGING_BUDGET_MB,
    ENGINES,
    FP32_PARAM_MOMENTS,
    MAIN_STORAGES,
    MOMENT_DTYPES,
    TIERS,
    AutoBudget,
    StreamConfig,
)
from miles_plugins.optimizers.errors import StreamConfigError
from miles_plugins.optimizers.homes import scratch
from miles_plugins.optimizers.megatron.refusals import refusals_of_args

STREAM_FLAG = "stream_optimizer_state_to_disk"
MOMENT_FLAG = "--stream-optimizer-state-moment-dtype"
OFFERED_MOMENT_DTYPES = "_stream_optimizer_state_moment_dtypes_offered"
# The default --offload-train-disk-dir is miles' own ($SCRATCH/miles_train_offload_<uid>):
# one directory per node-local disk for both of miles' disk mechanisms, each in its
# own subdirectory. The streamed state's is STATE_SUBDIR, with a scratch per rank in it.
DEFAULT_DIR_NAME = "miles_train_offload"
STATE_SUBDIR = scratch.STATE_SUBDIR


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the streaming flags the parser lacks. A launcher that defines some of
    them itself (miles defines ``--stream-optimizer-state-to-disk``, the moment
    dtype and both ``--offload-train-disk-*`` flags) keeps its own definitions:
    their types, defaults, choices and help stay as it wrote them."""
    missing = [(flag, kwargs) for flag, kwargs in _FLAGS if flag not in parser._option_string_actions]
    if missing:
        group = parser.add_argument_group("optimizer-state streaming")
        for flag, kwargs in missing:
            group.add_argument(flag, **kwargs)
    # Which moment dtypes this parser offers (miles' lacks 8bit): a refusal then
    # advises only what the user can ask for. A default, not a flag: nothing of miles' changes.
    offered = parser._option_string_actions[MOMENT_FLAG].choices
    parser.set_defaults(**{OFFERED_MOMENT_DTYPES: tuple(offered) if offered else None})
    return parser


def _gib_flag(flag: str, default: float, help: str, auto: bool = True) -> tuple[str, dict[str, Any]]:
    """A flag taking GiB (and, with ``auto``, the word ``auto``)."""
    return flag, dict(type=lambda text: _gib(text, flag, auto), default=default, help=help)


def _gib(text: str, flag: str, auto: bool = True) -> float | AutoBudget:
    """A budget flag's value: GiB (2**30 bytes), fractions allowed, 0 or more; or ``auto``."""
    if auto and text == AutoBudget.WORD:
        return AUTO
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        also = f" or {AUTO}" if auto else ""
        raise argparse.ArgumentTypeError(f"{flag} takes a number of GiB, 0 or more (e.g. 2.5){also}, got {text!r}")
    return value


_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "--stream-optimizer-state-to-disk",
        dict(
            action="store_true",
            help="keep fp32 mains and Adam moments in per-bucket files and stream them through optimizer.step()",
        ),
    ),
    (
        "--stream-optimizer-state-moment-dtype",
        dict(
            choices=list(MOMENT_DTYPES),
            default="fp32",
            help="storage dtype of the Adam moments (fp32 is bit-exact; bf16 halves their bytes; "
            "8bit quarters them, scaled per block of 256)",
        ),
    ),
    (
        "--stream-optimizer-state-tier",
        dict(
            choices=list(TIERS),
            default="disk",
            help="where the state lives between steps: per-bucket files (disk) or pinned host memory (host)",
        ),
    ),
    _gib_flag(
        "--stream-optimizer-state-gpu-budget-gb",
        0.0,
        "GiB (2^30 bytes) of GPU memory per rank for buckets kept on the GPU between steps (no "
        "transfer); filled first; shared by the rank's optimizers in turn (dense, then expert). 'auto': "
        "after the first step, what the largest peak so far left, less --stream-optimizer-state-auto-gpu-margin-gb; "
        "buckets go back to host or disk when a later peak leaves less than that margin",
    ),
    _gib_flag(
        "--stream-optimizer-state-host-budget-gb",
        0.0,
        "GiB (2^30 bytes) of pinned host memory per rank for buckets the GPU budget leaves, shared "
        "like it; the rest go to the tier. A step that fails after updating a bucket in host or GPU memory "
        "cannot be rolled back. 'auto': at setup, MemAvailable or the room under the cgroup's memory limit, less "
        "--stream-optimizer-state-auto-host-margin-gb, divided by this node's ranks",
    ),
    _gib_flag(
        "--stream-optimizer-state-auto-gpu-margin-gb",
        DEFAULT_AUTO_GPU_MARGIN_BYTES / 2**30,
        "GiB an 'auto' GPU budget leaves free for the forward/backward peak to grow into between two steps",
        auto=False,
    ),
    _gib_flag(
        "--stream-optimizer-state-auto-host-margin-gb",
        DEFAULT_AUTO_HOST_MARGIN_BYTES / 2**30,
        "GiB of the node's host memory an 'auto' host budget leaves to everything else",
        auto=False,
    ),
    _gib_flag(
        "--stream-optimizer-state-overlap-gb",
        0.0,
        "GiB of GPU memory per rank the state may hold across the step boundary, so its transfers run "
        "during forward and backward: the step's last buckets are written back during the next forward, then "
        "the next step's first buckets are read (0: every transfer inside optimizer.step()); not with an "
        "'auto' GPU budget",
        auto=False,
    ),
    (
        "--stream-optimizer-state-engine",
        dict(
            choices=list(ENGINES),
            default="pipelined",
            help="pipelined (overlapped reads/compute/writes, direct I/O) or sync (one bucket at a time; a baseline)",
        ),
    ),
    (
        "--stream-optimizer-state-main-storage",
        dict(
            choices=list(MAIN_STORAGES),
            default="fp32",
            help="fp32 mains, or remainder: 16 bits beside the bf16 param, still bit-exact (bf16 params only)",
        ),
    ),
    (
        "--stream-optimizer-state-fp32-param-moments",
        dict(
            choices=list(FP32_PARAM_MOMENTS),
            default="streamed",
            help="the moments of fp32 params (their own mains, which stay in the model): streamed in buckets of "
            "their own, or resident beside them; a checkpoint loads only under the setting it was saved with",
        ),
    ),
    (
        "--stream-optimizer-state-buckets-in-flight",
        dict(
            type=int,
            default=DEFAULT_BUCKETS_IN_FLIGHT,
            help="buckets on the GPU at once (pipelined): GPU memory traded for overlap",
        ),
    ),
    (
        "--stream-optimizer-state-io-threads",
        dict(type=int, default=DEFAULT_IO_THREADS, help="requests in flight per direction (pipelined)"),
    ),
    (
        "--stream-optimizer-state-bucket-cap",
        dict(type=int, default=DEFAULT_BUCKET_CAP_ELEMENTS, help="most elements in one streaming bucket"),
    ),
    (
        "--stream-optimizer-state-io-timeout",
        dict(
            type=float,
            default=DEFAULT_IO_TIMEOUT_S,
            help="seconds a bucket's transfers may take before the step fails (a hung drive; pipelined)",
        ),
    ),
    (
        "--no-stream-optimizer-state-direct-io",
        dict(
            dest="stream_optimizer_state_direct_io",
            action="store_false",
            help="use buffered I/O for the bucket files even where O_DIRECT works",
        ),
    ),
    # Shared with miles' disk offload of the training actor (each under its own subdirectory).
    (
        "--offload-train-disk-dir",
        dict(
            default=None,
            help="node-local directory for offloaded and streamed state; the streamed state goes in its "
            f"{STATE_SUBDIR}/ subdirectory (default: $SCRATCH/miles_train_offload_<uid>, /scratch when "
            "SCRATCH is unset); several, comma-separated (one per drive), spread the streamed state over them",
        ),
    ),
    (
        "--offload-train-disk-chunk-mb",
        dict(
            type=int,
            default=DEFAULT_STAGING_BUDGET_MB,
            help="host staging memory for disk transfers, MiB, in all: the pinned buffer that bounds "
            "streaming's host memory, split among the I/O threads",
        ),
    ),
)


def default_directory() -> str:
    """miles' default --offload-train-disk-dir."""
    return os.path.join(os.environ.get("SCRATCH") or "/scratch", f"{DEFAULT_DIR_NAME}_{os.getuid()}")


def _get(args: argparse.Namespace, name: str, default=None):
    return getattr(args, name, default)


def validate_args(args: argparse.Namespace) -> None:
    """Refuse settings streaming cannot work with, all at once, its own settings
    (moment dtype, staging budget, ...) included; fill the default directory.

    When ``--stream-optimizer-state-to-disk`` is off it changes nothing, and warns
    about streaming settings given without it.
    """
    if not _get(args, STREAM_FLAG, False):
        if changed := _streaming_settings_given(args):
            warnings.warn(
                f"{', '.join(changed)} given, but --stream-optimizer-state-to-disk is off: nothing streams",
                stacklevel=2,
            )
        return
    reasons = refusals_of_args(args)
    given_dir = _get(args, "offload_train_disk_dir")
    if given_dir is not None and not str(given_dir).strip():
        reasons.append(
            "--offload-train-disk-dir is empty (an unset variable?): name the node-local NVMe directory, "
            f"or leave the flag out for the default ({default_directory()})"
        )
    elif not given_dir:
        args.offload_train_disk_dir = default_directory()
    try:  # the settings themselves (moment dtype, staging budget, ...), as the store will check them
        config_from_args(args, name="rank0")
    except StreamConfigError as exc:
        flags = [flag for setting, flag in _SETTING_FLAGS.items() if str(exc).startswith(setting)]
        reason = f"{flags[0]}: {exc}" if flags else str(exc)
        offered = _get(args, OFFERED_MOMENT_DTYPES)
        if flags == [MOMENT_FLAG] and offered and "8bit" not in offered:
            reason += f" (this launcher's {MOMENT_FLAG} offers {', '.join(offered)}: of those, bf16)"
        reasons.append(reason)
    if reasons:
        raise StreamConfigError("--stream-optimizer-state-to-disk cannot be used with:\n  - " + "\n  - ".join(reasons))


def _streaming_settings_given(args: argparse.Namespace) -> list[str]:
    """This module's --stream-optimizer-state-* flags that differ from their defaults."""
    return [
        flag
        for flag, kwargs in _FLAGS
        if flag.startswith("--stream-optimizer-state-")
        and flag != "--stream-optimizer-state-to-disk"
        and _get(args, flag[2:].replace("-", "_"), kwargs.get("default")) != kwargs.get("default")
    ]


# How StreamConfig's messages begin -> the flag that sets it (its messages name settings, not flags).
_SETTING_FLAGS = {
    "staging budget": "--offload-train-disk-chunk-mb",
    "io threads": "--stream-optimizer-state-io-threads",
    "buckets in flight": "--stream-optimizer-state-buckets-in-flight",
    "bucket cap": "--stream-optimizer-state-bucket-cap",
    "io timeout": "--stream-optimizer-state-io-timeout",
    "directory": "--offload-train-disk-dir",
    "gpu budget bytes": "--stream-optimizer-state-gpu-budget-gb",
    "host budget bytes": "--stream-optimizer-state-host-budget-gb",
    "auto gpu margin bytes": "--stream-optimizer-state-auto-gpu-margin-gb",
    "auto host margin bytes": "--stream-optimizer-state-auto-host-margin-gb",
    "overlap bytes": "--stream-optimizer-state-overlap-gb",
    "moment dtype": MOMENT_FLAG,
    "unknown moment dtype": MOMENT_FLAG,
}


def config_from_args(args: argparse.Namespace, name: str) -> StreamConfig:
    """The :class:`StreamConfig` an argparse namespace asks for (after :func:`validate_args`).

    ``name`` is this process's scratch subdirectory (e.g. ``rank3``).
    """
    disk_dirs = (_get(args, "offload_train_disk_dir") or default_directory()).split(",")
    return StreamConfig(
        # Several directories (one per drive): the state goes in each one's subdirectory.
        directory=",".join(os.path.join(d.strip(), STATE_SUBDIR) if d.strip() else "" for d in disk_dirs),
        moment_dtype=_get(args, "stream_optimizer_state_moment_dtype", "fp32"),
        bucket_cap_elements=_get(args, "stream_optimizer_state_bucket_cap", DEFAULT_BUCKET_CAP_ELEMENTS),
        staging_budget_mb=_get(args, "offload_train_disk_chunk_mb", DEFAULT_STAGING_BUDGET_MB),
        name=name,
        tier=_get(args, "stream_optimizer_state_tier", "disk"),
        engine=_get(args, "stream_optimizer_state_engine", "pipelined"),
        buckets_in_flight=_get(args, "stream_optimizer_state_buckets_in_flight", DEFAULT_BUCKETS_IN_FLIGHT),
        io_threads=_get(args, "stream_optimizer_state_io_threads", DEFAULT_IO_THREADS),
        direct_io=_get(args, "stream_optimizer_state_direct_io", True),
        main_storage=_get(args, "stream_optimizer_state_main_storage", "fp32"),
        fp32_param_moments=_get(args, "stream_optimizer_state_fp32_param_moments", "streamed"),
        io_timeout_s=_get(args, "stream_optimizer_state_io_timeout", DEFAULT_IO_TIMEOUT_S),
        gpu_budget_bytes=_bytes_of_gib(_get(args, "stream_optimizer_state_gpu_budget_gb", 0.0)),
        host_budget_bytes=_bytes_of_gib(_get(args, "stream_optimizer_state_host_budget_gb", 0.0)),
        auto_gpu_margin_bytes=_bytes_of_gib(
            _get(args, "stream_optimizer_state_auto_gpu_margin_gb", DEFAULT_AUTO_GPU_MARGIN_BYTES / 2**30)
        ),
        auto_host_margin_bytes=_bytes_of_gib(
            _get(args, "stream_optimizer_state_auto_host_margin_gb", DEFAULT_AUTO_HOST_MARGIN_BYTES / 2**30)
        ),
        overlap_bytes=_bytes_of_gib(_get(args, "stream_optimizer_state_overlap_gb", 0.0)),
    )


def _bytes_of_gib(value):
    """Whole bytes of a GiB figure; anything else is passed on for StreamConfig to refuse."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return int(value * 2**30)
    return value
