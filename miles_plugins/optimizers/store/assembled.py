"""A store's parts, held by name, and what they take: the sizes of its state, where
it lives, the device memory a step may add (``bounds.py``), and the setup's log line
that says so."""

from __future__ import annotations

import logging

import torch

from miles_plugins.optimizers.config import STAGING_REQUEST_MB, StreamConfig
from miles_plugins.optimizers.step.entries import Entry
from miles_plugins.optimizers.store.bounds import step_device_bytes_bound
from miles_plugins.optimizers.store.parts import StoreParts

logger = logging.getLogger(__name__)


class AssembledStore:
    """The structure of a :class:`~miles_plugins.optimizers.store.streaming_store.StreamingStore`:
    its config, entries and parts (``parts.py``), and read-only views of them.

    Args:
        config: the store's, resolved (no ``"auto"`` left).
        entries: the store's entries.
        parts: what :func:`~miles_plugins.optimizers.store.parts.assemble` built.
        grad_bytes_per_element: device bytes the store's ``grad_fn`` allocates per
            element of the bucket being updated (:attr:`step_device_bytes_bound`).
    """

    def __init__(
        self, *, config: StreamConfig, entries: list[Entry], parts: StoreParts, grad_bytes_per_element: int
    ) -> None:
        self.config, self.entries, self._parts = config, entries, parts
        self._grad_bytes_per_element = grad_bytes_per_element
        plan = parts.plan
        self._device: torch.device = plan.device
        self.buckets, self._bucket_optimizers = plan.buckets, plan.bucket_optimizers
        self._resident_entries, self._resident_optimizer = plan.resident_entries, plan.resident_optimizer
        self.placed, self._backing, self._engine = parts.placed, parts.backing, parts.engine
        self._pipeline, self._window, self._gpu_home = parts.pipeline, parts.window, parts.gpu_home

    @property
    def location(self) -> str:
        """Where the state lives (``Placement.location``)."""
        return self.placed.location(self._device)

    @property
    def placement(self) -> dict[str, int]:
        """Buckets per home (``gpu``, ``host``, ``disk``)."""
        return self.placed.counts()

    @property
    def home_bytes(self) -> dict[str, int]:
        """Stored bytes per home (``Placement.home_bytes``)."""
        return self.placed.home_bytes()

    @property
    def state_bytes_total(self) -> int:
        """Bytes the streamed state would take fully materialized (fp32 main + moments)."""
        return sum(b.materialized_bytes for b in self.buckets)

    @property
    def bucket_bytes_max(self) -> int:
        """Materialized bytes of the largest bucket: the residency bound per bucket in flight."""
        return max((b.materialized_bytes for b in self.buckets), default=0)

    @property
    def file_bytes_total(self) -> int:
        """Bytes the stored state takes (its storage formats, alignment padding included)."""
        return sum(b.file_size for b in self.buckets)

    @property
    def accounted_max_state_bytes(self) -> int:
        """The store's own count (accounting, not a measurement) of the most
        streamed-state bytes materialized on the device at once so far."""
        return self._pipeline.accounting.peak

    @property
    def step_device_bytes_bound(self) -> int:
        """The most device memory a step adds to what was allocated before it
        (``bounds.step_device_bytes_bound``). On CUDA the codec's graphs keep about one
        bucket's conversion scratch reserved between steps, in a pool of their own
        (``step/graphs.py``), which this does not count again, and the remainder
        encoder's exception slots stay allocated (``fused_remainder.ExceptionSlots``: 8 KiB per
        encoder run of the largest bucket, 2 bytes per 1024 elements of a run beyond
        4M, and as much pinned host memory), not counted either."""
        return step_device_bytes_bound(
            self.buckets, self.config, self._grad_bytes_per_element, self.overlap_bytes_bound
        )

    @property
    def overlap_bytes_bound(self) -> int:
        """The most materialized state the overlap window holds on the device between
        steps (``OverlapWindow.bound``); 0 without a window."""
        return self._window.bound

    @property
    def carried_peak_bytes(self) -> int:
        """The most state the overlap window was seen holding between steps (accounting)."""
        return self._window.carried_peak_bytes

    def _log_setup(self) -> None:
        """Say where the state streams through, how much of it there is, and the staging."""
        config = self.config
        logger.info(
            "optimizer state streams through %s (%s engine%s): %d buckets, %.2f GB stored, %.2f GB "
            "materialized state total, largest bucket %.2f GB, %d in flight; %d fp32 params resident; "
            "host staging %g MiB (%s)",
            self.location,
            config.engine,
            ", direct I/O" if self._backing.direct else "",
            len(self.buckets),
            self.file_bytes_total / 1e9,
            self.state_bytes_total / 1e9,
            self.bucket_bytes_max / 1e9,
            config.max_in_flight,
            len(self._resident_entries),
            round(config.staging_bytes_total / 2**20, 2),
            f"{2 * config.transfer_threads * config.io_queues} chunks of {config.staging_bytes / 2**20:g} MiB"
            if config.pipelined
            else "one chunk",
        )
        if config.pipelined and config.transfer_threads < config.io_threads:
            # By design (fewer, larger requests), so not a warning; said for whoever asked for more threads.
            logger.info(
                "%d MiB of staging (this store's) funds %d of the %d I/O threads per direction%s: requests of %g MiB "
                "(fewer threads with larger requests: smaller ones were slower on NVMe; each thread takes 2 x %d MiB)",
                config.staging_budget_mb,
                config.transfer_threads,
                config.io_threads,
                f" and directory ({config.io_queues} directories)" if config.io_queues > 1 else "",
                config.staging_bytes / 2**20,
                STAGING_REQUEST_MB,
            )
