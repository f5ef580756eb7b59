"""Fused CUDA kernels (Triton) for the 8-bit and remainder codecs: the same bytes as
``quant8.py`` and ``remainder.py``, which stay the reference (and the CPU path).

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
# scratch the store states (``store.bounds.CONVERSION_SCRATCH_BYTES``).
SCRATCH_ELEMENTS = CHUNK_ELEMENTS
# Blocks of 256 elements per Triton program (quant8), elements per program (remainder),
# warps per program (all kernels).
_ROWS = 16
_SPAN = 4096
_WARPS = 4
# Remainder exceptions collected on the device, per run of the encoder (an entry's
# chunks, or a packed group): slots for one element in 4096, at least 1024 (a trained
# model's rate is about one in 2**17). Past them (a chunk full of NaN mains, say) that
# chunk's exceptions are found by the reference path instead.
_SLOTS_MIN = 1 << 10
_ELEMENTS_PER_SLOT = 1 << 12
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
    # Here, not at the top: the self-test drives the kernels through this module's functions.
    from miles_plugins.optimizers.formats.kernel_self_test import self_test

    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            self_test(triton_kernels, device)
    except Exception as exc:  # a compiler, cache directory or Triton version that fails here, not mid-step
        logger.warning(
            "fused codec kernels unavailable on %s (%s: %s); using the torch reference", device, type(exc).__name__, exc
        )
        return None
    return triton_kernels


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
    return _plan_sizes([t.numel() if applies(t) else 0 for t in tensors], unit)


def _plan_sizes(sizes: list[int], unit: int) -> tuple[list[int], list[list[int]]]:
    """:func:`plan_packed` of tensors of ``sizes`` elements (0 for one the kernels do not serve)."""
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


def _remainder_encode(module, bits, param, low, counts, chunk: int, found, n: int, base: int, capacity: int):
    module.remainder_encode[(_cdiv(n, _SPAN),)](
        bits, param, low, counts, chunk, found, n, base, capacity, SPAN=_SPAN, CHUNKS=_MAX_RUN_CHUNKS, num_warps=_WARPS
    )


def _remainder_decode(module, low, param, bits, n: int) -> None:
    module.remainder_decode[(_cdiv(n, _SPAN),)](low, param, bits, n, SPAN=_SPAN, num_warps=_WARPS)


def _starts(sizes: list[int]) -> list[int]:
    """Where each of consecutive pieces of ``sizes`` elements starts."""
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    return starts


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
    way, from their still unwritten fp32 values, when they overflow the device's slots
    (see :class:`RemainderEncoding`, which this is for one entry)."""
    encoding = RemainderEncoding([flat], [param], [low_out], [0], [], ExceptionSlots(), module)
    encoding.launch()
    return encoding.finish(reference)[0]


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
def remainder_widen_packed(
    flats: list[torch.Tensor], params: list[torch.Tensor], lows: list[torch.Tensor], module: ModuleType | None = None
) -> None:
    """:func:`remainder_widen` of each ``lows[k]`` (as a packed group of
    :class:`RemainderEncoding` left them) into the fp32 ``flats[k]``."""
    module = module or kernels(flats[0].device)
    low, p = torch.cat(lows), torch.cat(params)
    x = torch.empty(low.numel(), dtype=torch.float32, device=low.device)
    _remainder_decode(module, low, p.view(torch.int16), x.view(torch.int32), x.numel())
    torch._foreach_copy_(flats, list(x.split([t.numel() for t in flats])))


# ---- the remainder encoder: launched, then finished -----------------------------------


def exception_capacity(n: int) -> int:
    """Device slots for the exceptions of an encoder run of ``n`` elements."""
    return max(_SLOTS_MIN, n // _ELEMENTS_PER_SLOT)


def _run_sizes(sizes: list[int], singles: list[int], groups: list[list[int]]) -> list[int]:
    """Elements per run of the encoder: each single, then each packed group."""
    return [sizes[k] for k in singles] + [sum(sizes[k] for k in group) for group in groups]


def slots_needed(sizes: list[int]) -> tuple[int, int]:
    """Runs and slots in all that :class:`RemainderEncoding` takes for mains of ``sizes``
    elements on a device where the kernels serve (what ``ExceptionSlots.reserve`` takes)."""
    capacities = [exception_capacity(n) for n in _run_sizes(sizes, *_plan_sizes(sizes, 1))]
    return len(capacities), sum(capacities)


class ExceptionSlots:
    """Where the remainder encoder's kernels leave the exceptions they find, on one
    device: per run, a row of per-chunk counts and a region of slots
    (:func:`exception_capacity`), each slot an exception's element number and true
    high half in one int64 (``number << 16 | high & 0xFFFF``: sorting them sorts by
    number). Counts and slots share one device buffer (the counts' rows first), so that
    :meth:`read_back` brings both to the host in one copy, into a pinned copy of the
    buffer. Grown to the largest need seen and then kept (the codec reserves its
    largest bucket's :func:`slots_needed` at its first encode), so that the addresses
    repeat from step to step and a CUDA graph can hold the encoder's launches: 8 bytes
    per slot and 128 per run, so 8 KiB per run of up to 4M elements and 2 bytes per
    1024 elements beyond, on the device and again in host memory (pinned for a CUDA
    buffer: torch's pinned allocator rounds that up to a power of two, 256 KiB at 7.6B,
    and keeps it cached after :meth:`release`)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # int64: `rows` rows of counts (as int32), then the slots
        self.host: torch.Tensor | None = None  # read_back's snapshot of it (pinned for a CUDA buffer)
        self.rows = 0
        self.width = _MAX_RUN_CHUNKS  # counts per row, as at the buffer's allocation (tests shrink it)

    @property
    def counts(self) -> torch.Tensor:
        """int32, a row of :attr:`width` counts per run (a view of the buffer)."""
        return self._counts(self.buffer)

    @property
    def found(self) -> torch.Tensor:
        """int64, every run's region of slots end to end (a view of the buffer)."""
        return self.buffer[self._words :]

    @property
    def _words(self) -> int:
        """int64 words the counts' rows take (two int32 counts each)."""
        return self.rows * -(-self.width // 2)

    def _counts(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[: self._words].view(torch.int32)[: self.rows * self.width].view(self.rows, self.width)

    def reserve(self, rows: int, total: int, device: torch.device) -> None:
        """Room for ``rows`` runs of ``total`` slots in all on ``device``: a larger buffer
        where the present one falls short (at a new address: the sizes enter :meth:`key`)."""
        if device.type == "cuda" and device.index is None:  # as a tensor's device reads
            device = torch.device("cuda", torch.cuda.current_device())
        if self.buffer is not None and self.buffer.device == device and self.width == _MAX_RUN_CHUNKS:
            if self.rows >= rows and self.found.numel() >= total:
                return
            rows, total = max(rows, self.rows), max(total, self.found.numel())
        self.release()  # before the larger one is allocated
        self.rows, self.width = rows, _MAX_RUN_CHUNKS
        self.buffer = torch.zeros(self._words + total, dtype=torch.int64, device=device)
        self.host = torch.empty_like(self.buffer, device="cpu", pin_memory=device.type == "cuda")

    def read_back(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every run's counts and the first ``used`` slots, as they are once everything
        queued on the device's current stream has run (this waits for it): views of a
        snapshot in host memory, taken in one copy and valid until the next call."""
        if used > self.found.numel():
            raise ValueError(f"{used} slots read back from {self.found.numel()}")
        n = self._words + used
        if self.buffer.is_cuda:
            self.host[:n].copy_(self.buffer[:n], non_blocking=True)
            torch.cuda.current_stream(self.buffer.device).synchronize()
        else:  # Triton's interpreter: a snapshot all the same, so later launches leave it be
            self.host[:n].copy_(self.buffer[:n])
        return self._counts(self.host), self.host[self._words : n]

    def key(self) -> tuple | None:
        """What a CUDA graph of launches into these slots depends on."""
        if self.buffer is None:
            return None
        return self.buffer.data_ptr(), self.rows, self.buffer.numel()

    def nbytes(self) -> int:
        """Device bytes (the host snapshot takes as many, before the pinned allocator's rounding)."""
        return 0 if self.buffer is None else self.buffer.nbytes

    def release(self) -> None:
        self.buffer = self.host = None
        self.rows = 0


class RemainderEncoding:
    """The fused remainder encoder over several mains at once (a bucket's), in two
    halves: :meth:`launch` queues every kernel and reads nothing back, so that a CUDA
    graph can hold it; :meth:`finish` then reads back every run's counts and exceptions
    (one copy to the host, whatever the count of runs; one more per run resumed after
    an overflow), and completes any
    run that overflowed its slots.

    A run is a single entry's chunks (``geometric_chunks``, up to ``_MAX_RUN_CHUNKS``)
    or a packed group (``plan_packed``), converted in one launch out of a packed copy.
    Each chunk stands down once the earlier ones overflowed (the kernel checks), so the
    overflowing chunk's fp32 elements, which the next chunk's low bits would land on,
    are still there for ``reference``; the run then resumes after it, eagerly. The low
    bits whose place is their own fp32 bytes (an entry's first chunk, a packed group's)
    wait in a scratch and are committed on the device unless their run overflowed
    there, leaving those fp32 bytes for ``reference`` too.

    The kernels number the elements of all the runs in one sequence (the singles, then
    the groups' entries, in order), so one sort and one search split a bucket's
    exceptions by entry.

    ``flats``: the fp32 mains, flat; ``params``: their bf16 params, flat; ``lows``: the
    int16 views of each main's first half, where its low bits go; ``singles`` and
    ``groups``: indices into them (see :func:`plan_packed`)."""

    def __init__(self, flats, params, lows, singles, groups, slots: ExceptionSlots, module=None) -> None:
        self.flats, self.params, self.lows = flats, params, lows
        self.singles, self.groups, self.slots = singles, groups, slots
        self.device = flats[0].device if flats else None
        # Now, not at launch: a replayed graph launches nothing, and finish() may resume a run.
        self.module = module or (kernels(self.device) if flats else None)
        self.spans = {k: list(geometric_chunks(flats[k].numel(), widen=2)) for k in singles}
        order = singles + [k for group in groups for k in group]
        # Entry k's first element's number in the kernels' one sequence.
        self.numbered = dict(zip(order, _starts([flats[k].numel() for k in order]), strict=True))
        self.capacities = [exception_capacity(n) for n in _run_sizes([f.numel() for f in flats], singles, groups)]
        self.starts = _starts(self.capacities)
        if self.capacities:
            slots.reserve(len(self.capacities), sum(self.capacities), self.device)

    def key(self) -> tuple:
        """What a CUDA graph of :meth:`launch` depends on beyond its tensors' addresses."""
        return self.slots.key(), tuple(self.capacities)

    @torch.no_grad()
    def launch(self) -> None:
        """Queue the runs' kernels on the current stream; no host reads."""
        if not self.capacities:
            return
        with on_device(self.device):
            for r, k in enumerate(self.singles):
                self._launch_chunks(r, k, 0)
            for g, group in enumerate(self.groups):
                self._launch_group(len(self.singles) + g, group)

    @torch.no_grad()
    def finish(self, reference) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """After :meth:`launch` (or a replay of its graph): every main's exceptions on the
        CPU (flat indices ascending, true high bits; entries with none share one pair of
        empty tensors). ``reference(flat, param, s, e)`` finds those of elements
        ``[s, e)`` from their fp32 values, where a run overflowed."""
        found = [_NONE] * len(self.flats)
        if not self.capacities:
            return found
        with on_device(self.device):
            counts, slots = self.slots.read_back(sum(self.capacities))  # the wait on the device
            rows = counts[: len(self.capacities)].tolist()
            chunks = [min(len(self.spans[k]), _MAX_RUN_CHUNKS) for k in self.singles] + [1] * len(self.groups)
            fits = [_fitting(row, n, cap) for row, n, cap in zip(rows, chunks, self.capacities, strict=True)]
            number, high = self._read(slots, [(r, total) for r, (_, total) in enumerate(fits)])
            if number.numel():  # each entry's share, by its numbers
                entries = list(self.numbered.items())
                bounds = torch.searchsorted(number, torch.tensor([n for _, n in entries])).tolist()
                for (k, first), a, b in zip(entries, bounds, bounds[1:] + [number.numel()], strict=True):
                    if a < b:
                        found[k] = (number[a:b] - first, high[a:b])
            for r, k in enumerate(self.singles):
                if fits[r][0] < len(self.spans[k]):  # overflowed, or longer than a run
                    found[k] = self._finish_chunks(r, k, fits[r][0], found[k], reference)
            for g, group in enumerate(self.groups):
                if not fits[len(self.singles) + g][0]:
                    for k in group:  # overflowed: nothing committed, every entry's fp32 values intact
                        flat = self.flats[k]
                        found[k] = reference(flat, self.params[k], 0, flat.numel())
                        _commit_from_fp32(flat, self.lows[k], flat.numel())
        return found

    def _region(self, r: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        start, capacity = self.starts[r], self.capacities[r]
        return self.slots.counts[r], self.slots.found[start : start + capacity], capacity

    def _launch_chunks(self, r: int, k: int, chunk: int) -> None:
        """Single ``k``'s chunks from its ``chunk``-th on, as run ``r``."""
        spans = self.spans[k][chunk : chunk + _MAX_RUN_CHUNKS]
        if not spans:
            return
        counts, found, capacity = self._region(r)
        flat, low, number = self.flats[k], self.lows[k], self.numbered[k]
        bits, param = flat.view(torch.int32), self.params[k].view(torch.int16)
        counts.zero_()
        scratch = torch.empty(spans[0][1], dtype=torch.int16, device=flat.device) if spans[0][0] == 0 else None
        for c, (s, e) in enumerate(spans):
            target = scratch if s == 0 else low[s:e]
            _remainder_encode(self.module, bits[s:e], param[s:e], target, counts, c, found, e - s, number + s, capacity)
        if scratch is not None:  # the first chunk's low bits, over its own fp32 bytes unless it overflowed
            e = spans[0][1]
            torch.where(counts[0] <= capacity, scratch, low[:e], out=scratch)
            low[:e].copy_(scratch)

    def _launch_group(self, r: int, group: list[int]) -> None:
        counts, found, capacity = self._region(r)
        x = torch.cat([self.flats[k] for k in group])
        p = torch.cat([self.params[k] for k in group])
        low = torch.empty(x.numel(), dtype=torch.int16, device=x.device)
        counts.zero_()
        bits, param = x.view(torch.int32), p.view(torch.int16)
        _remainder_encode(self.module, bits, param, low, counts, 0, found, x.numel(), self.numbered[group[0]], capacity)
        del x, p, bits, param  # before the commit's temporary
        lows = [self.lows[k] for k in group]
        torch.where(counts[0] <= capacity, low, torch.cat(lows), out=low)  # unless overflowed: as they were
        torch._foreach_copy_(lows, list(low.split([self.flats[k].numel() for k in group])))

    def _read(self, slots: torch.Tensor, totals: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``total`` exceptions of each run ``r`` (``slots``: as
        ``ExceptionSlots.read_back`` gave them), sorted into new host tensors: their
        element numbers and true high halves."""
        taken = [slots[self.starts[r] : self.starts[r] + total] for r, total in totals if total]
        if not taken:
            return _NONE
        found = torch.sort(torch.cat(taken)).values  # by number: a few hundred per bucket, usually
        low16 = found & 0xFFFF
        return found >> 16, (low16 - ((low16 & 0x8000) << 1)).to(torch.int16)  # the high half, signed

    def _finish_chunks(self, r: int, k: int, ran: int, found, reference) -> tuple[torch.Tensor, torch.Tensor]:
        """Single ``k``'s exceptions after its first run stopped at chunk ``ran`` (overflowed
        there, or ended; ``found``: those of the chunks before it): an overflowing chunk's
        by the reference, then the rest of the entry's chunks eagerly."""
        flat, param, spans = self.flats[k], self.params[k], self.spans[k]
        parts, first = [found], 0
        while first < len(spans):
            run = spans[first : first + _MAX_RUN_CHUNKS]
            if first:  # the entry's chunks past the overflow (or past the first run)
                self._launch_chunks(r, k, first)
                counts, slots = self.slots.read_back(sum(self.capacities))
                ran, total = _fitting(counts[r].tolist(), len(run), self.capacities[r])
                number, high = self._read(slots, [(r, total)])
                parts.append((number - self.numbered[k], high))
            if ran < len(run):  # chunk `ran` overflowed (those after it stood down)
                s, e = run[ran]
                parts.append(reference(flat, param, s, e))
                if s == 0:  # its low bits were not committed: from its fp32 bytes, just read
                    _commit_from_fp32(flat, self.lows[k], e)
            first += ran + (ran < len(run))  # past the overflowing chunk, or the whole run
        parts = [part for part in parts if part[0].numel()]
        if len(parts) <= 1:
            return parts[0] if parts else _NONE
        return torch.cat([i for i, _ in parts]), torch.cat([h for _, h in parts])


# No exceptions: shared by every entry without any (never written to: empty).
_NONE = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int16))


def _fitting(counts: list[int], chunks: int, capacity: int) -> tuple[int, int]:
    """How many of a run's first ``chunks`` fit its slots (counted in ``counts``; a chunk
    after them overflowed, those after it stood down: -1), and their exceptions' count."""
    ran = total = 0
    for count in counts[:chunks]:
        if count < 0 or total + count > capacity:
            break
        ran, total = ran + 1, total + count
    return ran, total


def _commit_from_fp32(flat: torch.Tensor, low_out: torch.Tensor, e: int) -> None:
    """The low bits of fp32 elements ``[0, e)`` into ``low_out[:e]`` (read out first: they
    land on the first of those elements' bytes)."""
    low_out[:e].copy_(flat.view(torch.int16).view(-1, 2)[:e, 0].clone())
