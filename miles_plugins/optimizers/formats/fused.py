"""Fused CUDA kernels (Triton) for the 8-bit and remainder codecs: the same bytes as
``quant8.py`` and ``remainder.py``, which stay the reference (and the CPU path).

Why: the reference formulations run a dozen elementwise passes per chunk, and the
remainder encoder waits on the host for every 4M-element chunk's exceptions. A fused kernel reads
each fp32 element once and writes its stored form once.

Exactness: every operation is the reference's IEEE one. ``tl.div_rn`` and ``tl.sqrt_rn``
round correctly (plain ``/`` and ``tl.sqrt`` in Triton are approximate); the code of a
value is the count of map midpoints ``m`` with ``not (m >= v)`` (a binary search),
which is what ``torch.bucketize`` returns on CPU and CUDA, a NaN included (code 255);
a block's scale is ``torch.maximum(amax, -amin).abs()``, NaN when the block holds
one (the NaN's bits may differ: either decodes the whole block to NaN). The GPU tier compares the bytes with the CPU reference.

In place, in few launches: the stored form lives in the first bytes of the fp32
tensor's storage (see ``convert.py``). A chunk of fp32 elements ``[s, e)`` (bytes
``[4s, 4e)``) narrows to bytes ``[ws, we)`` of ``w``-byte codes; the two do not
overlap when ``w * e <= 4 * s``, so one launch may read the chunk and write its codes
directly. Chunks therefore grow geometrically (``[s, 4s / w)``): an entry of ``n``
elements takes ``log(n / SCRATCH_ELEMENTS)`` launches, and only the first chunk,
which overlaps itself, goes through a scratch of ``SCRATCH_ELEMENTS`` codes.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from miles_plugins.optimizers.formats.convert import CHUNK_ELEMENTS

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


# MILES_FUSED_CODEC=0 keeps the reference formulations on CUDA too (a kill switch; the
# codec bench also flips it to time both in one process).
enabled = os.environ.get("MILES_FUSED_CODEC", "1") != "0"


@functools.cache
def kernels() -> ModuleType | None:
    """The kernels' module, imported and compiled on first use (Triton takes a while to
    import, and CPU hosts need none of it); None where Triton is not installed or the
    kernels do not build here (then the reference formulations serve, with a warning)."""
    try:
        from miles_plugins.optimizers.formats import triton_kernels
    except ImportError:
        return None
    try:
        _compile(triton_kernels)
    except Exception as exc:  # a compiler or cache directory that fails here: at setup, not mid-step
        logger.warning("fused codec kernels unavailable (%s: %s); using the torch reference", type(exc).__name__, exc)
        return None
    return triton_kernels


def _compile(module: ModuleType) -> None:
    """Build every kernel by running it once on a small tensor of the current device
    (Triton compiles at first launch): a failure shows here, before any state is converted."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton's interpreter
    from miles_plugins.optimizers.formats import quant8, remainder

    for signed, sqrt in quant8.MOMENT_FORMATS.values():
        t = torch.ones(2 * quant8.BLOCK, device=device)
        codes, scales = quant8._codes_and_scales(t)
        scale = torch.empty(2, device=device)
        values, midpoints = quant8._tables(signed, t.device)
        quant8_narrow(t.view(-1), codes, scale, midpoints, sqrt, quant8.BLOCK, module)
        quant8_widen(t.view(-1), codes, scale, values, sqrt, quant8.BLOCK, module)
    main = torch.ones(16, device=device)
    param = main.bfloat16()
    low = remainder.stored_view(main, remainder.STORAGE_DTYPE)
    index, high = remainder_encode(main, param, low, None, module)
    remainder_decode(main, param, low, index, high, module)
    if device == "cuda":
        torch.cuda.synchronize()


def applies(t: torch.Tensor) -> bool:
    """Whether the fused kernels serve ``t``: a CUDA tensor, Triton installed, not switched off."""
    return enabled and t.is_cuda and kernels() is not None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    (a separate tensor). ``module``: the kernels (``kernels()`` when not given)."""
    module = module or kernels()
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
    module = module or kernels()
    for s, e in reversed(list(geometric_chunks(flat.numel(), widen=4))):
        # The first chunk's fp32 values land on its own codes: read them out first.
        source = codes_in[s:e].clone() if s == 0 else codes_in[s:e]
        module.dequantize[_blocks_grid(e - s, block)](
            source, scales[s // block :], values, flat[s:e], e - s, SQUARE=sqrt, BLOCK=block, ROWS=_ROWS
        )


@torch.no_grad()
def remainder_encode(
    flat: torch.Tensor, param: torch.Tensor, low_out: torch.Tensor, reference, module: ModuleType | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Low 16 bits of the fp32 ``flat`` into ``low_out`` (the first half of its storage);
    returns the exceptions (flat indices ascending, true high bits) on the CPU.
    ``reference(s, e)`` finds a chunk's exceptions the slow way, from its still unwritten
    fp32 elements, when they overflow the device's slots."""
    module = module or kernels()
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
    module = module or kernels()
    bits, param = flat.view(torch.int32), param.view(torch.int16)
    for s, e in reversed(list(geometric_chunks(flat.numel(), widen=2))):
        source = low_in[s:e].clone() if s == 0 else low_in[s:e]
        module.remainder_decode[(_cdiv(e - s, _SPAN),)](source, param[s:e], bits[s:e], e - s, SPAN=_SPAN)
    if index.numel():
        flat.view(torch.int16).view(-1, 2)[:, 1][index.to(flat.device)] = high.to(flat.device)
