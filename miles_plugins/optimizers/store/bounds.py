"""What a step may allocate on the device beyond what was allocated before it, stated
so the GPU tier can assert it (docs/performance.md, "GPU memory during a step")."""

from __future__ import annotations

from collections.abc import Sequence

from miles_plugins.optimizers.config import StreamConfig
from miles_plugins.optimizers.formats import quant8
from miles_plugins.optimizers.formats.convert import CHUNK_ELEMENTS
from miles_plugins.optimizers.formats.layout import BucketLayout

# torch's Adam keeps one fp32 temporary per element of the bucket it updates (the
# denominator sqrt(exp_avg_sq) + eps): 4 bytes per element.
ADAM_TEMPORARY_BYTES_PER_ELEMENT = 4
# Storage-format conversions work in chunks of CHUNK_ELEMENTS; the remainder codec's
# chunk temporaries are the largest, 12 bytes per element (the 8-bit codec's at most 9,
# plus 1/64 byte per element of the entry for its scales; the fused kernels' packed
# groups of small entries 8). Not counted: a chunk or packed group whose remainder
# exceptions overflow the device's slots (NaN mains) keeps its fp32 values while the
# reference path finds them, up to twice this.
CONVERSION_SCRATCH_BYTES = 12 * CHUNK_ELEMENTS


def step_device_bytes_bound(
    buckets: Sequence[BucketLayout], config: StreamConfig, grad_bytes_per_element: int, overlap_bytes_bound: int
) -> int:
    """``buckets_in_flight`` largest buckets, Adam's temporary and the grads the store's
    ``grad_fn`` makes (``grad_bytes_per_element``) for one bucket, the conversion
    scratch and the 8-bit scales of the largest bucket; with an overlap window, the
    window's buckets too (``overlap_bytes_bound``: the step ends holding them)."""
    largest = max((b.numel for b in buckets), default=0)
    per_element = ADAM_TEMPORARY_BYTES_PER_ELEMENT + grad_bytes_per_element
    scales = quant8.SCALE_DTYPE.itemsize * -(-largest // quant8.BLOCK) if config.blockwise_moments else 0
    in_flight = config.max_in_flight * max((b.materialized_bytes for b in buckets), default=0)
    return in_flight + overlap_bytes_bound + per_element * largest + CONVERSION_SCRATCH_BYTES + scales
