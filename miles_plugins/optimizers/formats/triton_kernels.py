"""The Triton kernels behind ``fused.py``, which documents what they compute, why it is
exact, and the tile order that lets one launch convert a bucket's entries in place.
Imported only on a first CUDA conversion, where Triton is installed.

Every kernel converts all entries of one launch (``fused.Launch``): a program converts
one tile (``TILE`` elements of one entry), taken by ticket; ``ctl`` (zeroed per launch)
holds the ticket counter, the remainder encoder's counters and one flag per tile
(``_HEAD`` on), released once the tile's loads are consumed. A tile's stores then wait
for the tiles whose elements they land on, so no tile's release waits on another's
(but the remainder encoder's, whose stand-down must pass to the tiles after it)."""

import triton
import triton.language as tl

_SMALLEST_NORMAL = tl.constexpr(1.1754943508222875e-38)  # 2^-126
_TWO_64 = tl.constexpr(18446744073709551616.0)
_TWO_MINUS_32 = tl.constexpr(2.3283064365386963e-10)
_TWO_MINUS_64 = tl.constexpr(5.421010862427522e-20)
# ctl: [0] tickets, [1] exception slots asked for, [2] slots filled, [3] tiles stood down,
# then the flags (0 unset, 1 read, 2 stood down: read, nothing stored).
_TOTAL = tl.constexpr(1)
_USED = tl.constexpr(2)
_DOWN = tl.constexpr(3)
_HEAD = tl.constexpr(4)
# Per entry in the descriptor (int64): elements from the launch's base pointer, element
# count, first tile, an aux offset (scale blocks, or exception positions), and the
# param's elements from the param base pointer (remainder kernels).
_COLS = tl.constexpr(5)


@triton.jit
def _claim(desc_ptr, ctl_ptr, entries, DESCENDING: tl.constexpr):
    """This program's tile (by ticket, not program id: a program waits only on tiles
    whose programs took an earlier ticket, so are running) and its entry's descriptor."""
    ticket = tl.atomic_add(ctl_ptr, 1)
    if DESCENDING:
        t = tl.num_programs(0) - 1 - ticket
    else:
        t = ticket
    lo = ticket * 0
    hi = lo + entries
    while hi - lo > 1:  # the last entry whose first tile is at most t
        mid = (lo + hi) // 2
        go = tl.load(desc_ptr + mid * _COLS + 2) <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return t, desc_ptr + lo * _COLS


@triton.jit
def _wait(flag_ptr):
    """Spin until the flag is set (acquire: that tile's loads happened before)."""
    state = tl.atomic_add(flag_ptr, 0, sem="acquire")
    while state == 0:
        state = tl.atomic_add(flag_ptr, 0, sem="acquire")
    return state


@triton.jit
def _release(ctl_ptr, t, state):
    """Tile ``t``'s loads are consumed (their values used above): others may store over
    them; and so may this program (an entry's first tile stores over itself)."""
    tl.debug_barrier()
    tl.atomic_xchg(ctl_ptr + _HEAD + t, state, sem="release")


@triton.jit
def _offset(row, col, ALIGNED: tl.constexpr, MULTIPLE: tl.constexpr):
    offset = tl.load(row + col)
    if ALIGNED:  # every entry 16-byte aligned: vector loads and stores
        offset = tl.multiple_of(offset, MULTIPLE)
    return offset


@triton.jit
def _left(n, start, TILE: tl.constexpr):
    """Elements of the tile at ``start`` (of an entry of ``n``): ``TILE`` but in the last."""
    return tl.minimum(n - start, TILE).to(tl.int32)


@triton.jit
def _quantize_tile(
    x_ptr,
    codes_ptr,
    scales_ptr,
    left,
    ctl_ptr,
    t,
    dep,
    mids_ptr,
    guide_ptr,
    SQRT: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    FULL: tl.constexpr,
    GUIDE_SHIFT: tl.constexpr,
    GUIDE_FIRST: tl.constexpr,
    GUIDE_SLICES: tl.constexpr,
):
    """One tile: ``left`` elements from ``x_ptr`` (all ``ROWS * BLOCK`` with ``FULL``: no
    masks, so vector loads and stores); its stores wait for tile ``dep`` (none: -1)."""
    rows = tl.arange(0, ROWS)
    local = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if FULL:
        x = tl.load(x_ptr + local)
    else:
        x = tl.load(x_ptr + local, mask=local < left, other=0.0)  # zero padding, as the reference
    if SQRT:
        # Subnormal inputs scaled up by 2^64 and the root down by 2^32, both exact:
        # Triton builds before triton-lang/triton#8557 flush subnormals in sqrt_rn and div_rn.
        small = x < _SMALLEST_NORMAL
        root = tl.sqrt_rn(tl.where(small, x * _TWO_64, x))
        x = tl.where(small, root * _TWO_MINUS_32, root)
    amax = tl.max(x, axis=1)
    neg_amin = -tl.min(x, axis=1)
    nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    _release(ctl_ptr, t, 1)  # the reductions used every element loaded
    scale = tl.where(amax >= neg_amin, amax, neg_amin)
    # Clearing the sign bit is the reference's abs_(): +0 for an all-zero block
    # (a bit operation, which no float rewrite of the compiler can fold away).
    scale = (scale.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    scale = tl.where(nan, float("nan"), scale)
    divisor = tl.where(scale == 0.0, 1.0, scale)
    # A block below 2^-64 (subnormals possible) divided as x * 2^64 / (scale * 2^64): the
    # same quotient, from normal operands. A subnormal quotient flushed to zero keeps its
    # code: the map's nearest values are ~1e-7.
    tiny = divisor < _TWO_MINUS_64
    numerator = tl.where(tiny[:, None], x * _TWO_64, x)
    v = tl.div_rn(numerator, tl.where(tiny, divisor * _TWO_64, divisor)[:, None])
    # The code is the count of midpoints below v. The guide (fused.search_guide) gives that
    # count at the start of v's slice of float values, past at most two midpoints.
    bits = v.to(tl.int32, bitcast=True)
    key = tl.minimum(tl.maximum(((bits & 0x7FFFFFFF) >> GUIDE_SHIFT) - GUIDE_FIRST, 0), GUIDE_SLICES - 1)
    below = tl.load(guide_ptr + key + tl.where(bits < 0, GUIDE_SLICES, 0))
    code = below + (tl.load(mids_ptr + below) < v).to(tl.int32) + (tl.load(mids_ptr + below + 1) < v).to(tl.int32)
    code = tl.where(v != v, 255, code).to(tl.uint8)  # bucketize's rule: NaN after every midpoint
    if dep >= 0:
        _wait(ctl_ptr + _HEAD + dep)
    if FULL:
        tl.store(scales_ptr + rows, scale)
        tl.store(codes_ptr + local, code)
    else:
        tl.store(scales_ptr + rows, scale, mask=rows * BLOCK < left)
        tl.store(codes_ptr + local, code, mask=local < left)


@triton.jit(do_not_specialize=["entries"])
def quantize(
    x_ptr,
    codes_ptr,
    scales_ptr,
    desc_ptr,
    ctl_ptr,
    mids_ptr,
    guide_ptr,
    entries,
    SQRT: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ALIGNED: tl.constexpr,
    GUIDE_SHIFT: tl.constexpr,
    GUIDE_FIRST: tl.constexpr,
    GUIDE_SLICES: tl.constexpr,
):
    t, row = _claim(desc_ptr, ctl_ptr, entries, DESCENDING=False)
    x_off = _offset(row, 0, ALIGNED, 4)
    n, first, scale_base = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    j = t - first
    dep = tl.where(j > 0, first + j // 4, -1)  # its codes land on tile j // 4's fp32 bytes
    start = j * (ROWS * BLOCK)
    left = _left(n, start, ROWS * BLOCK)
    x, codes, scales = x_ptr + x_off + start, codes_ptr + 4 * x_off + start, scales_ptr + scale_base + start // BLOCK
    if left == ROWS * BLOCK:
        _quantize_tile(
            x,
            codes,
            scales,
            left,
            ctl_ptr,
            t,
            dep,
            mids_ptr,
            guide_ptr,
            SQRT,
            BLOCK,
            ROWS,
            True,
            GUIDE_SHIFT,
            GUIDE_FIRST,
            GUIDE_SLICES,
        )
    else:
        _quantize_tile(
            x,
            codes,
            scales,
            left,
            ctl_ptr,
            t,
            dep,
            mids_ptr,
            guide_ptr,
            SQRT,
            BLOCK,
            ROWS,
            False,
            GUIDE_SHIFT,
            GUIDE_FIRST,
            GUIDE_SLICES,
        )


@triton.jit
def _wait_readers(ctl_ptr, first, j, tiles, FANOUT: tl.constexpr):
    """Widening: tile ``j``'s fp32 values land on the stored forms of tiles ``FANOUT * j``
    to ``FANOUT * j + FANOUT - 1`` of its entry (``first``: its first tile, ``tiles``
    its count): wait until those are read."""
    for d in range(FANOUT):
        dep = FANOUT * j + d
        if (dep != j) & (dep < tiles):
            _wait(ctl_ptr + _HEAD + first + dep)


@triton.jit
def _dequantize_tile(
    x_ptr,
    codes_ptr,
    scales_ptr,
    values_ptr,
    left,
    ctl_ptr,
    t,
    first,
    j,
    tiles,
    SQUARE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    FULL: tl.constexpr,
):
    rows = tl.arange(0, ROWS)
    local = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if FULL:
        code = tl.load(codes_ptr + local).to(tl.int32)
    else:
        code = tl.load(codes_ptr + local, mask=local < left, other=0).to(tl.int32)
    y = tl.load(values_ptr + code)
    _release(ctl_ptr, t, 1)  # every code loaded went into y
    y = y * tl.load(scales_ptr + rows, mask=rows * BLOCK < left, other=1.0)[:, None]
    if SQUARE:
        y = y * y
    _wait_readers(ctl_ptr, first, j, tiles, 4)
    if FULL:
        tl.store(x_ptr + local, y)
    else:
        tl.store(x_ptr + local, y, mask=local < left)


@triton.jit(do_not_specialize=["entries"])
def dequantize(
    x_ptr,
    codes_ptr,
    scales_ptr,
    values_ptr,
    desc_ptr,
    ctl_ptr,
    entries,
    SQUARE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    t, row = _claim(desc_ptr, ctl_ptr, entries, DESCENDING=True)
    x_off = _offset(row, 0, ALIGNED, 4)
    n, first, scale_base = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    j = t - first
    tiles = tl.cdiv(n, ROWS * BLOCK)
    start = j * (ROWS * BLOCK)
    left = _left(n, start, ROWS * BLOCK)
    x, codes, scales = x_ptr + x_off + start, codes_ptr + 4 * x_off + start, scales_ptr + scale_base + start // BLOCK
    if left == ROWS * BLOCK:
        _dequantize_tile(x, codes, scales, values_ptr, left, ctl_ptr, t, first, j, tiles, SQUARE, BLOCK, ROWS, True)
    else:
        _dequantize_tile(x, codes, scales, values_ptr, left, ctl_ptr, t, first, j, tiles, SQUARE, BLOCK, ROWS, False)


@triton.jit
def _encode_tile(
    bits_ptr,
    low_ptr,
    param_ptr,
    index_ptr,
    high_ptr,
    ctl_ptr,
    t,
    at,
    left,
    slots,
    TILE: tl.constexpr,
    FULL: tl.constexpr,
):
    """One tile's low bits, and its exceptions (``at``: the position of its first element
    among the launch's) into the slots; where they do not fit, the tile stands down
    (flag 2) and stores nothing."""
    local = tl.arange(0, TILE)
    if FULL:
        bits = tl.load(bits_ptr + local)
        param = tl.load(param_ptr + local)
        inside = local < TILE
    else:
        inside = local < left
        bits = tl.load(bits_ptr + local, mask=inside, other=0)
        param = tl.load(param_ptr + local, mask=inside, other=0)
    low = bits.to(tl.int16)  # truncation keeps the low 16 bits
    high = (bits >> 16).to(tl.int16)
    rounded_up = (low < 0) & (low != -32768)
    missed = (high != param - rounded_up.to(tl.int16)) & inside
    count = tl.sum(missed.to(tl.int32), axis=0)
    # Slots are taken from the front, so [0, USED) are the filled ones: after a reservation
    # that failed, none succeeds. A tile that sees them spent reserves nothing (the
    # count, int32, then cannot wrap however many exceptions follow).
    slot = count * 0
    fits = count == 0
    if count > 0:
        if tl.load(ctl_ptr + _TOTAL, volatile=True) <= slots - count:
            slot = tl.atomic_add(ctl_ptr + _TOTAL, count)
            fits = slot <= slots - count
    if fits:
        _release(ctl_ptr, t, 1)  # the count used every element loaded
        if count > 0:
            tl.atomic_add(ctl_ptr + _USED, count)
            where = slot + tl.cumsum(missed.to(tl.int32), axis=0) - 1
            tl.store(index_ptr + where, at + local, mask=missed)
            tl.store(high_ptr + where, high, mask=missed)
        if FULL:
            tl.store(low_ptr + local, low)
        else:
            tl.store(low_ptr + local, low, mask=inside)
    else:
        tl.atomic_add(ctl_ptr + _DOWN, 1)
        _release(ctl_ptr, t, 2)


@triton.jit(do_not_specialize=["entries", "slots"])
def remainder_encode(
    bits_ptr,
    low_ptr,
    param_ptr,
    index_ptr,
    high_ptr,
    desc_ptr,
    ctl_ptr,
    entries,
    slots,
    TILE: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    t, row = _claim(desc_ptr, ctl_ptr, entries, DESCENDING=False)
    x_off, p_off = _offset(row, 0, ALIGNED, 4), _offset(row, 4, ALIGNED, 8)
    n, first, base = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    j = t - first
    # A tile whose exceptions do not fit the slots stands down, and so do the tiles whose
    # low bits land on it: the elements not converted keep their fp32 bytes for the host.
    parent = t * 0 + 1
    if j > 0:  # its low bits land on tile j // 2's fp32 bytes
        parent = _wait(ctl_ptr + _HEAD + first + j // 2)
    if parent == 1:
        start = j * TILE
        left = _left(n, start, TILE)
        bits, low, param = bits_ptr + x_off + start, low_ptr + 2 * x_off + start, param_ptr + p_off + start
        if left == TILE:
            _encode_tile(bits, low, param, index_ptr, high_ptr, ctl_ptr, t, base + start, left, slots, TILE, True)
        else:
            _encode_tile(bits, low, param, index_ptr, high_ptr, ctl_ptr, t, base + start, left, slots, TILE, False)
    else:
        tl.atomic_add(ctl_ptr + _DOWN, 1)
        _release(ctl_ptr, t, 2)


@triton.jit
def _decode_tile(
    bits_ptr, low_ptr, param_ptr, left, ctl_ptr, t, first, j, tiles, TILE: tl.constexpr, FULL: tl.constexpr
):
    local = tl.arange(0, TILE)
    if FULL:
        low = tl.load(low_ptr + local)
        param = tl.load(param_ptr + local)
    else:
        low = tl.load(low_ptr + local, mask=local < left, other=0)
        param = tl.load(param_ptr + local, mask=local < left, other=0)
    rounded_up = (low < 0) & (low != -32768)
    high = (param - rounded_up.to(tl.int16)).to(tl.int32)
    bits = (high << 16) | (low.to(tl.int32) & 0xFFFF)
    _release(ctl_ptr, t, 1)  # every low half loaded went into bits
    _wait_readers(ctl_ptr, first, j, tiles, 2)
    if FULL:
        tl.store(bits_ptr + local, bits)
    else:
        tl.store(bits_ptr + local, bits, mask=local < left)


@triton.jit(do_not_specialize=["entries"])
def remainder_decode(
    bits_ptr, low_ptr, param_ptr, desc_ptr, ctl_ptr, entries, TILE: tl.constexpr, ALIGNED: tl.constexpr
):
    t, row = _claim(desc_ptr, ctl_ptr, entries, DESCENDING=True)
    x_off, p_off = _offset(row, 0, ALIGNED, 4), _offset(row, 4, ALIGNED, 8)
    n, first = tl.load(row + 1), tl.load(row + 2)
    j = t - first
    tiles = tl.cdiv(n, TILE)
    start = j * TILE
    left = _left(n, start, TILE)
    bits, low, param = bits_ptr + x_off + start, low_ptr + 2 * x_off + start, param_ptr + p_off + start
    if left == TILE:
        _decode_tile(bits, low, param, left, ctl_ptr, t, first, j, tiles, TILE, True)
    else:
        _decode_tile(bits, low, param, left, ctl_ptr, t, first, j, tiles, TILE, False)


@triton.jit(do_not_specialize=["count"])
def put_highs(high16_ptr, table_ptr, count, TILE: tl.constexpr):
    """Exceptions' true high halves: ``table`` holds ``count`` int16 positions from
    ``high16_ptr`` (an element's high half), then their values."""
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    inside = offs < count
    where = tl.load(table_ptr + offs, mask=inside, other=0)
    high = tl.load(table_ptr + count + offs, mask=inside, other=0)
    tl.store(high16_ptr + where, high.to(tl.int16), mask=inside)
