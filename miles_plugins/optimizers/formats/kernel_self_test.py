"""The fused kernels' self-test: the registry (``kernels.for_device``) runs it on a device
before trusting the kernels there. Crafted values go through the kernels' host functions
(``fused.quant8_encode``, ``fused_remainder.RemainderEncoding`` and the others) on the
device, and every stored byte is compared with what the reference formulations
(``quant8.py``, ``remainder.py``) store on the CPU; a difference raises
:class:`KernelMismatch`.

The crafted values are chosen so that each way a kernel can go wrong moves some byte:

- 8-bit moments, both maps (the unsigned one through the square root): per scale of
  ``_TIE_SCALES`` (1, non-powers of two, one below 2^-64), a block of the scale and
  every midpoint times it, a block of the float below each, a block of the float above:
  a division or square root that is not correctly rounded, or a comparison of the
  wrong strictness, moves a code. For the square root the inputs are those roots
  squared (``sqrt(fl(r * r)) == r``). Also a block scaled by its most negative value,
  zero blocks of either sign, subnormals, infinities, NaN of either sign, more blocks
  than one program of the kernel takes, and three lengths: whole blocks (a scale
  written past the last block shows), then a partial last block of small values
  (positive; negative on the signed map), where padding other than zero moves the
  scale; multiples of 16 and not (Triton specializes a kernel on that).
- Remainder mains: one main of ``4 S + 2 SPAN + 5`` elements (``S``: the scratch chunk,
  ``SPAN``: the encoder's elements per program), so geometric chunks ``[0, S)``,
  ``[S, 2S)``, ``[2S, 4S)`` and ``[4S, ...)`` (with ``SPAN <= S`` and at most ``2 S``
  slots, as built). Its first two chunks hold one exception more than its run's slots:
  the second overflows, the third stands down for the count, the fourth because the
  third stood down (the count alone would let it run); the host finds the
  second's exceptions by the reference and resumes at the third, whose chunks hold
  exceptions at their edges and at a program's edge. So a chunk's slots must start
  after the earlier chunks' (``before``), number elements from the run's first
  (``base``) and from this program's first, and stand down when told. Then a packed
  group of two small mains numbered after it (a nonzero base in a run's first chunk).
  Every main holds exact ties with high halves of either parity, low halves of zero,
  and exceptions with negative high halves.
- Every output is a view into a buffer ``_TAIL`` elements longer, whose tail must stay
  as it was; a kernel that reads past its end reads ``_SENTINEL``.
"""

from __future__ import annotations

from types import ModuleType

import torch

from miles_plugins.optimizers.formats import fused, fused_remainder, quant8, remainder
from miles_plugins.optimizers.formats.convert import stored_view

_CPU = torch.device("cpu")
# The scales of the tie blocks: 1 (the ties are the midpoints themselves), non-powers of
# two, where a quotient that is not correctly rounded crosses a midpoint, and one below
# 2^-64 (the quantizer's scaled division; its roots' squares are subnormal).
_TIE_SCALES = (1.0, 3.0, 0.1, 1e5, 1.7 * 2.0**-70)
# Elements past each output's end, and their bits: a NaN (read into a block, it makes the
# scale NaN) whose high half is no rounding of its low half beside a param of that high
# half (read as a main, it is an exception).
_TAIL = 16
_SENTINEL = 0x7FA5A5A5


class KernelMismatch(RuntimeError):
    """The kernels stored other bytes than the reference, or wrote past an output."""


def self_test(module: ModuleType, device: torch.device) -> None:
    """Run the kernels of ``module`` (``triton_kernels``, or a stand-in) on ``device`` over
    the crafted values and compare what they store with the reference on the CPU."""
    check_quant8(module, device)
    check_remainder(module, device)


def check_quant8(module: ModuleType, device: torch.device) -> None:
    """Both 8-bit moment formats over the crafted blocks, at three lengths."""
    for name, (signed, sqrt) in quant8.MOMENT_FORMATS.items():
        blocks = _moment_blocks(signed, sqrt)
        small = torch.linspace(1e-3, 2e-3, 48)
        small_negative = -small[:7] if signed else small[:7]
        for tail in (small[:0], small, small_negative):
            values = torch.cat([blocks, tail * tail if sqrt else tail])
            compare_quant8(module, device, values, signed, sqrt, f"{name} of {values.numel()} elements")


def _moment_blocks(signed: bool, sqrt: bool) -> torch.Tensor:
    """The crafted blocks of one moment format, end to end (more than a program's)."""
    block = quant8.BLOCK
    midpoints = quant8.tables(signed, _CPU)[1]
    roots = []  # the values whose quotients by the block's scale are coded
    for d in _TIE_SCALES:
        scale = torch.tensor([d])
        ties = midpoints * scale
        for near in (ties, torch.nextafter(ties, ties - 1), torch.nextafter(ties, ties + 1)):
            roots.append(torch.cat([scale, near]))
    if signed:
        roots.append(-roots[3])  # scale 3, from the block's most negative value
    ramp = torch.linspace(-3, 2, block) if signed else torch.linspace(0, 5, block)
    roots.append(ramp)
    blocks = [r * r for r in roots] if sqrt else roots
    infinite, nan = ramp.clone(), ramp.clone()
    infinite[5] = float("inf")
    nan[9], nan[10] = float("nan"), -float("nan")
    subnormal = ramp * 1e-39  # not squared: the square root's inputs subnormal
    blocks += [subnormal, torch.zeros(block), torch.full((block,), -0.0), infinite, nan]
    copies = -(-(fused.BLOCKS_PER_PROGRAM + 1) // len(blocks))  # a launch of more blocks than one program takes
    return torch.cat(blocks * copies)


def compare_quant8(
    module: ModuleType, device: torch.device, values: torch.Tensor, signed: bool, sqrt: bool, what: str
) -> None:
    """Encode the fp32 ``values`` (on the CPU, at least a block) in place on ``device`` with
    the kernels, decode them back, and compare each step's bytes with the reference's."""
    n, blocks = values.numel(), -(-values.numel() // quant8.BLOCK)
    expected = values.clone()
    quant8.encode_in_place(expected, signed, sqrt)
    expected_codes, expected_scales = quant8.codes_and_scales(expected)
    buffer, scale_buffer = _in_buffer(values, device), _in_buffer(torch.empty(0), device, blocks + _TAIL)
    flat, scales = buffer[:n], scale_buffer[:blocks]
    codes = quant8.codes_and_scales(flat)[0]
    fused.quant8_encode(flat, codes, scales, fused.quant8_guide(signed, device), sqrt, quant8.BLOCK, module)
    _expect_same_bytes(what + ": codes", expected_codes, codes)
    _expect_same_bytes(what + ": scales", expected_scales.clone().view(torch.float32), scales)
    _expect_sentinels(what + ": past the scales", scale_buffer, blocks)
    quant8.decode_in_place(expected, signed, sqrt)
    fused.quant8_decode(flat, codes, scales, quant8.tables(signed, device)[0], sqrt, quant8.BLOCK, module)
    _expect_same_bytes(what + ": values", expected, flat)
    _expect_sentinels(what + ": past the values", buffer, n)


def check_remainder(module: ModuleType, device: torch.device) -> None:
    """The long main across every kind of chunk, then a packed group of two small ones."""
    s, span = fused.SCRATCH_ELEMENTS, fused.ELEMENTS_PER_PROGRAM
    n = 4 * s + 2 * span + 5
    slots = fused_remainder.exception_capacity(n)
    overflow = torch.linspace(0, 2 * s - 1, slots + 1, dtype=torch.float64).round().long()
    edges = torch.tensor([2 * s, 2 * s + 1, 4 * s - 1, 4 * s, 4 * s + span - 1, 4 * s + span, n - 1])
    mains = [
        _main(n, torch.cat([overflow, edges]), seed=0),
        _main(span + 3, torch.tensor([0, span - 1, span, span + 2]), seed=1),
        _main(5, torch.tensor([1, 4]), seed=2),
    ]
    compare_remainder(module, device, mains, groups=[[1, 2]])


def _main(n: int, exceptions: torch.Tensor, seed: int) -> torch.Tensor:
    """``n`` fp32 mains, finite and of either sign, whose only exceptions sit at
    ``exceptions`` (ascending): exact ties with an odd high half (the bf16 rounds up,
    the rule guesses down) alternating with NaNs (the bf16 of any NaN is 0xFFFF);
    among the others every 7th an exact tie with an even high half (rounded down, as
    the rule guesses) and every 7th a low half of zero (the param exactly)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int32, generator=g) & ~0x40000000  # |x| < 2
    bits += (bits & 0xFFFF) == 0x8000  # no ties but the ones placed below
    bits[0::7] = (bits[0::7] & ~0x1FFFF) | 0x8000
    bits[3::7] &= ~0xFFFF
    placed = bits[exceptions]
    placed[0::2] = (placed[0::2] & ~0xFFFF) | 0x18000
    placed[1::2] = (placed[1::2] & 0x003EFFFF) | 0x7FC00000  # positive, high half even: never 0xFFFF
    bits[exceptions] = placed
    return bits.view(torch.float32)


def compare_remainder(
    module: ModuleType, device: torch.device, mains: list[torch.Tensor], groups: list[list[int]]
) -> None:
    """Encode the fp32 ``mains`` (on the CPU) beside their bf16 params on ``device`` with
    the kernels, the ones in ``groups`` packed (indices into ``mains``), the others one
    by one, decode them back, and compare each step's bytes with the reference's."""
    grouped = [k for group in groups for k in group]
    singles = [k for k in range(len(mains)) if k not in grouped]
    params = [m.bfloat16() for m in mains]
    expected = [m.clone() for m in mains]
    exceptions = [remainder.encode_in_place(e, p) for e, p in zip(expected, params, strict=True)]
    buffers = [_in_buffer(m, device) for m in mains]
    param_buffers = [_in_buffer(p, device) for p in params]
    flats = [b[: m.numel()] for b, m in zip(buffers, mains, strict=True)]
    on_device = [b[: p.numel()] for b, p in zip(param_buffers, params, strict=True)]
    lows = [stored_view(f, remainder.STORAGE_DTYPE) for f in flats]
    encoding = fused_remainder.RemainderEncoding(
        flats, on_device, lows, singles=singles, groups=groups, slots=fused_remainder.ExceptionSlots(), kernels=module
    )
    encoding.launch()
    found = encoding.finish()
    whats = [f"remainder main {k} of {m.numel()} elements" for k, m in enumerate(mains)]
    for k in singles + grouped:
        _expect_same_bytes(whats[k] + ": low bits", stored_view(expected[k], remainder.STORAGE_DTYPE), lows[k])
        _expect_same_bytes(whats[k] + ": exceptions' elements", exceptions[k].index, found[k].index)
        _expect_same_bytes(whats[k] + ": exceptions' high halves", exceptions[k].high, found[k].high)
        _expect_sentinels(whats[k] + ": past the main", buffers[k], mains[k].numel())
        _expect_sentinels(whats[k] + ": past the param", param_buffers[k], params[k].numel())

    def decoded(k: int) -> None:
        remainder.put_exceptions(flats[k], found[k])
        _expect_same_bytes(whats[k] + ": decoded", mains[k].view(torch.int32), flats[k].view(torch.int32))
        _expect_sentinels(whats[k] + ": past the decoded main", buffers[k], mains[k].numel())

    # Singles first: a decoder that writes past its end shows in their tails before a
    # packed group's decode writes past the end of its own temporary.
    for k in singles:
        fused.remainder_decode_by_rule(flats[k], on_device[k], lows[k], module)
        decoded(k)
    for group in groups:
        members = [flats[k] for k in group], [on_device[k] for k in group], [lows[k] for k in group]
        fused.remainder_decode_by_rule_packed(*members, module)
        for k in group:
            decoded(k)


def _in_buffer(t: torch.Tensor, device: torch.device, size: int | None = None) -> torch.Tensor:
    """A copy of the flat ``t`` (fp32 or bf16) at the start of a buffer on ``device`` of
    ``size`` elements (``_TAIL`` more than ``t`` when not given), ``_SENTINEL`` after it
    (its high half for bf16)."""
    size = t.numel() + _TAIL if size is None else size
    buffer = torch.empty(size, dtype=t.dtype, device=device)
    buffer[: t.numel()].copy_(t)
    _bits(buffer[t.numel() :]).copy_(_sentinels(t.dtype, size - t.numel()))
    return buffer


def _expect_sentinels(what: str, buffer: torch.Tensor, n: int) -> None:
    """Raise unless ``buffer`` (from :func:`_in_buffer`) still holds the sentinel after element ``n``."""
    if not torch.equal(_bits(buffer[n:].cpu()), _sentinels(buffer.dtype, buffer.numel() - n)):
        raise KernelMismatch(f"self-test: {what}: written")


def _sentinels(dtype: torch.dtype, count: int) -> torch.Tensor:
    """``count`` sentinels' bits for a buffer of ``dtype`` (fp32: int32; bf16: int16, the high half)."""
    if dtype == torch.float32:
        return torch.full((count,), _SENTINEL, dtype=torch.int32)
    return torch.full((count,), _SENTINEL >> 16, dtype=torch.int16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _expect_same_bytes(what: str, expected: torch.Tensor, got: torch.Tensor) -> None:
    """Raise unless ``got`` (on any device) holds ``expected``'s bytes; fp32 NaNs: any
    NaN, since their bits differ by device."""
    got = got.cpu()
    if expected.dtype == torch.float32:
        nan = torch.isnan(expected)
        if not torch.equal(nan, torch.isnan(got)):
            raise KernelMismatch(f"self-test: {what}: NaN elsewhere than the reference's")
        expected, got = expected[~nan].view(torch.int32), got[~nan].view(torch.int32)
    if not torch.equal(expected, got):
        raise KernelMismatch(f"self-test: {what}: other bytes than the reference's")
