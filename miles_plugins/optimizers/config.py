"""Settings for optimizer-state streaming, checked when they are built."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# On-disk dtypes for the Adam moments. Mains are always stored as fp32: they are
# the optimizer's source of truth and must round-trip exactly.
MOMENT_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8e4m3": torch.float8_e4m3fn,
    "fp8e5m2": torch.float8_e5m2,
}

# fp8 and fp16 have too little range for exp_avg_sq (squared gradients span many
# decades, far below fp16's 6e-8 smallest subnormal) unless it is scaled, which
# this store does not do: an underflowed exp_avg_sq turns the update into m / eps.
UNSAFE_MOMENT_DTYPES = frozenset({"fp16", "fp8e4m3", "fp8e5m2"})

# 200M elements per streaming bucket: 2.4 GB of fp32 state, large enough for
# efficient sequential I/O, small enough that a few in flight fit beside the model.
DEFAULT_BUCKET_CAP_ELEMENTS = 200_000_000

# The staging buffer bounds host memory: every transfer goes through it in chunks.
DEFAULT_STAGING_CHUNK_MB = 64

# Params whose model dtype is already fp32 keep their state resident (their main
# *is* the model param). Above this many elements that residency is worth a warning.
DEFAULT_RESIDENT_WARN_ELEMENTS = 16_000_000


class StreamConfigError(ValueError):
    """A streaming setting that cannot work; the message says which and why."""


@dataclass(frozen=True)
class StreamConfig:
    """What to stream, where, and in which format.

    Args:
        directory: where the per-process scratch directory is created. Must be
            creatable and writable; node-local NVMe is the intended place.
        moment_dtype: storage dtype of the Adam moments, one of
            ``MOMENT_DTYPES`` (``fp32`` is bit-exact; the others are a storage
            format only, the step still computes in fp32).
        bucket_cap_elements: the most elements in one streaming bucket. A single
            param larger than the cap gets a bucket of its own.
        staging_chunk_mb: size of the host staging buffer every transfer goes
            through; host memory used for streaming is bounded by it.
        allow_fresh_state: when a checkpoint being loaded holds no streamed
            state, start the optimizer fresh instead of refusing.
        resident_warn_elements: warn when fp32-native params (kept resident)
            exceed this many elements.
        name: this process's scratch subdirectory under ``directory``; stable
            across restarts of the same rank so stale scratch gets purged.
    """

    directory: str
    moment_dtype: str = "fp32"
    bucket_cap_elements: int = DEFAULT_BUCKET_CAP_ELEMENTS
    staging_chunk_mb: int = DEFAULT_STAGING_CHUNK_MB
    allow_fresh_state: bool = False
    resident_warn_elements: int = DEFAULT_RESIDENT_WARN_ELEMENTS
    name: str = "rank0"

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory:
            raise StreamConfigError(
                f"directory must be a non-empty path, got {self.directory!r}; "
                "point it at node-local NVMe, e.g. /scratch/optimizer_state"
            )
        if self.moment_dtype not in MOMENT_DTYPES:
            raise StreamConfigError(
                f"unknown moment dtype {self.moment_dtype!r}; choose one of {', '.join(MOMENT_DTYPES)}"
            )
        if isinstance(self.bucket_cap_elements, bool) or not isinstance(self.bucket_cap_elements, int):
            raise StreamConfigError(f"bucket cap must be an integer element count, got {self.bucket_cap_elements!r}")
        if self.bucket_cap_elements <= 0:
            raise StreamConfigError(
                f"bucket cap must be > 0 elements, got {self.bucket_cap_elements}; "
                f"the default is {DEFAULT_BUCKET_CAP_ELEMENTS}"
            )
        if (
            isinstance(self.staging_chunk_mb, bool)
            or not isinstance(self.staging_chunk_mb, int)
            or self.staging_chunk_mb <= 0
        ):
            raise StreamConfigError(f"staging chunk must be a positive number of MiB, got {self.staging_chunk_mb!r}")
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise StreamConfigError(f"scratch name must be a single path component, got {self.name!r}")
        if self.moment_dtype in UNSAFE_MOMENT_DTYPES:
            logger.warning(
                "moment dtype %s is not safe for exp_avg_sq without scaling: squared "
                "gradients underflow or saturate its range; expect divergence. "
                "Use bf16 for a compact format.",
                self.moment_dtype,
            )

    @property
    def moment_torch_dtype(self) -> torch.dtype:
        return MOMENT_DTYPES[self.moment_dtype]

    @property
    def staging_bytes(self) -> int:
        return self.staging_chunk_mb * 1024 * 1024
