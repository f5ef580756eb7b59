"""Fused CUDA kernels (Triton) for the 8-bit and remainder codecs: the same bytes as
``quant8.py`` and ``remainder.py``, which stay the reference (and the CPU path).

Why: the reference formulations run a dozen elementwise passes per chunk, and convert
an entry at a time. The fused kernels read each fp32 element once, write its stored form
once, and convert all of a bucket's entries of one kind in one launch: the codec's cost
was the host's, per entry and per chunk (2026-12-02: 544 launches per 4-layer slice at
about 20 us each, the device busy 24 ms of 57).

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

In place, in one launch: an entry's stored form lives in the first bytes of its fp32
storage (see ``convert.py``), so a program's stores may land on elements another has
yet to read. Each program converts one tile of an entry (``_TILE`` elements) and takes
it by ticket (an atomic counter), not by program id, so it only ever waits on programs
that are already running. A tile releases its flag (release semantics) once its loads
are consumed, and only then waits, before its stores, for the tiles its stores land on:
narrowing, tickets go front to back and tile ``j``'s ``w``-byte codes land on tile
``w * j // 4``'s fp32 bytes; widening, back to front, tile ``j``'s fp32 values land on
the codes of tiles ``4j / w`` to ``4(j + 1) / w - 1``. No release waits on another
tile, so the waits never chain (measured on an H200, 2026-12-02: tiles that waited
before releasing, four 4096-element sub-tiles each, took the 8-bit encoder from 0.36
to 0.45-0.64 ms per 64M elements). Only an entry's first tile overlaps itself: its
program reads it whole before a barrier, then stores. The 8-bit scales go through a
separate buffer (1/64 byte per element), copied into place after the launch.

The remainder encoder collects exceptions in ``_EXCEPTION_SLOTS`` device slots per
launch. A tile whose exceptions do not fit stands down, as do the tiles whose low bits
would land on it (so its tiles wait before they release), leaving their fp32 bytes
unread and unwritten; the host then converts those tiles with the reference, front to
back (NaN mains, say: every one an exception), a run of consecutive tiles per call.
Decoding never waits on the host; encoding waits once per launch for its exception
count (and, where tiles stood down, for their flags and in each reference call).
One alignment flag serves a launch: a single entry (or param) off 16 bytes costs the
whole launch its vector loads and stores.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import os
from collections.abc import Callable
from types import ModuleType

import torch

from miles_plugins.optimizers.formats.convert import CHUNK_ELEMENTS

logger = logging.getLogger(__name__)

# Elements per tile, one program's work (16 8-bit blocks of 256); warps per program.
_TILE = 4096
_WARPS = 4
# The kernels' control block: counters, then a flag per tile (triton_kernels._HEAD).
_HEAD = 4
_USED, _DOWN = 2, 3
# Remainder exceptions collected on the device per launch; past them the host's reference
# converts what stood down.
_EXCEPTION_SLOTS = 1 << 16
# Exceptions put back per launch of ``put_highs`` in decode (16 bytes each on the device).
_PUT_GROUP = CHUNK_ELEMENTS // 4


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
    values, remainder exceptions; entries of one launch both 16-byte aligned and not
    (the two variants the kernels are built in). Raises where a byte differs."""
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
    # Entries of several tiles (whole ones, and a partial one), so that
    # tiles wait on others; their blocks repeat the crafted ones.
    repeats = 2 * _TILE // (6 * block) + 1
    long = torch.cat([x[: 6 * block].repeat(repeats), x[6 * block :]])
    for name in quant8.MOMENT_FORMATS:
        signed, sqrt = quant8.MOMENT_FORMATS[name]
        values = long.abs() if sqrt else long
        for skew in (0, 1):  # entries at 16-byte boundaries, then one element off them
            lengths = (values.numel() - 7, values.numel())  # a multiple of 16, and not
            expected = [values[:n].clone() for n in lengths]
            storage = torch.zeros(sum(lengths) + 8, device=device)
            t = [storage[skew : skew + lengths[0]], storage[-lengths[1] :]]
            for target, source in zip(t, expected, strict=True):
                target.copy_(source)
            stored = [quant8._codes_and_scales(e)[1] for e in t]
            for e in expected:
                quant8.narrow_in_place(e, signed, sqrt)
            quant8_narrow(t, stored, quant8._search_guide(signed, device), sqrt, block, module)
            for e, got in zip(expected, t, strict=True):
                n, end = got.numel(), quant8.stored_nbytes(got.numel())
                _same(name + " codes", e.view(torch.uint8)[:n], got.view(torch.uint8)[:n].cpu())
                scales = got.view(torch.uint8)[n:end].clone().view(torch.float32).cpu()
                _same(name + " scales", e.view(torch.uint8)[n:end].clone(), scales)
                quant8.widen_in_place(e, signed, sqrt)
            quant8_widen(t, stored, quant8._tables(signed, device)[0], sqrt, block, module)
            for e, got in zip(expected, t, strict=True):
                _same(name + " values", e, got.cpu())
    for skew in (0, 1):
        mains, params = [], []
        for length in (2 * _TILE + 3 * block, 2 * _TILE + 3 * block + 5):
            main = torch.linspace(-4, 4, length, device=cpu)
            bits = main.view(torch.int32)
            bits[::7] = (bits[::7] & ~0xFFFF) | 0x18000  # exact ties with an odd high half: exceptions
            main[3], main[4], main[5] = float("nan"), float("-inf"), 1e-40
            mains.append(main)
            params.append(main.bfloat16())
        expected = [m.clone() for m in mains]
        exceptions = [remainder.encode_in_place(e, p) for e, p in zip(expected, params, strict=True)]
        storage = torch.zeros(sum(m.numel() for m in mains) + 8, device=device)
        param_storage = torch.zeros(storage.numel(), dtype=torch.bfloat16, device=device)
        t = [storage[skew : skew + mains[0].numel()], storage[-mains[1].numel() :]]
        p = [param_storage[skew : skew + mains[0].numel()], param_storage[-mains[1].numel() :]]
        for target, source in zip(t + p, mains + params, strict=True):
            target.copy_(source)
        found = remainder_encode(t, p, remainder._encode_range, module)
        for e, got, ex, (index, high) in zip(expected, t, exceptions, found, strict=True):
            low = got.view(torch.int16)[: got.numel()].cpu()
            _same("remainder low bits", remainder.stored_view(e, remainder.STORAGE_DTYPE), low)
            _same("remainder exceptions", torch.cat([ex.index, ex.high.long()]), torch.cat([index, high.long()]))
        remainder_decode(t, p, found, module)
        for main, got in zip(mains, t, strict=True):
            _same("remainder mains", main.view(torch.int32), got.cpu().view(torch.int32))  # every bit, NaN's too


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
    """Run ``convert(flats, ...)`` with the device of ``flats`` (tensors on one device)
    current: Triton launches on the current device's current stream, where torch's own
    ops run under the tensor's device; so the launches order with the stream the store
    queued its work on, whichever device is current."""

    @functools.wraps(convert)
    def on_device(flats, *args, **kwargs):
        device = flats[0].device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return convert(flats, *args, **kwargs)

    return on_device


class Launch:
    """One launch's entries (1-D tensors on one device, none empty): the descriptor the
    kernels read (per entry, as ``triton_kernels._COLS`` says) and their control block.
    Pointers are passed as the lowest entry's (and param's) plus element offsets, which
    keeps the kernels' pointer arithmetic typed; ``aligned``: every entry (and param)
    starts on 16 bytes, so the kernels may use vector loads and stores."""

    def __init__(self, flats: list[torch.Tensor], aux: list[int], params: list[torch.Tensor] | None = None) -> None:
        devices = {t.device for t in flats + (params or [])}
        if len(devices) != 1:  # offsets between devices would address neither
            raise ValueError(f"one launch converts tensors of one device, not {sorted(map(str, devices))}")
        self.base = min(flats, key=lambda t: t.data_ptr())
        self.param_base = min(params, key=lambda t: t.data_ptr()) if params else self.base
        self.firsts = _starts([_cdiv(t.numel(), _TILE) for t in flats])  # each entry's first tile
        self.tiles = self.firsts[-1] + _cdiv(flats[-1].numel(), _TILE)  # the grid
        self.entries = len(flats)
        rows: list[int] = []
        for k, t in enumerate(flats):
            param_offset = (params[k].data_ptr() - self.param_base.data_ptr()) // 2 if params else 0
            rows += [self.offset(t), t.numel(), self.firsts[k], aux[k], param_offset]
        self.aligned = all(t.data_ptr() % 16 == 0 for t in flats + (params or []))
        self.desc = _to_device(torch.tensor(rows, dtype=torch.int64), self.base.device)
        self.ctl = torch.zeros(_HEAD + self.tiles, dtype=torch.int32, device=self.base.device)

    def offset(self, t: torch.Tensor) -> int:
        """``t``'s first element, in fp32 elements from the launch's base."""
        return (t.data_ptr() - self.base.data_ptr()) // 4

    def entry_of(self, tile: int) -> int:
        """The entry tile ``tile`` belongs to."""
        return bisect.bisect_right(self.firsts, tile) - 1


def _runs(tiles: list[int], launch: Launch, sizes: list[int]) -> list[tuple[int, int, int]]:
    """Ascending ``tiles`` of ``launch`` as runs of consecutive ones: (entry, first
    element, end), one reference call each rather than one per tile."""
    runs: list[tuple[int, int, int]] = []
    for tile in tiles:
        k = launch.entry_of(tile)
        s = (tile - launch.firsts[k]) * _TILE
        e = min(sizes[k], s + _TILE)
        if runs and runs[-1][0] == k and runs[-1][2] == s:
            runs[-1] = (k, runs[-1][1], e)
        else:
            runs.append((k, s, e))
    return runs


def _starts(sizes: list[int]) -> list[int]:
    """Where each of consecutive pieces of ``sizes`` elements starts."""
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    return starts


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the CPU) on ``device``. To CUDA through a pinned copy: from pageable memory
    a copy holds the host until the device has run everything queued before it."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# ---- a bucket's entries of one kind, in place, one launch --------------------------


@torch.no_grad()
@_on_the_tensors_device
def quant8_narrow(
    flats: list[torch.Tensor],
    scale_bytes: list[torch.Tensor],
    guide: tuple[torch.Tensor, torch.Tensor],
    sqrt: bool,
    block: int,
    module: ModuleType | None = None,
) -> None:
    """Codes of each fp32 ``flats[k]`` (1-D, at least one block) on the map whose
    :func:`search_guide` is ``guide`` (on their device) into the first bytes of its own
    storage, its block scales into ``scale_bytes[k]`` (the uint8 view of their place,
    right after the codes). ``module``: the kernels (``kernels(device)`` when not given)."""
    module = module or kernels(flats[0].device)
    blocks = [_cdiv(t.numel(), block) for t in flats]
    launch = Launch(flats, _starts(blocks))
    scales = torch.empty(sum(blocks), dtype=torch.float32, device=launch.base.device)
    midpoints, slices = guide
    module.quantize[(launch.tiles,)](
        launch.base,
        launch.base.view(torch.uint8),
        scales,
        launch.desc,
        launch.ctl,
        midpoints,
        slices,
        launch.entries,
        SQRT=sqrt,
        BLOCK=block,
        ROWS=_TILE // block,
        ALIGNED=launch.aligned,
        GUIDE_SHIFT=GUIDE_SHIFT,
        GUIDE_FIRST=GUIDE_FIRST,
        GUIDE_SLICES=GUIDE_SLICES,
        num_warps=_WARPS,
    )
    # Each entry's scales land on its fp32 elements [n / 4, ...): read by the launch.
    torch._foreach_copy_(scale_bytes, list(scales.view(torch.uint8).split([4 * b for b in blocks])))


@torch.no_grad()
@_on_the_tensors_device
def quant8_widen(
    flats: list[torch.Tensor],
    scale_bytes: list[torch.Tensor],
    values: torch.Tensor,
    sqrt: bool,
    block: int,
    module: ModuleType | None = None,
) -> None:
    """fp32 values into each ``flats[k]`` of the codes in its first bytes, on the map
    ``values`` under the scales in ``scale_bytes[k]`` (as :func:`quant8_narrow` left them)."""
    module = module or kernels(flats[0].device)
    blocks = [_cdiv(t.numel(), block) for t in flats]
    scales = torch.cat(scale_bytes).view(torch.float32)  # out of the way of the values first
    launch = Launch(flats, _starts(blocks))
    module.dequantize[(launch.tiles,)](
        launch.base,
        launch.base.view(torch.uint8),
        scales,
        values,
        launch.desc,
        launch.ctl,
        launch.entries,
        SQUARE=sqrt,
        BLOCK=block,
        ROWS=_TILE // block,
        ALIGNED=launch.aligned,
        num_warps=_WARPS,
    )


# ``reference(flat, param, s, e)``: the reference encoder of elements ``[s, e)``, front to
# back: writes their low bits, returns their exceptions (ascending flat indices, high bits).
Reference = Callable[[torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
@_on_the_tensors_device
def remainder_encode(
    flats: list[torch.Tensor], params: list[torch.Tensor], reference: Reference, module: ModuleType | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Low 16 bits of each fp32 ``flats[k]`` (1-D, not empty) into the first half of its
    storage, beside its bf16 ``params[k]``; per entry its exceptions (flat indices
    ascending, true high bits) on the CPU. The launch's one wait on the device is for its
    exception count; what stood down (past the slots) goes to ``reference``, in order."""
    module = module or kernels(flats[0].device)
    sizes = [t.numel() for t in flats]
    starts = _starts(sizes)
    launch = Launch(flats, starts, params)
    device = launch.base.device
    index = torch.empty(_EXCEPTION_SLOTS, dtype=torch.int64, device=device)
    high = torch.empty(_EXCEPTION_SLOTS, dtype=torch.int16, device=device)
    module.remainder_encode[(launch.tiles,)](
        launch.base.view(torch.int32),
        launch.base.view(torch.int16),
        launch.param_base.view(torch.int16),
        index,
        high,
        launch.desc,
        launch.ctl,
        launch.entries,
        _EXCEPTION_SLOTS,
        TILE=_TILE,
        ALIGNED=launch.aligned,
        num_warps=_WARPS,
    )
    used, down = launch.ctl[_USED : _DOWN + 1].tolist()  # the launch's one wait on the device
    both = torch.cat([index[:used], high[:used].long()]).cpu()  # one copy back, not two
    found = [(both[:used], both[used:].to(torch.int16))]
    if down:  # front to back: a stood-down tile's low bits land on earlier elements
        for k, s, e in _runs((launch.ctl[_HEAD:] == 2).nonzero().view(-1).tolist(), launch, sizes):
            at, bits = reference(flats[k], params[k], s, e)
            found.append((at + starts[k], bits))
    at, bits = torch.cat([i for i, _ in found]), torch.cat([h for _, h in found])
    order = torch.argsort(at)  # a few thousand, usually: cheaper on the host than a device sort
    at, bits = at[order], bits[order]
    bounds = torch.searchsorted(at, torch.tensor(starts + [sum(sizes)])).tolist()
    return [(at[a:b] - s, bits[a:b]) for a, b, s in zip(bounds, bounds[1:], starts, strict=False)]


@torch.no_grad()
@_on_the_tensors_device
def remainder_decode(
    flats: list[torch.Tensor],
    params: list[torch.Tensor],
    exceptions: list[tuple[torch.Tensor, torch.Tensor]],
    module: ModuleType | None = None,
) -> None:
    """Rebuild each fp32 ``flats[k]`` from its low bits (the first half of its storage,
    as :func:`remainder_encode` left them), its bf16 ``params[k]`` and its exceptions
    (``(index, high)``, on the CPU)."""
    module = module or kernels(flats[0].device)
    launch = Launch(flats, [0] * len(flats), params)
    module.remainder_decode[(launch.tiles,)](
        launch.base.view(torch.int32),
        launch.base.view(torch.int16),
        launch.param_base.view(torch.int16),
        launch.desc,
        launch.ctl,
        launch.entries,
        TILE=_TILE,
        ALIGNED=launch.aligned,
        num_warps=_WARPS,
    )
    # Then the exceptions' true high halves: an element's high half is int16 2i + 1 of it.
    positions = [2 * (launch.offset(t) + index) + 1 for t, (index, _) in zip(flats, exceptions, strict=True)]
    table = torch.cat(positions), torch.cat([high.long() for _, high in exceptions])
    for s in range(0, table[0].numel(), _PUT_GROUP):
        where, high = (part[s : s + _PUT_GROUP] for part in table)
        module.put_highs[(_cdiv(where.numel(), _TILE),)](
            launch.base.view(torch.int16),
            _to_device(torch.cat([where, high]), launch.base.device),
            where.numel(),
            TILE=_TILE,
            num_warps=_WARPS,
        )
