"""The host side of the fused CUDA kernels (Triton: ``triton_kernels.py``) for the 8-bit
codec and the remainder decoder: their constants, chunks, packing plan and launches. They
store the same bytes as ``quant8.py`` and ``remainder.py``, which stay the reference (and
the CPU path). The remainder encoder, which also collects exceptions, is
``fused_remainder.py``; whether the kernels serve a tensor is the registry's to say
(``kernels.py``), and every function here takes the kernels' module it launches.

Why: the reference formulations run a dozen elementwise passes per chunk, and the
reference remainder encoder waits on the host for every chunk's exceptions. A fused
kernel reads each fp32 element once and writes its stored form once.

Exactness: every operation is the reference's IEEE one. ``tl.div_rn`` and ``tl.sqrt_rn``
round correctly (plain ``/`` and ``tl.sqrt`` in Triton are approximate), and subnormal
operands are first scaled by powers of two (exact), since Triton builds before
triton-lang/triton#8557 flush them to zero in those two; the code of a
value is the count of map midpoints ``m`` with ``not (m >= v)``, which is what
``torch.bucketize`` returns on CPU and CUDA, a NaN included (code 255): a table
(:func:`search_guide`) gives that count at the start of ``v``'s slice of floats, and
two comparisons finish it;
a block's scale is ``torch.maximum(amax, -amin).abs()``, NaN when the block holds
one (the NaN's bits may differ: either decodes the whole block to NaN). The GPU tier
compares the bytes with the CPU reference, and so does a self-test when the kernels are
first wanted on a device (``kernel_self_test.py``: ties under several scales with their
float neighbours, padding a wrong value would show, writes past every output, remainder
mains across chunk and program edges, an overflow of the exception slots): a Triton
that does not build them, or builds them to other bytes, leaves the reference in
charge, with a warning.

In place, in few launches: the stored form lives in the first bytes of the fp32
tensor's storage (see ``convert.py``). A chunk of fp32 elements ``[s, e)`` (bytes
``[4s, 4e)``) encodes to bytes ``[ws, we)`` of ``w``-byte codes; the two do not
overlap when ``w * e <= 4 * s``, so one launch may read the chunk and write its codes
directly. Chunks therefore grow geometrically (``[s, 4s / w)``): an entry of ``n``
elements takes ``log(n / SCRATCH_ELEMENTS)`` launches, and only the first chunk,
which overlaps itself, goes through a scratch of ``SCRATCH_ELEMENTS`` codes.

Small entries (biases, norms) cost host time per operation, not device time per
byte: a bucket's are converted packed (:func:`plan_sizes`), out of place in one buffer
per group, with a handful of operations per group.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

from miles_plugins.optimizers.formats import quant8
from miles_plugins.optimizers.formats.convert import CHUNK_ELEMENTS

# The first chunk of an entry, which overlaps its own stored form, goes through a
# scratch of this many codes: at most 4 bytes each (16 MiB), within the conversion
# scratch the store states (``store.bounds.CONVERSION_SCRATCH_BYTES``).
SCRATCH_ELEMENTS = CHUNK_ELEMENTS
# Per Triton program: 8-bit blocks (quant8), elements (remainder); warps (all kernels).
BLOCKS_PER_PROGRAM = 16
ELEMENTS_PER_PROGRAM = 4096
WARPS_PER_PROGRAM = 4
# Entries of at most this many elements (biases, norms) are converted packed, a group
# at a time (:func:`plan_sizes`): their conversion costs host time per operation, not
# device time per byte.
PACKED_MAX_ELEMENTS = SCRATCH_ELEMENTS // 4
# The longest chunk of one launch: element offsets inside a kernel are 32-bit.
_MAX_CHUNK = 1 << 30
# Chunk boundaries are sums of these: a quant8 block (256 elements) never straddles two.
assert SCRATCH_ELEMENTS % 256 == 0 and _MAX_CHUNK % 256 == 0, "chunks must hold whole 8-bit blocks"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of positive integers."""
    return -(-a // b)


# The search guide's slices of float values: a float's bits shifted right by 17 (sign
# dropped: 8 exponent bits and the top 6 of the mantissa) name its slice, from 2^-30
# (and everything below) to 2.0 (and everything above; a block's quotient is at most 1).
GUIDE_SHIFT = 17
GUIDE_FIRST = (127 - 30) << 6
GUIDE_SLICES = (128 << 6) - GUIDE_FIRST + 1


def search_guide(midpoints: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantize kernel's tables for a map's ascending fp32 ``midpoints`` (on the CPU):
    the midpoints with two +inf after them, and the guide: per slice ``[a, b)`` of
    absolute values (see ``GUIDE_FIRST``), the count of midpoints below ``a`` (for
    ``v >= +0``), then per slice the count of midpoints ``<= -b`` (for ``v`` in
    ``(-b, -a]``, -0 included). Within a slice lie at most two midpoints (checked:
    six mantissa bits resolve both maps' densest decade), so the count below ``v`` is
    the guide's plus two comparisons, exactly what ``torch.bucketize`` counts."""
    keys = torch.arange(GUIDE_FIRST, GUIDE_FIRST + GUIDE_SLICES + 1, dtype=torch.int32)
    bounds = (keys << GUIDE_SHIFT).view(torch.float32)
    low, high = bounds[:-1].clone(), bounds[1:].clone()
    low[0], high[-1] = 0.0, float("inf")
    positive = torch.bucketize(low, midpoints)
    negative = torch.bucketize(-high, midpoints, right=True)
    within = torch.maximum(
        torch.bucketize(high, midpoints) - positive, torch.bucketize(-low, midpoints, right=True) - negative
    )
    if int(within.max()) > 2:
        raise ValueError("a slice of the search guide holds more than two midpoints: the map is too dense for it")
    padded = torch.cat([midpoints, torch.full((2,), float("inf"))])
    return padded, torch.cat([positive, negative]).to(torch.int32)


# Cached for the process (never evicted): the codec's CUDA graphs hold their addresses.
@functools.cache
def quant8_guide(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`search_guide` of the 8-bit map (``quant8.tables``), on ``device``."""
    return tuple(t.to(device) for t in search_guide(quant8.tables(signed, torch.device("cpu"))[1]))


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` current within the block: nothing to do for the CPU or the current
    device (``torch.cuda.device`` costs host time per call, a bucket's conversions make
    hundreds)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _on_the_tensors_device(convert: Callable) -> Callable:
    """Run ``convert(flat, ...)`` with ``flat``'s device current (``flat`` a tensor, or a
    list of tensors on one device): Triton launches on the current device's current
    stream, where torch's own ops run under the tensor's device; so the launches order
    with the stream the store queued its work on, whichever device is current."""

    @functools.wraps(convert)
    def on_its_device(flat, *args, **kwargs):
        device = (flat if isinstance(flat, torch.Tensor) else flat[0]).device
        with on_device(device):
            return convert(flat, *args, **kwargs)

    return on_its_device


def geometric_chunks(n: int, ratio: int) -> Iterator[tuple[int, int]]:
    """Front-to-back chunks ``[s, e)`` of ``n`` elements for a stored form ``ratio`` times
    smaller than fp32: ``[0, SCRATCH_ELEMENTS)``, then ``[s, ratio * s)``, whose stored
    bytes never overlap their own fp32 bytes (the first chunk's do)."""
    s = 0
    while s < n:
        e = min(n, SCRATCH_ELEMENTS if s == 0 else min(ratio * s, s + _MAX_CHUNK))
        yield s, e
        s = e


def plan_sizes(sizes: list[int], unit: int) -> tuple[list[int], list[list[int]]]:
    """Which of the entries of ``sizes`` elements (0 for one the kernels do not serve) to
    convert one by one, and which packed: groups of the small ones (at most
    ``PACKED_MAX_ELEMENTS`` elements, a multiple of ``unit``: whole 8-bit blocks) in
    their order, ``SCRATCH_ELEMENTS`` at most per group. Indices into ``sizes``."""
    singles: list[int] = []
    groups: list[list[int]] = []
    size = SCRATCH_ELEMENTS
    for k, n in enumerate(sizes):
        if not (0 < n <= PACKED_MAX_ELEMENTS and n % unit == 0):
            singles.append(k)
            continue
        if size + n > SCRATCH_ELEMENTS:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    return singles, groups


def _quantize(kernels: ModuleType, x, codes, scales, guide, n: int, sqrt: bool, block: int) -> None:
    midpoints, slices = guide
    kernels.quantize[(cdiv(cdiv(n, block), BLOCKS_PER_PROGRAM),)](
        x,
        codes,
        scales,
        midpoints,
        slices,
        n,
        SQRT=sqrt,
        BLOCK=block,
        ROWS=BLOCKS_PER_PROGRAM,
        num_warps=WARPS_PER_PROGRAM,
        GUIDE_SHIFT=GUIDE_SHIFT,
        GUIDE_FIRST=GUIDE_FIRST,
        GUIDE_SLICES=GUIDE_SLICES,
    )


def _dequantize(kernels: ModuleType, codes, scales, values, out, n: int, sqrt: bool, block: int) -> None:
    kernels.dequantize[(cdiv(cdiv(n, block), BLOCKS_PER_PROGRAM),)](
        codes, scales, values, out, n, SQUARE=sqrt, BLOCK=block, ROWS=BLOCKS_PER_PROGRAM, num_warps=WARPS_PER_PROGRAM
    )


def _decode_by_rule(kernels: ModuleType, low, param, bits, n: int) -> None:
    kernels.remainder_decode[(cdiv(n, ELEMENTS_PER_PROGRAM),)](
        low, param, bits, n, SPAN=ELEMENTS_PER_PROGRAM, num_warps=WARPS_PER_PROGRAM
    )


# ---- one entry, in place ------------------------------------------------------------


@torch.no_grad()
@_on_the_tensors_device
def quant8_encode(
    flat: torch.Tensor,
    codes_out: torch.Tensor,
    scales: torch.Tensor,
    guide: tuple[torch.Tensor, torch.Tensor],
    sqrt: bool,
    block: int,
    kernels: ModuleType,
) -> None:
    """Codes of the fp32 ``flat`` on the map whose :func:`search_guide` is ``guide`` (on
    ``flat``'s device) into ``codes_out`` (the first bytes of its own storage), its block
    scales into ``scales`` (a separate tensor)."""
    scratch = torch.empty(min(flat.numel(), SCRATCH_ELEMENTS), dtype=torch.uint8, device=flat.device)
    for s, e in geometric_chunks(flat.numel(), ratio=4):
        # The first chunk's codes would land on its own unread elements: via the scratch.
        target = scratch if s == 0 else codes_out[s:e]
        _quantize(kernels, flat[s:e], target, scales[s // block :], guide, e - s, sqrt, block)
        if s == 0:
            codes_out[:e].copy_(scratch[:e])


@torch.no_grad()
@_on_the_tensors_device
def quant8_decode(
    flat: torch.Tensor,
    codes_in: torch.Tensor,
    scales: torch.Tensor,
    values: torch.Tensor,
    sqrt: bool,
    block: int,
    kernels: ModuleType,
) -> None:
    """fp32 values of ``codes_in`` (the first bytes of ``flat``'s storage) on the map
    ``values`` under ``scales`` (a separate tensor) into ``flat``, back to front."""
    for s, e in reversed(list(geometric_chunks(flat.numel(), ratio=4))):
        # The first chunk's fp32 values land on its own codes: read them out first.
        source = codes_in[s:e].clone() if s == 0 else codes_in[s:e]
        _dequantize(kernels, source, scales[s // block :], values, flat[s:e], e - s, sqrt, block)


@torch.no_grad()
@_on_the_tensors_device
def remainder_decode_by_rule(
    flat: torch.Tensor, param: torch.Tensor, low_in: torch.Tensor, kernels: ModuleType
) -> None:
    """Rebuild the fp32 ``flat`` from its low bits ``low_in`` (the first half of its
    storage) and the bf16 ``param``, back to front, the high halves as the rounding rule
    implies them (``remainder.put_exceptions`` corrects the exceptions')."""
    bits, param = flat.view(torch.int32), param.view(torch.int16)
    for s, e in reversed(list(geometric_chunks(flat.numel(), ratio=2))):
        source = low_in[s:e].clone() if s == 0 else low_in[s:e]
        _decode_by_rule(kernels, source, param[s:e], bits[s:e], e - s)


# ---- small entries, packed ------------------------------------------------------------
# Each entry of a group is copied into one packed buffer (one torch.cat), converted there
# out of place by one launch, and copied back (one torch._foreach_copy_, torch's own
# multi-tensor copy): a handful of operations per group instead of per entry. Its
# stored bytes are those of the entry converted alone: blocks start at every entry's
# first element (callers pack only entries of whole 8-bit blocks), low bits are per
# element. The fp32 values are all read (the cat) before any stored byte is written.


@torch.no_grad()
@_on_the_tensors_device
def quant8_encode_packed(
    flats: list[torch.Tensor],
    stored: list[tuple[torch.Tensor, torch.Tensor]],
    guide: tuple[torch.Tensor, torch.Tensor],
    sqrt: bool,
    block: int,
    kernels: ModuleType,
) -> None:
    """:func:`quant8_encode` of each fp32 ``flats[k]`` (whole blocks, one group of
    :func:`plan_sizes`) into ``stored[k]``: the uint8 views of its codes and its scales'
    bytes at the start of its storage (``quant8.codes_and_scales``)."""
    if any(t.numel() % block for t in flats):
        raise ValueError(f"packed 8-bit entries must be whole {block}-element blocks")
    x = torch.cat(flats)
    codes = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    scales = torch.empty(x.numel() // block, dtype=torch.float32, device=x.device)
    _quantize(kernels, x, codes, scales, guide, x.numel(), sqrt, block)
    sizes = [t.numel() for t in flats]
    parts = zip(codes.split(sizes), scales.view(torch.uint8).split([4 * n // block for n in sizes]), strict=True)
    torch._foreach_copy_([v for pair in stored for v in pair], [v for pair in parts for v in pair])


@torch.no_grad()
@_on_the_tensors_device
def quant8_decode_packed(
    flats: list[torch.Tensor],
    stored: list[tuple[torch.Tensor, torch.Tensor]],
    values: torch.Tensor,
    sqrt: bool,
    block: int,
    kernels: ModuleType,
) -> None:
    """:func:`quant8_decode` of each ``stored[k]`` (as :func:`quant8_encode_packed` left
    it) into the fp32 ``flats[k]``."""
    codes = torch.cat([c for c, _ in stored])
    scales = torch.cat([b for _, b in stored]).view(torch.float32)
    x = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    _dequantize(kernels, codes, scales, values, x, x.numel(), sqrt, block)
    torch._foreach_copy_(flats, list(x.split([t.numel() for t in flats])))


@torch.no_grad()
@_on_the_tensors_device
def remainder_decode_by_rule_packed(
    flats: list[torch.Tensor], params: list[torch.Tensor], lows: list[torch.Tensor], kernels: ModuleType
) -> None:
    """:func:`remainder_decode_by_rule` of each ``lows[k]`` (as a packed group of
    ``fused_remainder.RemainderEncoding`` left them) into the fp32 ``flats[k]``."""
    low, p = torch.cat(lows), torch.cat(params)
    x = torch.empty(low.numel(), dtype=torch.float32, device=low.device)
    _decode_by_rule(kernels, low, p.view(torch.int16), x.view(torch.int32), x.numel())
    torch._foreach_copy_(flats, list(x.split([t.numel() for t in flats])))
