"""Fused CUDA kernels (Triton) for the 8-bit and remainder codecs: the same bytes as
``quant8.py`` and ``remainder.py``, which stay the reference (and the CPU path).

Why: the reference formulations run a dozen elementwise passes per chunk, and the
remainder encoder waits on the host for every 4M-element chunk's exceptions. A fused kernel reads
each fp32 element once and writes its stored form once.

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
compares the bytes with the CPU reference, and so does a self-test on crafted values
when the kernels are first wanted: a Triton that does not build them, or builds them
to other bytes, leaves the reference in charge, with a warning.

In place, in few launches: the stored form lives in the first bytes of the fp32
tensor's storage (see ``convert.py``). A chunk of fp32 elements ``[s, e)`` (bytes
``[4s, 4e)``) narrows to bytes ``[ws, we)`` of ``w``-byte codes; the two do not
overlap when ``w * e <= 4 * s``, so one launch may read the chunk and write its codes
directly. Chunks therefore grow geometrically (``[s, 4s / w)``): an entry of ``n``
elements takes ``log(n / SCRATCH_ELEMENTS)`` launches, and only the first chunk,
which overlaps itself, goes through a scratch of ``SCRATCH_ELEMENTS`` codes.

Small entries (biases, norms) cost host time per operation, not device time per
byte: a bucket's are converted packed (``plan_packed``), out of place in one buffer
per group, with a handful of operations per group.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

from miles_plugins.optimizers.formats.convert import CHUNK_ELEMENTS

logger = logging.getLogger(__name__)

# The first chunk of an entry, which overlaps its own stored form, goes through a
# scratch of this many codes: at most 4 bytes each (16 MiB), within the conversion
# scratch the store states (``store.CONVERSION_SCRATCH_BYTES``).
SCRATCH_ELEMENTS = CHUNK_ELEMENTS
# Blocks of 256 elements per Triton program (quant8), elements per program (remainder),
# warps per program (all kernels).
_ROWS = 16
_SPAN = 4096
_WARPS = 4
# Remainder exceptions collected on the device per run of chunks; past it (a chunk full
# of NaN mains, say) that chunk's exceptions are found by the reference path instead.
_EXCEPTION_SLOTS = 1 << 16
# Entries of at most this many elements (biases, norms: two thirds of a GPT's entries)
# are converted packed, a group at a time (``plan_packed``): their conversion costs
# host time per operation, not device time per byte.
PACKED_MAX_ELEMENTS = SCRATCH_ELEMENTS // 4
# Chunks of one remainder run (the encoder's exception counts per chunk): 4M elements,
# then doubling to _MAX_CHUNK, then _MAX_CHUNK each; far past any entry Megatron builds.
_MAX_RUN_CHUNKS = 32
assert _MAX_RUN_CHUNKS & (_MAX_RUN_CHUNKS - 1) == 0, "the kernel loads the counts with tl.arange: a power of two"
# The longest chunk of one launch: element offsets inside a kernel are 32-bit.
_MAX_CHUNK = 1 << 30
# Chunk boundaries are sums of these: a quant8 block (256 elements) never straddles two.
assert SCRATCH_ELEMENTS % 256 == 0 and _MAX_CHUNK % 256 == 0, "chunks must hold whole 8-bit blocks"


# MILES_FUSED_CODEC=0 keeps the reference formulations on CUDA too (a kill switch; the
# codec bench also flips it to time both in one process).
enabled = os.environ.get("MILES_FUSED_CODEC", "1") != "0"


def kernels(device: torch.device | None = None) -> ModuleType | None:
    """The kernels' module for ``device`` (the current CUDA device when not given),
    imported, compiled and checked there on first use (Triton takes a while to import,
    and CPU hosts need none of it); None where Triton is not installed, or the kernels do
    not build there or give other bytes than the reference (then the reference
    formulations serve, with a warning, for the rest of the process)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _checked_kernels(device)


@functools.cache
def _checked_kernels(device: torch.device) -> ModuleType | None:
    try:
        from miles_plugins.optimizers.formats import triton_kernels
    except ImportError:
        return None
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            _self_test(triton_kernels, device)
    except Exception as exc:  # a compiler, cache directory or Triton version that fails here, not mid-step
        logger.warning(
            "fused codec kernels unavailable on %s (%s: %s); using the torch reference", device, type(exc).__name__, exc
        )
        return None
    return triton_kernels


def _self_test(module: ModuleType, device: torch.device) -> None:
    """Build every kernel (Triton compiles at first launch) on crafted values on
    ``device`` (the CPU under Triton's interpreter) and compare what it stores with the
    reference on the CPU: exact ties, zero (both signs), subnormal, infinite and NaN
    values, remainder exceptions. Raises where a byte differs."""
    from miles_plugins.optimizers.formats import quant8, remainder

    cpu, block = torch.device("cpu"), quant8.BLOCK
    x = torch.zeros(6 * block + 7, device=cpu)  # block 0 all +0; a partial last block
    x[block] = 1.0  # scale 1: the next values are the signed map's midpoints themselves (ties)
    x[block + 1 : 2 * block] = quant8._tables(True, cpu)[1]
    x[2 * block : 3 * block] = torch.linspace(-1, 1, block, device=cpu) * 1e-39  # subnormal
    x[3 * block + 5], x[4 * block + 9] = float("inf"), float("nan")
    x[3 * block + 6 : 4 * block] = torch.linspace(-3, 2, block - 6, device=cpu)
    x[5 * block : 6 * block] = -0.0
    x[6 * block :] = torch.tensor([3.0, -2.5, 1e-3, -7.0, 0.5, 1e-45, -0.0], device=cpu)
    # Two lengths, one a multiple of 16 and one not: Triton specializes a kernel on that.
    cases = [(name, v[:n]) for name, v in (("exp_avg", x), ("exp_avg_sq", x.abs())) for n in (4 * block, x.numel())]
    for name, values in cases:
        signed, sqrt = quant8.MOMENT_FORMATS[name]
        expected, t = values.clone(), values.to(device, copy=True)
        quant8.narrow_in_place(expected, signed, sqrt)
        codes, scale_bytes = quant8._codes_and_scales(t)
        scales = torch.empty(-(-t.numel() // block), device=device)
        quant8_narrow(t.view(-1), codes, scales, quant8._search_guide(signed, device), sqrt, block, module)
        scale_bytes.copy_(scales.view(torch.uint8))
        _same(name + " codes", expected.view(torch.uint8)[: t.numel()], codes.cpu())
        _same(
            name + " scales",
            expected.view(torch.uint8)[t.numel() : quant8.stored_nbytes(t.numel())].clone(),
            scales.cpu(),
        )
        quant8.widen_in_place(expected, signed, sqrt)
        quant8_widen(t.view(-1), codes, scales, quant8._tables(signed, device)[0], sqrt, block, module)
        _same(name + " values", expected, t.cpu())
    for length in (3 * block, 3 * block + 5):
        main = torch.linspace(-4, 4, length, device=cpu)
        bits = main.view(torch.int32)
        bits[::7] = (bits[::7] & ~0xFFFF) | 0x18000  # exact ties with an odd high half: exceptions
        main[3], main[4], main[5] = float("nan"), float("-inf"), 1e-40
        param = main.bfloat16()
        expected = main.clone()
        exceptions = remainder.encode_in_place(expected, param)
        t, p = main.to(device, copy=True), param.to(device, copy=True)
        low = remainder.stored_view(t, remainder.STORAGE_DTYPE)
        index, high = remainder_encode(t.view(-1), p.view(-1), low, remainder._exceptions, module)
        _same("remainder low bits", remainder.stored_view(expected, remainder.STORAGE_DTYPE), low.cpu())
        found = torch.cat([index, high.long()])
        _same("remainder exceptions", torch.cat([exceptions.index, exceptions.high.long()]), found)
        remainder_widen(t.view(-1), p.view(-1), low, module)
        put_exceptions(t.view(-1), index, high)
        _same("remainder mains", main.view(torch.int32), t.cpu().view(torch.int32))  # every bit, NaN's too


def _same(what: str, expected: torch.Tensor, got: torch.Tensor) -> None:
    """Raise unless ``got`` holds ``expected``'s bytes (fp32 NaNs: any NaN, since their bits differ by device)."""
    if expected.dtype == torch.uint8 and got.dtype == torch.float32:
        expected = expected.view(torch.float32)
    if expected.dtype == torch.float32:
        nan = torch.isnan(expected)
        if not torch.equal(nan, torch.isnan(got)):
            raise RuntimeError(f"self-test: {what}: NaN elsewhere than the reference's")
        expected, got = expected[~nan].view(torch.int32), got[~nan].view(torch.int32)
    if not torch.equal(expected, got):
        raise RuntimeError(f"self-test: {what}: other bytes than the reference's")


def applies(t: torch.Tensor) -> bool:
    """Whether the fused kernels serve ``t``: a CUDA tensor, Triton installed, not switched off."""
    return enabled and t.is_cuda and kernels(t.device) is not None


def _cdiv(a: int, b: int) -> int:
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


def _on_the_tensors_device(convert: Callable) -> Callable:
    """Run ``convert(flat, ...)`` with ``flat``'s device current (``flat`` a tensor, or a
    list of tensors on one device): Triton launches on the current device's current
    stream, where torch's own ops run under the tensor's device; so the launches order
    with the stream the store queued its work on, whichever device is current."""

    @functools.wraps(convert)
    def on_device(flat, *args, **kwargs):
        device = (flat if isinstance(flat, torch.Tensor) else flat[0]).device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return convert(flat, *args, **kwargs)

    return on_device


def geometric_chunks(n: int, widen: int) -> Iterator[tuple[int, int]]:
    """Front-to-back chunks ``[s, e)`` of ``n`` elements for a stored form ``widen`` times
    narrower than fp32: ``[0, SCRATCH_ELEMENTS)``, then ``[s, widen * s)``, whose stored
    bytes never overlap their own fp32 bytes (the first chunk's do)."""
    s = 0
    while s < n:
        e = min(n, SCRATCH_ELEMENTS if s == 0 else min(widen * s, s + _MAX_CHUNK))
        yield s, e
        s = e


def plan_packed(tensors: list[torch.Tensor], unit: int = 1) -> tuple[list[int], list[list[int]]]:
    """Which of ``tensors`` (one kind of conversion) to convert one by one, and which
    packed: groups of the small ones (at most ``PACKED_MAX_ELEMENTS`` elements, a
    multiple of ``unit``: whole 8-bit blocks) in their order, ``SCRATCH_ELEMENTS`` at
    most per group, where the fused kernels serve. Indices into ``tensors``."""
    singles: list[int] = []
    groups: list[list[int]] = []
    size = SCRATCH_ELEMENTS
    for k, t in enumerate(tensors):
        n = t.numel()
        if not (0 < n <= PACKED_MAX_ELEMENTS and n % unit == 0 and applies(t)):
            singles.append(k)
            continue
        if size + n > SCRATCH_ELEMENTS:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    return singles, groups


def _quantize(module, x, codes, scales, guide, n: int, sqrt: bool, block: int) -> None:
    midpoints, slices = guide
    module.quantize[(_cdiv(_cdiv(n, block), _ROWS),)](
        x,
        codes,
        scales,
        midpoints,
        slices,
        n,
        SQRT=sqrt,
        BLOCK=block,
        ROWS=_ROWS,
        num_warps=_WARPS,
        GUIDE_SHIFT=GUIDE_SHIFT,
        GUIDE_FIRST=GUIDE_FIRST,
        GUIDE_SLICES=GUIDE_SLICES,
    )


def _dequantize(module, codes, scales, values, out, n: int, sqrt: bool, block: int) -> None:
    module.dequantize[(_cdiv(_cdiv(n, block), _ROWS),)](
        codes, scales, values, out, n, SQUARE=sqrt, BLOCK=block, ROWS=_ROWS, num_warps=_WARPS
    )


def _remainder_encode(module, bits, param, low, counts, chunk: int, index, high, n: int, base: int) -> None:
    module.remainder_encode[(_cdiv(n, _SPAN),)](
        bits,
        param,
        low,
        counts,
        chunk,
        index,
        high,
        n,
        base,
        SLOTS=_EXCEPTION_SLOTS,
        SPAN=_SPAN,
        CHUNKS=_MAX_RUN_CHUNKS,
        num_warps=_WARPS,
    )


def _remainder_decode(module, low, param, bits, n: int) -> None:
    module.remainder_decode[(_cdiv(n, _SPAN),)](low, param, bits, n, SPAN=_SPAN, num_warps=_WARPS)


def _exception_slots(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-chunk exception counts, and the slots for their indices and high halves."""
    return (
        torch.zeros(_MAX_RUN_CHUNKS, dtype=torch.int32, device=device),
        torch.empty(_EXCEPTION_SLOTS, dtype=torch.int64, device=device),
        torch.empty(_EXCEPTION_SLOTS, dtype=torch.int16, device=device),
    )


def _starts(sizes: list[int]) -> list[int]:
    """Where each of consecutive pieces of ``sizes`` elements starts."""
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    return starts


def _sorted_on_host(index: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exceptions found on the device, on the host, by index (sorted there: usually
    a few thousand, at most ``_EXCEPTION_SLOTS``, where a device sort costs more host
    time than the sort itself)."""
    index, high = index.cpu(), high.cpu()
    order = torch.argsort(index)
    return index[order], high[order]


# ---- one entry, in place ------------------------------------------------------------


@torch.no_grad()
@_on_the_tensors_device
def quant8_narrow(
    flat: torch.Tensor,
    codes_out: torch.Tensor,
    scales: torch.Tensor,
    guide: tuple[torch.Tensor, torch.Tensor],
    sqrt: bool,
    block: int,
    module: ModuleType | None = None,
) -> None:
    """Codes of the fp32 ``flat`` on the map whose :func:`search_guide` is ``guide`` (on
    ``flat``'s device) into ``codes_out`` (the first bytes of its own storage), its block
    scales into ``scales`` (a separate tensor). ``module``: the kernels
    (``kernels(flat.device)`` when not given)."""
    module = module or kernels(flat.device)
    scratch = torch.empty(min(flat.numel(), SCRATCH_ELEMENTS), dtype=torch.uint8, device=flat.device)
    for s, e in geometric_chunks(flat.numel(), widen=4):
        # The first chunk's codes would land on its own unread elements: via the scratch.
        target = scratch if s == 0 else codes_out[s:e]
        _quantize(module, flat[s:e], target, scales[s // block :], guide, e - s, sqrt, block)
        if s == 0:
            codes_out[:e].copy_(scratch[:e])


@torch.no_grad()
@_on_the_tensors_device
def quant8_widen(
    flat: torch.Tensor,
    codes_in: torch.Tensor,
    scales: torch.Tensor,
    values: torch.Tensor,
    sqrt: bool,
    block: int,
    module: ModuleType | None = None,
) -> None:
    """fp32 values of ``codes_in`` (the first bytes of ``flat``'s storage) on the map
    ``values`` under ``scales`` (a separate tensor) into ``flat``, back to front."""
    module = module or kernels(flat.device)
    for s, e in reversed(list(geometric_chunks(flat.numel(), widen=4))):
        # The first chunk's fp32 values land on its own codes: read them out first.
        source = codes_in[s:e].clone() if s == 0 else codes_in[s:e]
        _dequantize(module, source, scales[s // block :], values, flat[s:e], e - s, sqrt, block)


@torch.no_grad()
@_on_the_tensors_device
def remainder_encode(
    flat: torch.Tensor, param: torch.Tensor, low_out: torch.Tensor, reference, module: ModuleType | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Low 16 bits of the fp32 ``flat`` into ``low_out`` (the first half of its storage);
    returns the exceptions (flat indices ascending, true high bits) on the CPU.
    ``reference(flat, param, s, e)`` finds the exceptions of elements ``[s, e)`` the slow
    way, from their still unwritten fp32 values, when they overflow the device's slots.

    One host read per entry, not per chunk: the chunks are launched as one run, each
    standing down once the earlier ones overflowed the slots (the kernel checks), so the
    overflowing chunk's fp32 elements, which the next chunk's low bits would land on,
    are still there for ``reference``; the run then resumes after it. The first chunk's
    low bits wait in the scratch until that read (their place is its own fp32 bytes)."""
    module = module or kernels(flat.device)
    bits, param16 = flat.view(torch.int32), param.view(torch.int16)
    spans = list(geometric_chunks(flat.numel(), widen=2))
    if not spans:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int16)
    scratch = torch.empty(spans[0][1], dtype=torch.int16, device=flat.device)
    counts, index, high = _exception_slots(flat.device)
    found: list[tuple[torch.Tensor, torch.Tensor]] = []
    first = 0
    while first < len(spans):
        run = spans[first : first + _MAX_RUN_CHUNKS]
        counts.zero_()
        for chunk, (s, e) in enumerate(run):
            target = scratch if s == 0 else low_out[s:e]
            _remainder_encode(module, bits[s:e], param16[s:e], target, counts, chunk, index, high, e - s, s)
        ran, total = 0, 0
        for count in counts[: len(run)].tolist():  # the entry's one wait on the device
            if count < 0 or total + count > _EXCEPTION_SLOTS:
                break
            ran, total = ran + 1, total + count
        if total:
            found.append(_sorted_on_host(index[:total], high[:total]))
        if ran < len(run):  # chunk `ran` overflowed (those after it stood down)
            found.append(reference(flat, param, *run[ran]))
        if first == 0:  # the first chunk is done either way (found, or by the reference now)
            low_out[: spans[0][1]].copy_(scratch)
        first += ran + (ran < len(run))  # past the overflowing chunk, or the whole run
    if len(found) <= 1:
        return found[0] if found else (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int16))
    return torch.cat([i for i, _ in found]), torch.cat([h for _, h in found])


@torch.no_grad()
@_on_the_tensors_device
def remainder_widen(
    flat: torch.Tensor, param: torch.Tensor, low_in: torch.Tensor, module: ModuleType | None = None
) -> None:
    """Rebuild the fp32 ``flat`` from its low bits ``low_in`` (the first half of its
    storage) and the bf16 ``param``, back to front, the high halves as the rounding rule
    implies them (:func:`put_exceptions` corrects the exceptions')."""
    module = module or kernels(flat.device)
    bits, param = flat.view(torch.int32), param.view(torch.int16)
    for s, e in reversed(list(geometric_chunks(flat.numel(), widen=2))):
        source = low_in[s:e].clone() if s == 0 else low_in[s:e]
        _remainder_decode(module, source, param[s:e], bits[s:e], e - s)


@torch.no_grad()
def put_exceptions(flat: torch.Tensor, index: torch.Tensor, high: torch.Tensor) -> None:
    """The exceptions' true high halves (``index``, ``high``: on the CPU) into the fp32
    ``flat``, in groups whose device copies stay within the conversion scratch (10
    bytes each): usually one group."""
    highs = flat.view(torch.int16).view(-1, 2)[:, 1]
    group = CHUNK_ELEMENTS // 4
    for s in range(0, index.numel(), group):
        highs[_to_device(index[s : s + group], flat.device)] = _to_device(high[s : s + group], flat.device)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the CPU) on ``device``. To CUDA through a pinned copy: from pageable memory
    a copy holds the host until the device has run everything queued before it (an
    entry's decode), which then idles while the host catches up."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# ---- small entries, packed ------------------------------------------------------------
# Each entry of a group is copied into one packed buffer (one torch.cat), converted there
# out of place by one launch, and copied back (one torch._foreach_copy_, torch's own
# multi-tensor copy): a handful of operations per group instead of per entry. Its
# stored bytes are those of the entry converted alone: blocks start at every entry's
# first element (callers pack only entries of whole 8-bit blocks), low bits are per
# element. The fp32 values are all read (the cat) before any stored byte is written.


@torch.no_grad()
@_on_the_tensors_device
def quant8_narrow_packed(
    flats: list[torch.Tensor],
    stored: list[tuple[torch.Tensor, torch.Tensor]],
    guide: tuple[torch.Tensor, torch.Tensor],
    sqrt: bool,
    block: int,
    module: ModuleType | None = None,
) -> None:
    """:func:`quant8_narrow` of each fp32 ``flats[k]`` (whole blocks, one group of
    :func:`plan_packed`) into ``stored[k]``: the uint8 views of its codes and its scales'
    bytes at the start of its storage (``quant8._codes_and_scales``)."""
    module = module or kernels(flats[0].device)
    if any(t.numel() % block for t in flats):
        raise ValueError(f"packed 8-bit entries must be whole {block}-element blocks")
    x = torch.cat(flats)
    codes = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    scales = torch.empty(x.numel() // block, dtype=torch.float32, device=x.device)
    _quantize(module, x, codes, scales, guide, x.numel(), sqrt, block)
    sizes = [t.numel() for t in flats]
    parts = zip(codes.split(sizes), scales.view(torch.uint8).split([4 * n // block for n in sizes]), strict=True)
    torch._foreach_copy_([v for pair in stored for v in pair], [v for pair in parts for v in pair])


@torch.no_grad()
@_on_the_tensors_device
def quant8_widen_packed(
    flats: list[torch.Tensor],
    stored: list[tuple[torch.Tensor, torch.Tensor]],
    values: torch.Tensor,
    sqrt: bool,
    block: int,
    module: ModuleType | None = None,
) -> None:
    """:func:`quant8_widen` of each ``stored[k]`` (as :func:`quant8_narrow_packed` left
    it) into the fp32 ``flats[k]``."""
    module = module or kernels(flats[0].device)
    codes = torch.cat([c for c, _ in stored])
    scales = torch.cat([b for _, b in stored]).view(torch.float32)
    x = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    _dequantize(module, codes, scales, values, x, x.numel(), sqrt, block)
    torch._foreach_copy_(flats, list(x.split([t.numel() for t in flats])))


@torch.no_grad()
@_on_the_tensors_device
def remainder_encode_packed(
    flats: list[torch.Tensor],
    params: list[torch.Tensor],
    lows: list[torch.Tensor],
    reference,
    module: ModuleType | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`remainder_encode` of each fp32 ``flats[k]`` (one group of
    :func:`plan_packed`) into ``lows[k]``; per entry its exceptions on the CPU. One host
    read for the group; past the slots, ``reference`` finds them in the packed copy."""
    module = module or kernels(flats[0].device)
    x, p = torch.cat(flats), torch.cat(params)
    low = torch.empty(x.numel(), dtype=torch.int16, device=x.device)
    counts, index, high = _exception_slots(x.device)
    _remainder_encode(module, x.view(torch.int32), p.view(torch.int16), low, counts, 0, index, high, x.numel(), 0)
    sizes = [t.numel() for t in flats]
    torch._foreach_copy_(lows, list(low.split(sizes)))
    del low  # before a fallback's own scratch
    total = int(counts[0])  # the group's one wait on the device
    if total > _EXCEPTION_SLOTS:  # the packed copy is intact: the reference finds them there
        index, high = reference(x, p, 0, x.numel())
    else:
        index, high = _sorted_on_host(index[:total], high[:total])
    starts = _starts(sizes)
    bounds = torch.searchsorted(index, torch.tensor(starts + [x.numel()])).tolist()
    return [(index[a:b] - s, high[a:b]) for a, b, s in zip(bounds, bounds[1:], starts, strict=False)]


@torch.no_grad()
@_on_the_tensors_device
def remainder_widen_packed(
    flats: list[torch.Tensor], params: list[torch.Tensor], lows: list[torch.Tensor], module: ModuleType | None = None
) -> None:
    """:func:`remainder_widen` of each ``lows[k]`` (as :func:`remainder_encode_packed`
    left them) into the fp32 ``flats[k]``."""
    module = module or kernels(flats[0].device)
    low, p = torch.cat(lows), torch.cat(params)
    x = torch.empty(low.numel(), dtype=torch.float32, device=low.device)
    _remainder_decode(module, low, p.view(torch.int16), x.view(torch.int32), x.numel())
    torch._foreach_copy_(flats, list(x.split([t.numel() for t in flats])))
