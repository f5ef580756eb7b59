"""Fused CUDA kernels (Triton) for the 8-bit and remainder codecs: the same bytes as
``quant8.py`` and ``remainder.py``, which stay the reference (and the CPU path).

Why: the reference formulations run a dozen elementwise passes per chunk, and the
remainder encoder waits on the host for every 4M-element chunk's exceptions. A fused kernel reads
each fp32 element once and writes its stored form once.

Exactness: every operation is the reference's IEEE one. ``tl.div_rn`` and ``tl.sqrt_rn``
round correctly (plain ``/`` and ``tl.sqrt`` in Triton are approximate), and subnormal
operands are first scaled by powers of two (exact), since Triton builds before
triton-lang/triton#8557 flush them to zero in those two; the code of a
value is the count of map midpoints ``m`` with ``not (m >= v)`` (a binary search),
which is what ``torch.bucketize`` returns on CPU and CUDA, a NaN included (code 255);
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
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

from miles_plugins.optimizers.formats.convert import CHUNK_ELEMENTS, chunks

logger = logging.getLogger(__name__)

# The first chunk of an entry, which overlaps its own stored form, goes through a
# scratch of this many codes: at most 4 bytes each (16 MiB), within the conversion
# scratch the store states (``store.CONVERSION_SCRATCH_BYTES``).
SCRATCH_ELEMENTS = CHUNK_ELEMENTS
# Blocks of 256 elements per Triton program (quant8), elements per program (remainder).
_ROWS = 4
_SPAN = 4096
# Remainder exceptions collected per launch on the device; past it (a chunk full of
# NaN mains, say) that chunk's exceptions are found by the reference path instead.
_EXCEPTION_SLOTS = 1 << 16
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
        quant8_narrow(t.view(-1), codes, scales, quant8._tables(signed, device)[1], sqrt, block, module)
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
        fallback = functools.partial(remainder._exceptions, t.view(-1), p.view(-1))  # slots overflowed
        index, high = remainder_encode(t.view(-1), p.view(-1), low, fallback, module)
        _same("remainder low bits", remainder.stored_view(expected, remainder.STORAGE_DTYPE), low.cpu())
        found = torch.cat([index, high.long()])
        _same("remainder exceptions", torch.cat([exceptions.index, exceptions.high.long()]), found)
        remainder_decode(t.view(-1), p.view(-1), low, index, high, module)
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


def _on_the_tensors_device(convert: Callable) -> Callable:
    """Run ``convert(flat, ...)`` with ``flat``'s device current: Triton launches on the
    current device's current stream, where torch's own ops run under the tensor's device;
    so the launches order with the stream the store queued its work on, whichever
    device is current."""

    @functools.wraps(convert)
    def on_device(flat: torch.Tensor, *args, **kwargs):
        with torch.cuda.device(flat.device) if flat.is_cuda else contextlib.nullcontext():
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


def _blocks_grid(n: int, block: int) -> tuple[int]:
    return (_cdiv(_cdiv(n, block), _ROWS),)


@torch.no_grad()
@_on_the_tensors_device
def quant8_narrow(
    flat: torch.Tensor,
    codes_out: torch.Tensor,
    scales: torch.Tensor,
    midpoints: torch.Tensor,
    sqrt: bool,
    block: int,
    module: ModuleType | None = None,
) -> None:
    """Codes of the fp32 ``flat`` on the map whose ``midpoints`` are given into
    ``codes_out`` (the first bytes of its own storage), its block scales into ``scales``
    (a separate tensor). ``module``: the kernels (``kernels(flat.device)`` when not given)."""
    module = module or kernels(flat.device)
    scratch = torch.empty(min(flat.numel(), SCRATCH_ELEMENTS), dtype=torch.uint8, device=flat.device)
    for s, e in geometric_chunks(flat.numel(), widen=4):
        # The first chunk's codes would land on its own unread elements: via the scratch.
        target = scratch if s == 0 else codes_out[s:e]
        module.quantize[_blocks_grid(e - s, block)](
            flat[s:e], target, scales[s // block :], midpoints, e - s, SQRT=sqrt, BLOCK=block, ROWS=_ROWS
        )
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
        module.dequantize[_blocks_grid(e - s, block)](
            source, scales[s // block :], values, flat[s:e], e - s, SQUARE=sqrt, BLOCK=block, ROWS=_ROWS
        )


@torch.no_grad()
@_on_the_tensors_device
def remainder_encode(
    flat: torch.Tensor, param: torch.Tensor, low_out: torch.Tensor, reference, module: ModuleType | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Low 16 bits of the fp32 ``flat`` into ``low_out`` (the first half of its storage);
    returns the exceptions (flat indices ascending, true high bits) on the CPU.
    ``reference(s, e)`` finds a chunk's exceptions the slow way, from its still unwritten
    fp32 elements, when they overflow the device's slots."""
    module = module or kernels(flat.device)
    bits, param = flat.view(torch.int32), param.view(torch.int16)
    device = flat.device
    scratch = torch.empty(min(flat.numel(), SCRATCH_ELEMENTS), dtype=torch.int16, device=device)
    slot = torch.zeros(1, dtype=torch.int32, device=device)
    index = torch.empty(_EXCEPTION_SLOTS, dtype=torch.int64, device=device)
    high = torch.empty(_EXCEPTION_SLOTS, dtype=torch.int16, device=device)
    indices, highs = [], []
    for s, e in geometric_chunks(flat.numel(), widen=2):
        target = scratch if s == 0 else low_out[s:e]
        slot.zero_()
        grid = (_cdiv(e - s, _SPAN),)
        module.remainder_encode[grid](
            bits[s:e], param[s:e], target, slot, index, high, e - s, s, SLOTS=_EXCEPTION_SLOTS, SPAN=_SPAN
        )
        # One host read per chunk (log n per entry): this chunk's fp32 bytes are still
        # unwritten (the next chunk's lows land on them), so an overflow can fall back.
        found = int(slot.item())
        if found > _EXCEPTION_SLOTS:
            chunk_index, chunk_high = reference(s, e)
            indices.append(chunk_index)
            highs.append(chunk_high)
        elif found:
            order = torch.argsort(index[:found])
            indices.append(index[:found][order].cpu())
            highs.append(high[:found][order].cpu())
        if s == 0:
            low_out[:e].copy_(scratch[:e])
    if not indices:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int16)
    return torch.cat(indices), torch.cat(highs)


@torch.no_grad()
@_on_the_tensors_device
def remainder_decode(
    flat: torch.Tensor,
    param: torch.Tensor,
    low_in: torch.Tensor,
    index: torch.Tensor,
    high: torch.Tensor,
    module: ModuleType | None = None,
) -> None:
    """Rebuild the fp32 ``flat`` from its low bits ``low_in`` (the first half of its
    storage), the bf16 ``param`` and the exceptions, back to front."""
    module = module or kernels(flat.device)
    bits, param = flat.view(torch.int32), param.view(torch.int16)
    for s, e in reversed(list(geometric_chunks(flat.numel(), widen=2))):
        source = low_in[s:e].clone() if s == 0 else low_in[s:e]
        module.remainder_decode[(_cdiv(e - s, _SPAN),)](source, param[s:e], bits[s:e], e - s, SPAN=_SPAN)
    # The exceptions' true high halves, a conversion chunk at a time (as the reference):
    # their device copies stay within the conversion scratch, however many there are.
    highs = flat.view(torch.int16).view(-1, 2)[:, 1]
    for s, e in chunks(flat.numel()) if index.numel() else ():
        first, last = torch.searchsorted(index, torch.tensor([s, e], device=index.device)).tolist()
        if last > first:
            highs[index[first:last].to(flat.device)] = high[first:last].to(flat.device)
