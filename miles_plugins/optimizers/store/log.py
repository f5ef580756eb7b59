"""The store's log lines about its steps: what each step moved, and the warnings about
state that stays on the device during a step anyway. (Its setup's line: ``assembled.py``.)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from miles_plugins.optimizers.config import DEFAULT_BUCKET_CAP_ELEMENTS, StreamConfig
from miles_plugins.optimizers.formats.layout import MATERIALIZED_BYTES_PER_ELEMENT, BucketLayout
from miles_plugins.optimizers.step.entries import StepStats

logger = logging.getLogger(__name__)

_EAGER_SLOTS_LOGGED = 4  # the step's log line names this many eager conversions, then counts the rest


def log_step(steps_taken: int, stats: StepStats) -> None:
    """One INFO line per step: what it moved, in how long, and how its conversions ran."""
    graphs = ""
    if stats.conversions_replayed or stats.conversions_eager:
        slots = [f"{direction} {bucket}" for direction, bucket in stats.eager_slots[:_EAGER_SLOTS_LOGGED]]
        more = len(stats.eager_slots) - len(slots)
        which = f" ({', '.join(slots)}{f' and {more} more' if more else ''})" if slots else ""
        graphs = (
            f"; conversions: {stats.conversions_replayed} replayed from CUDA graphs (captures included),"
            f" {stats.conversions_eager} eager{which}"
        )
    logger.info(
        "streamed optimizer step %d: %d buckets, read %.1f MB, wrote %.1f MB in %.3f s%s",
        steps_taken,
        stats.buckets,
        stats.bytes_read / 1e6,
        stats.bytes_written / 1e6,
        stats.seconds,
        graphs,
    )


def warn_about_residency(config: StreamConfig, buckets: Sequence[BucketLayout], resident_numel: int) -> None:
    """Say so when streaming keeps a lot of state on the device anyway."""
    if resident_numel > config.resident_warn_elements:
        logger.warning(
            "%d elements of fp32 params (%.2f GB of state) stay resident on the device "
            "(fp32_param_moments='resident'): their main is the model param itself; "
            "fp32_param_moments='streamed' streams their moments (8 of the 12 bytes)",
            resident_numel,
            resident_numel * MATERIALIZED_BYTES_PER_ELEMENT / 1e9,
        )
    # Every bucket in flight puts the whole streamed state on the device. Said where a
    # chosen cap did it and a lower one would not: a param is never split, so with no
    # more params than buckets in flight no cap helps; at the default cap (sized for
    # large models) a state this small is left unsaid.
    params = sum(len(b.entry_indices) for b in buckets)
    if len(buckets) <= config.max_in_flight < params and config.bucket_cap_elements != DEFAULT_BUCKET_CAP_ELEMENTS:
        logger.warning(
            "all %d buckets fit in the %d in flight: the whole streamed state (%.2f GB) is on the device "
            "during a step, as without streaming; lower the bucket cap (now %d elements; a param is never "
            "split, the largest bucket holds %d) to bound it",
            len(buckets),
            config.max_in_flight,
            sum(b.materialized_bytes for b in buckets) / 1e9,
            config.bucket_cap_elements,
            max(b.numel for b in buckets),
        )
