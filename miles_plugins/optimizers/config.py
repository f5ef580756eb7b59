"""Settings for optimizer-state streaming, checked when they are built."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from miles_plugins.optimizers.errors import StreamConfigError
from miles_plugins.optimizers.formats.layout import ALIGNMENT as DIRECT_IO_ALIGNMENT

# Storage dtypes for the Adam moments (they always compute in fp32). Mains are
# stored as fp32 or as remainders (MAIN_STORAGES): they must round-trip exactly.
# "8bit" is one byte per element plus a scale per block (``quant8.py``).
MOMENT_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "8bit": torch.uint8,
}
# Moment dtypes stored blockwise (codes and per-block scales), not element by element.
BLOCKWISE_MOMENT_DTYPES = frozenset({"8bit"})

# Moment dtypes earlier versions offered, and why they are gone: unscaled, they
# cannot hold exp_avg_sq (squared gradients span many decades: they underflow
# fp16's 6e-8 and fp8's range, and the update becomes m / eps; docs/pytorch.md).
# A checkpoint that stored one is refused on load with this reason.
REMOVED_MOMENT_DTYPES: dict[str, str] = {
    name: "unscaled, it cannot hold exp_avg_sq (squared gradients underflow its range) and training diverges"
    for name in ("fp16", "fp8e4m3", "fp8e5m2")
}

# ``tier``: the home of every bucket the budgets do not place, files (node-local NVMe) or pinned host memory.
TIERS = ("disk", "host")

# A bucket's home between steps, in the order buckets fill them: the memory of
# the device the mains live on (``gpu``: no transfer over PCIe or to a drive; the
# CPU's where the mains are on the CPU), pinned host memory (``host``), files (``disk``).
HOMES = ("gpu", "host", "disk")


class AutoBudget:
    """A budget that measures itself (``auto_budget.py``): the host's at setup, the
    GPU's after the first step, when the forward/backward peak is known. Written
    ``"auto"`` (flags, ``StreamConfig``); :data:`AUTO` is the one instance."""

    WORD = "auto"

    def __repr__(self) -> str:
        return repr(self.WORD)

    def __str__(self) -> str:
        return self.WORD


AUTO = AutoBudget()
# The fields a budget may be AUTO in.
AUTO_BUDGET_FIELDS = ("gpu_budget_bytes", "host_budget_bytes")
# What auto leaves free: device memory for the forward/backward peak to grow
# into between two steps (a step gives buckets back when it grew), and host
# memory for everything else on the node (data loaders, page cache, other jobs).
DEFAULT_AUTO_GPU_MARGIN_BYTES = 4 << 30
DEFAULT_AUTO_HOST_MARGIN_BYTES = 16 << 30

# How buckets move: "pipelined" reads bucket i+1 and writes bucket i-1 while bucket
# i computes, with direct I/O and several requests in flight; "sync" is the simple
# design kept as a baseline (one bucket at a time, buffered I/O, one staging buffer).
ENGINES = ("pipelined", "sync")

# How the fp32 main is stored: "fp32" (4 bytes), or "remainder": the 16 low bits
# that, with the bf16 model param resident anyway, rebuild the fp32 main exactly.
MAIN_STORAGES = ("fp32", "remainder")

# 64M elements per streaming bucket: 768 MB of fp32 state on the device (a param is never
# split: a larger one gets a bucket of its own). I/O efficiency comes from the requests, not
# the bucket size; smaller buckets shorten the pipeline's fill and drain, which nothing overlaps.
DEFAULT_BUCKET_CAP_ELEMENTS = 64_000_000

# Buckets on the device at once: one computing, one being read, one being written.
DEFAULT_BUCKETS_IN_FLIGHT = 3

# Requests in flight per direction (reads and writes each have their own threads, so
# a drive that serves both at once gets both). Each thread owns one staging chunk.
DEFAULT_IO_THREADS = 4

# A request that takes longer than this is taken for a hung drive: the step fails instead
# of hanging forever (a request takes milliseconds; a drive stalled this long is not coming back).
DEFAULT_IO_TIMEOUT_S = 300.0

# Host staging memory for transfers, in all: the pipelined engine splits it into one
# chunk per I/O thread and direction (2 x io_threads chunks of 16 MiB by default);
# the sync engine uses it as its one chunk. A chunk is one transfer request.
DEFAULT_STAGING_BUDGET_MB = 128

# The request the split aims for: a budget (each directory's share, with several) too
# small to give every I/O thread chunks this large funds fewer threads, each with larger
# requests (fewer, larger requests keep an NVMe drive busier than many small ones).
STAGING_REQUEST_MB = 8

# The smallest request the split may make (a budget below two of them per directory is refused).
MIN_STAGING_CHUNK_MB = 2

# Params whose model dtype is already fp32 are their own mains: their moments are streamed
# ("streamed", 8 of their 12 bytes per element) or kept resident with them ("resident");
# resident above this many elements is worth a warning.
FP32_PARAM_MOMENTS = ("streamed", "resident")
DEFAULT_RESIDENT_WARN_ELEMENTS = 16_000_000


@dataclass(frozen=True)
class StreamConfig:
    """What to stream, where, and in which format.

    Args:
        directory: where the per-process scratch directory is created (disk
            home). Must be creatable and writable; node-local NVMe is the
            intended place. Several directories (a sequence, or one string with
            commas: ``"/nvme0/s,/nvme1/s"``) spread the disk buckets over them
            by free space, each with its own I/O threads and its share of the
            staging budget (nodes with several drives and no RAID).
        moment_dtype: storage dtype of the Adam moments, one of
            ``MOMENT_DTYPES``: ``fp32`` is bit-exact; ``bf16`` halves their
            bytes; ``8bit`` quarters them (blockwise scaled, ``quant8.py``).
            A storage format only: the step still computes in fp32.
        bucket_cap_elements: the most elements in one streaming bucket, except
            that a param is never split: one larger than the cap gets a bucket
            of its own. Buckets bound the optimizer state on the device
            (``buckets_in_flight`` of them at once): a cap other than the
            default so large that every bucket is in flight at once, where a
            lower one would split the state further, is warned about.
        staging_budget_mb: host staging memory for transfers, in all (pinned on
            CUDA), which bounds streaming's host memory (``staging_bytes_total``):
            the pipelined engine splits it into a chunk (one transfer request) per
            I/O thread and direction, of ``STAGING_REQUEST_MB`` or more (a smaller
            budget funds fewer threads; at least ``MIN_STAGING_CHUNK_MB``); the
            sync engine uses it whole as its one chunk.
        tier: the home of the buckets the budgets leave: ``"disk"`` (files under
            ``directory``) or ``"host"`` (pinned host memory).
        gpu_budget_bytes: device memory the stored state of buckets kept on the
            device may take (the ``gpu`` home: a step copies them device to
            device, no PCIe or drive). Buckets fill it first, from the last the
            step visits backwards (so the disk buckets' transfers overlap the
            others' updates), each taking its stored size, up to the first
            that does not fit.
        host_budget_bytes: pinned host memory for buckets the GPU budget did not
            take (the ``host`` home), filled next, the same way; the rest go to
            ``tier``. Each home is one run of buckets, every disk bucket before
            every in-memory one (an auto GPU budget's moves keep the disk home
            first; the gpu and host homes may then alternate). Placement never
            changes a result or a checkpoint.
            Either budget may be ``"auto"`` (``auto_budget.py``): the host's is
            measured at setup (available memory and the cgroup's limit, less
            ``auto_host_margin_bytes``, shared by this node's ranks); the GPU's
            after the first step: what the process may use, less what it needs
            besides the home (the largest peak of any step or phase so far) and
            ``auto_gpu_margin_bytes``; buckets then move to the device (disk
            ones first), and go back to where they were (host ones first)
            when less than the margin is left free.
        auto_gpu_margin_bytes, auto_host_margin_bytes: what ``"auto"`` leaves free.
        engine: ``"pipelined"`` (overlapped, direct I/O) or ``"sync"`` (the
            one-bucket-at-a-time baseline with buffered I/O).
        buckets_in_flight: pipelined engine: the most buckets materialized on
            the device at once (GPU memory traded for overlap); the optimizer
            state on the device stays below this many times the largest bucket.
        io_threads: pipelined engine: requests in flight per direction (files,
            and pinned host memory's copies during forward and backward; a
            step's own copies of pinned host memory are queued on copy streams).
        direct_io: pipelined engine on disk: open bucket files with ``O_DIRECT``
            (buffered I/O, with a log line, where the filesystem refuses it).
        main_storage: ``"fp32"`` or ``"remainder"`` (bf16 params only: 2 bytes
            per main instead of 4, still bit-exact).
        io_timeout_s: pipelined engine: the longest a bucket's transfers may take before the step fails.
        fp32_param_moments: the moments of params whose model dtype is fp32
            (their own mains, which stay in the model): ``"streamed"`` (in
            buckets of their own, last in the walk; updated in place, so a step
            that fails after updating one cannot be rolled back) or
            ``"resident"`` (with the params, under one small optimizer, in
            fp32 whatever ``moment_dtype``). A checkpoint loads only under the
            setting it was saved with (saves from before it: ``"resident"``).
        resident_warn_elements: warn when fp32-native params with resident moments exceed this many elements.
        name: this process's scratch subdirectory under ``directory``; stable
            across restarts of the same rank so stale scratch gets purged.
        overlap_bytes: pipelined engine: device memory the state may hold across
            the step boundary, so that its transfers run during forward and
            backward instead of inside the step (0, the default: every transfer
            inside ``optimizer.step()``). The step leaves its last buckets outside
            the gpu home that fit it encoded on the device, and their writes run
            from the caller's next :meth:`~StreamingStore.progress`; the next
            step's first buckets are read into the room their landing leaves.
            Both together never exceed it; the step's own bound grows by it.
            Not with an ``"auto"`` GPU budget (which sizes its home from the
            peaks this window would change).
        drive_ranks: processes of this node that share the state directories
            and set up at once (Megatron's ``attach`` counts the node's ranks):
            each plans its disk buckets with that share of the free space it
            measures, since they measure before any has reserved its files.
    """

    directory: str | tuple[str, ...] | list[str] = ""
    moment_dtype: str = "fp32"
    bucket_cap_elements: int = DEFAULT_BUCKET_CAP_ELEMENTS
    staging_budget_mb: int = DEFAULT_STAGING_BUDGET_MB
    resident_warn_elements: int = DEFAULT_RESIDENT_WARN_ELEMENTS
    name: str = "rank0"
    tier: str = "disk"
    engine: str = "pipelined"
    buckets_in_flight: int = DEFAULT_BUCKETS_IN_FLIGHT
    io_threads: int = DEFAULT_IO_THREADS
    direct_io: bool = True
    main_storage: str = "fp32"
    io_timeout_s: float = DEFAULT_IO_TIMEOUT_S
    gpu_budget_bytes: int | AutoBudget = 0
    host_budget_bytes: int | AutoBudget = 0
    auto_gpu_margin_bytes: int = DEFAULT_AUTO_GPU_MARGIN_BYTES
    auto_host_margin_bytes: int = DEFAULT_AUTO_HOST_MARGIN_BYTES
    fp32_param_moments: str = "streamed"
    overlap_bytes: int = 0
    drive_ranks: int = 1

    def __post_init__(self) -> None:
        for field in AUTO_BUDGET_FIELDS:  # "auto" as users and flags write it
            if isinstance(getattr(self, field), str) and getattr(self, field) == AutoBudget.WORD:
                object.__setattr__(self, field, AUTO)
        if isinstance(self.directory, list):  # frozen and hashable: keep a tuple
            object.__setattr__(self, "directory", tuple(self.directory))
        _check_directories(self)
        _check_moment_dtype(self.moment_dtype)
        _check_choices(self)
        _check_numbers(self)
        _check_name(self.name)
        _check_combinations(self)

    @property
    def directories(self) -> tuple[str, ...]:
        """The state directories ``directory`` names (empty parts kept, for the check above)."""
        if isinstance(self.directory, str):
            return tuple(part.strip() for part in self.directory.split(",")) if self.directory else ()
        if isinstance(self.directory, (tuple, list)) and all(isinstance(d, str) for d in self.directory):
            return tuple(self.directory)
        return ("",)  # not a path: refused as empty

    @property
    def moment_torch_dtype(self) -> torch.dtype:
        return MOMENT_DTYPES[self.moment_dtype]

    @property
    def blockwise_moments(self) -> bool:
        return self.moment_dtype in BLOCKWISE_MOMENT_DTYPES

    @property
    def transfer_threads(self) -> int:
        """I/O threads per direction the staging budget funds (pipelined): ``io_threads``,
        or fewer when the budget cannot give each a chunk of ``STAGING_REQUEST_MB``."""
        return max(1, min(self.io_threads, self.staging_budget_mb // (2 * STAGING_REQUEST_MB * self.io_queues)))

    @property
    def staging_bytes(self) -> int:
        """Bytes of one staging chunk (one transfer request), a multiple of the
        direct-I/O alignment: the budget split among the chunks."""
        budget = self.staging_budget_mb * 1024 * 1024
        chunk = budget // (2 * self.transfer_threads * self.io_queues) if self.pipelined else budget
        return chunk // DIRECT_IO_ALIGNMENT * DIRECT_IO_ALIGNMENT

    @property
    def pipelined(self) -> bool:
        return self.engine == "pipelined"

    @property
    def max_in_flight(self) -> int:
        """Buckets materialized at once: the sync baseline holds one."""
        return self.buckets_in_flight if self.pipelined else 1

    @property
    def staging_bytes_total(self) -> int:
        """Host staging memory: one chunk per I/O thread and direction, or the
        baseline's one chunk; at most the budget."""
        return self.staging_bytes * (2 * self.transfer_threads * self.io_queues if self.pipelined else 1)

    @property
    def io_queues(self) -> int:
        """Sets of I/O threads (pipelined): one per state directory of the disk home."""
        return max(1, len(self.directories)) if self.tier == "disk" and self.pipelined else 1


# ---- validation, one group of fields per function; each raises StreamConfigError --------------


def _check_directories(config: StreamConfig) -> None:
    directories = config.directories
    if config.tier == "disk" and (not directories or not all(directories)):
        raise StreamConfigError(
            f"directory must be a non-empty path (or several, comma-separated), got {config.directory!r}; "
            "point it at node-local NVMe, e.g. /scratch/optimizer_state"
        )
    if any("\0" in d for d in directories):
        raise StreamConfigError(f"directory holds a NUL character, which no path can: {config.directory!r}")
    normalized = [os.path.realpath(d) for d in directories if d]  # a symlink to one is that one
    if len(set(normalized)) != len(normalized):
        raise StreamConfigError(f"directory names the same directory twice: {config.directory!r}")
    for outer in normalized:
        for inner in normalized:
            if inner != outer and os.path.commonpath([outer, inner]) == outer:
                raise StreamConfigError(
                    f"directory names {inner} inside {outer}: give one directory per drive ({config.directory!r})"
                )


def _check_moment_dtype(name: object) -> None:
    if isinstance(name, str) and name in REMOVED_MOMENT_DTYPES:
        raise StreamConfigError(
            f"moment dtype {name!r} is no longer offered: {REMOVED_MOMENT_DTYPES[name]}; for compact moments use "
            "bf16, or 8bit (scaled per block)"
        )
    if not isinstance(name, str) or name not in MOMENT_DTYPES:
        raise StreamConfigError(f"unknown moment dtype {name!r}; choose one of {', '.join(MOMENT_DTYPES)}")


def _check_choices(config: StreamConfig) -> None:
    for field, choices in (
        ("tier", TIERS),
        ("engine", ENGINES),
        ("main_storage", MAIN_STORAGES),
        ("fp32_param_moments", FP32_PARAM_MOMENTS),
    ):
        value = getattr(config, field)
        if not isinstance(value, str) or value not in choices:
            raise StreamConfigError(f"unknown {field.replace('_', ' ')} {value!r}; choose one of {', '.join(choices)}")
    if not isinstance(config.direct_io, bool):
        raise StreamConfigError(f"direct io must be True or False, got {config.direct_io!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_numbers(config: StreamConfig) -> None:
    if not _is_int(config.bucket_cap_elements):
        raise StreamConfigError(f"bucket cap must be an integer element count, got {config.bucket_cap_elements!r}")
    if config.bucket_cap_elements <= 0:
        raise StreamConfigError(f"bucket cap must be > 0 elements, got {config.bucket_cap_elements}")
    if not _is_int(config.staging_budget_mb) or config.staging_budget_mb <= 0:
        raise StreamConfigError(f"staging budget must be a positive number of MiB, got {config.staging_budget_mb!r}")
    for field in (*AUTO_BUDGET_FIELDS, "auto_gpu_margin_bytes", "auto_host_margin_bytes", "overlap_bytes"):
        value = getattr(config, field)
        if value is AUTO and field in AUTO_BUDGET_FIELDS:
            continue
        if not _is_int(value) or value < 0:
            also = f' or "{AUTO}"' if field in AUTO_BUDGET_FIELDS else ""
            raise StreamConfigError(
                f"{field.replace('_', ' ')} must be a whole number of bytes, 0 or more{also}, got {value!r}"
            )
    if not _is_int(config.resident_warn_elements) or config.resident_warn_elements < 0:
        raise StreamConfigError(
            f"resident warn elements must be a whole number of elements, 0 or more, got {config.resident_warn_elements!r}"
        )
    for field in ("buckets_in_flight", "io_threads", "drive_ranks"):
        value = getattr(config, field)
        if not _is_int(value) or value <= 0:
            raise StreamConfigError(f"{field.replace('_', ' ')} must be a positive integer, got {value!r}")
    timeout = config.io_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise StreamConfigError(f"io timeout must be a positive number of seconds, got {timeout!r}")


# The scratch name names files beside it too (``.<name>.lock``, a save's ``.<name>.partial-<host>-<pid>-<token>``,
# 35 bytes more): the longest a filesystem allows a name (255 bytes) less those additions.
MAX_NAME_BYTES = 200


def _check_name(name: object) -> None:
    if (
        not isinstance(name, str)
        or not name
        or name.startswith(".")
        or any(part in name for part in ("/", "\0", ".partial"))
        or len(os.fsencode(name)) > MAX_NAME_BYTES
    ):
        raise StreamConfigError(
            f"scratch name must be one path component of at most {MAX_NAME_BYTES} bytes without '/', NUL, a leading "
            f"'.' or '.partial' (a save's partial directories and locks are named so), got {name!r}"
        )


def _check_combinations(config: StreamConfig) -> None:
    if config.pipelined and config.staging_budget_mb < 2 * MIN_STAGING_CHUNK_MB * config.io_queues:
        per = f" for each of {config.io_queues} directories" if config.io_queues > 1 else ""
        raise StreamConfigError(
            f"staging budget {config.staging_budget_mb} MiB is too small: the pipelined engine needs a chunk "
            f"of at least {MIN_STAGING_CHUNK_MB} MiB per direction{per} "
            f"({2 * MIN_STAGING_CHUNK_MB * config.io_queues} MiB in all)"
        )
    if config.overlap_bytes and not config.pipelined:
        raise StreamConfigError("overlap bytes need the pipelined engine (the sync engine moves one bucket at a time)")
    if config.overlap_bytes and config.gpu_budget_bytes is AUTO:
        raise StreamConfigError(
            'overlap bytes cannot be used with an "auto" GPU budget: it sizes its home from the peaks of '
            "forward and backward, which the window held through them would change; give the GPU budget in GiB"
        )
