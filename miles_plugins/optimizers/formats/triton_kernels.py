"""The Triton kernels behind ``fused.py`` (which documents what they compute and why
it is exact) and ``fused_remainder.py``: imported by the registry (``kernels.py``) only
when the kernels are first wanted, where Triton is installed."""

import triton
import triton.language as tl

_SMALLEST_NORMAL = tl.constexpr(1.1754943508222875e-38)  # 2^-126
_TWO_64 = tl.constexpr(18446744073709551616.0)
_TWO_MINUS_32 = tl.constexpr(2.3283064365386963e-10)
_TWO_MINUS_64 = tl.constexpr(5.421010862427522e-20)


@triton.jit
def quantize(
    x_ptr,
    codes_ptr,
    scales_ptr,
    mids_ptr,
    guide_ptr,
    n,
    SQRT: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    GUIDE_SHIFT: tl.constexpr,
    GUIDE_FIRST: tl.constexpr,
    GUIDE_SLICES: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)  # zero padding, as the reference pads
    if SQRT:
        # Subnormal inputs scaled up by 2^64 and the root down by 2^32, both exact: Triton
        # builds before triton-lang/triton#8557 flush subnormals in sqrt_rn and div_rn.
        small = x < _SMALLEST_NORMAL
        root = tl.sqrt_rn(tl.where(small, x * _TWO_64, x))
        x = tl.where(small, root * _TWO_MINUS_32, root)
    amax = tl.max(x, axis=1)
    neg_amin = -tl.min(x, axis=1)
    scale = tl.where(amax >= neg_amin, amax, neg_amin)
    # Clearing the sign bit is the reference's abs_(): +0 for an all-zero block
    # (a bit operation, which no float rewrite of the compiler can fold away).
    scale = (scale.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    scale = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, float("nan"), scale)
    tl.store(scales_ptr + rows, scale, mask=rows * BLOCK < n)
    divisor = tl.where(scale == 0.0, 1.0, scale)
    # A block below 2^-64 (subnormals possible) divided as x * 2^64 / (scale * 2^64): the
    # same quotient, from normal operands (see the square root above). A subnormal
    # quotient flushed to zero keeps its code: the map's nearest values are ~1e-7.
    tiny = divisor < _TWO_MINUS_64
    numerator = tl.where(tiny[:, None], x * _TWO_64, x)
    v = tl.div_rn(numerator, tl.where(tiny, divisor * _TWO_64, divisor)[:, None])
    # The code is the count of midpoints below v. The guide (see fused.search_guide) gives
    # that count at the start of v's slice of float values, past at most two midpoints.
    bits = v.to(tl.int32, bitcast=True)
    key = tl.minimum(tl.maximum(((bits & 0x7FFFFFFF) >> GUIDE_SHIFT) - GUIDE_FIRST, 0), GUIDE_SLICES - 1)
    below = tl.load(guide_ptr + key + tl.where(bits < 0, GUIDE_SLICES, 0))
    code = below + (tl.load(mids_ptr + below) < v).to(tl.int32) + (tl.load(mids_ptr + below + 1) < v).to(tl.int32)
    code = tl.where(v != v, 255, code)  # bucketize's rule: NaN after every midpoint
    tl.store(codes_ptr + offs, code.to(tl.uint8), mask=inside)


@triton.jit
def dequantize(
    codes_ptr, scales_ptr, values_ptr, out_ptr, n, SQUARE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = offs < n
    code = tl.load(codes_ptr + offs, mask=inside, other=0).to(tl.int32)
    scale = tl.load(scales_ptr + rows, mask=rows * BLOCK < n, other=1.0)
    y = tl.load(values_ptr + code) * scale[:, None]
    if SQUARE:
        y = y * y
    tl.store(out_ptr + offs, y, mask=inside)


@triton.jit
def remainder_encode(
    bits_ptr,
    param_ptr,
    low_ptr,
    counts_ptr,
    chunk,
    found_ptr,
    n,
    base,
    capacity,
    SPAN: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    # counts[k]: the exceptions chunk k of this run found, -1 where it stood down. A chunk
    # runs only while the earlier ones fit the slots: the chunk after an overflowing one
    # would write its low bits over that chunk's fp32 elements, which the host's fallback
    # has yet to read. Standing down, it leaves its own elements unread too.
    earlier = tl.load(counts_ptr + tl.arange(0, CHUNKS), mask=tl.arange(0, CHUNKS) < chunk, other=0)
    before = tl.sum(earlier, axis=0)
    stand_down = (tl.min(earlier, axis=0) < 0) | (before > capacity)
    tl.store(counts_ptr + chunk, -1, mask=stand_down)
    offs = tl.program_id(0) * SPAN + tl.arange(0, SPAN)
    inside = offs < tl.where(stand_down, 0, n)  # a chunk that stands down touches nothing
    bits = tl.load(bits_ptr + offs, mask=inside, other=0)
    low = bits.to(tl.int16)  # truncation keeps the low 16 bits
    high = (bits >> 16).to(tl.int16)
    param = tl.load(param_ptr + offs, mask=inside, other=0)
    rounded_up = (low < 0) & (low != -32768)
    missed = (high != param - rounded_up.to(tl.int16)) & inside
    tl.store(low_ptr + offs, low, mask=inside)
    count = tl.sum(missed.to(tl.int32), axis=0)
    if count > 0:
        first = tl.atomic_add(counts_ptr + chunk, count)
        slot = before + first + tl.cumsum(missed.to(tl.int32), axis=0) - 1
        keep = missed & (slot < capacity)
        # The element's number and its true high half in one int64 (ExceptionSlots).
        found = ((offs.to(tl.int64) + base) << 16) | ((bits >> 16) & 0xFFFF).to(tl.int64)
        tl.store(found_ptr + slot, found, mask=keep)


@triton.jit
def remainder_decode(low_ptr, param_ptr, bits_ptr, n, SPAN: tl.constexpr):
    offs = tl.program_id(0) * SPAN + tl.arange(0, SPAN)
    inside = offs < n
    low = tl.load(low_ptr + offs, mask=inside, other=0)
    param = tl.load(param_ptr + offs, mask=inside, other=0)
    rounded_up = (low < 0) & (low != -32768)
    high = (param - rounded_up.to(tl.int16)).to(tl.int32)
    tl.store(bits_ptr + offs, (high << 16) | (low.to(tl.int32) & 0xFFFF), mask=inside)
