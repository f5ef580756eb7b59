"""Blockwise 8-bit moments, stored inside the fp32 tensor's own storage: the format's
definition and its reference formulation.

The method is 8-bit Adam's (Dettmers et al., 2021, "8-bit Optimizers via
Block-wise Quantization") as bitsandbytes implements it: blocks of ``BLOCK``
elements, each scaled by its absolute maximum, each element stored as the
index of the nearest value of a 256-value *dynamic map* (an exponent and a
shrinking fraction: about 7 decades below the block's maximum). The moments are
only *stored* this way: a bucket decodes them to fp32, the master optimizer runs
its own exact update, and they are encoded again.

- ``exp_avg`` uses the signed map.
- ``exp_avg_sq`` stores its square root on the unsigned map (bitsandbytes
  stores ``exp_avg_sq`` itself). Squared gradients span twice the decades of
  the gradients, and the map ends about 7 decades below the block maximum:
  stored directly, the smallest ones become 0, and the update of such an
  element is ``exp_avg / eps``; as a square root they keep a code. The square
  root costs a little precision at the top of each block and removes the
  failure (``python -m bench.moment_formats`` compares both; docs/design.md
  gives its figures).

Stored form of an entry of ``n`` elements: ``n`` one-byte codes, then
``ceil(n / BLOCK)`` fp32 scales (raw bytes, right after the codes). Blocks
never straddle two entries (each entry is quantized on its own). An entry of
fewer than ``BLOCK`` elements is stored as plain fp32: a block too small to
fill is not worth quantizing, and an entry of one element has no room in its
own storage for a code and a scale.

Non-finite values poison their block: a NaN or inf anywhere in a block decodes
as NaN or inf across it (fp32 storage would keep them to their elements; either
way a non-finite gradient has already ruined that state).

The functions here are the reference (torch ops: the CPU path, and the bytes the
fused kernels of ``fused.py`` must store on CUDA); ``entry_codecs.py`` chooses
between them.

Both directions work chunk by chunk in the one order that never overwrites bytes
still to be read (as ``convert.py``): encoding front to back (chunk ``[s, e)``'s
codes land on bytes ``[s, e)``, fp32 elements already read), decoding back to
front. The scales are collected in (or copied out to) a small tensor of
``n / BLOCK`` values, so the device scratch is one chunk plus 1/256 of the entry.
"""

from __future__ import annotations

import functools
import zlib

import torch

from miles_plugins.optimizers.formats.convert import CHUNK_ELEMENTS, chunks

# Elements per block: bitsandbytes' 8-bit optimizers use 256. Scales then cost
# 4 / 256 = 0.016 bytes per element.
BLOCK = 256
SCALE_DTYPE = torch.float32
assert CHUNK_ELEMENTS % BLOCK == 0, "a conversion chunk must hold whole blocks"

# Per moment: (signed map, store the square root); see the module docstring.
MOMENT_FORMATS = {"exp_avg": (True, False), "exp_avg_sq": (False, True)}


def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``:
    256 ascending values in [-1, 1] (signed) or [0, 1] (unsigned), 0 and 1 included.
    Decade ``i`` below 1 gets half the values of decade ``i - 1``.

    One change to the signed map: its most negative value is -1 (bitsandbytes
    has -0.99297, and +1 only). With it, storing a stored moment again gives
    the same bytes: a block's maximum, of either sign, decodes exactly to its
    scale. Without it, a block whose maximum is negative shrinks by 0.7% each
    time it is re-encoded: the moments of a param that gets no gradient (which
    Adam leaves as they are) would decay step after step."""
    values = [0.0, 1.0]
    for i in range(7):
        items = 2 ** (i + (0 if signed else 1)) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = ((bounds[:-1] + bounds[1:]) / 2.0 * 10 ** (i - 6)).tolist()
        values += means + ([-m for m in means] if signed else [])
    assert len(values) == 256
    values.sort()
    if signed:
        values[0] = -1.0
    return torch.tensor(values, dtype=torch.float32)


# What a checkpoint records of this format; a load compares it, so a change to the
# maps (their bytes, hashed), the block size or the moment formats cannot be misread
# as this one.
FORMAT_ID = (
    f"dynamic map (crc32 {zlib.crc32(dynamic_map(True).numpy().tobytes() + dynamic_map(False).numpy().tobytes()):08x}), "
    f"{BLOCK}-element blocks, fp32 absmax scales; exp_avg signed, sqrt(exp_avg_sq) unsigned"
)


# Cached for the process (never evicted): the codec's CUDA graphs hold their addresses.
@functools.cache
def tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The map on ``device`` and the midpoints between neighbours (what rounds where)."""
    values = dynamic_map(signed).to(device)
    return values, (values[:-1] + values[1:]) / 2


def quantizes(numel: int) -> bool:
    """Whether an entry of ``numel`` elements is stored in 8 bits (else as fp32)."""
    return numel >= BLOCK


def stored_nbytes(numel: int) -> int:
    """Bytes of an entry's stored form: codes and scales, or fp32 for small entries."""
    if not quantizes(numel):
        return numel * 4
    return numel + -(-numel // BLOCK) * SCALE_DTYPE.itemsize


def codes_and_scales(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The uint8 views of ``t``'s storage that hold the codes and the scales."""
    n = t.numel()
    raw = t.view(-1).view(torch.uint8)
    return raw[:n], raw[n : stored_nbytes(n)]


def _sqrt_(t: torch.Tensor) -> None:
    """``t.sqrt_()`` of the fp32 ``t``, correctly rounded on every device, as CUDA's and
    the fused kernel's ``sqrt_rn`` are: torch's CPU square root is not always, whatever
    its vector width (docs/design.md). The root of an fp32 in float64 rounded to fp32 is
    the correctly rounded fp32 root (53 >= 2 * 24 + 2 bits), whatever the float64 root's
    last bit. A slice at a time: 8 bytes of scratch per element of the slice."""
    step = CHUNK_ELEMENTS // 8
    for s in range(0, t.numel(), step):
        part = t[s : s + step]
        part.copy_(part.double().sqrt_())


@torch.no_grad()
def quantize_chunk(x: torch.Tensor, signed: bool, sqrt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8) and per-block scales (fp32) of the 1-D fp32 ``x`` (of its
    square root with ``sqrt``), blocks starting at ``x[0]``. New tensors: the
    caller places them. ``x`` is read before anything is returned. Scratch:
    9 bytes per element of ``x``, the 1-byte codes included."""
    values, midpoints = tables(signed, x.device)
    n, blocks = x.numel(), -(-x.numel() // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x)  # zero padding leaves the last block's maximum as it is
    if sqrt:
        _sqrt_(padded)
    padded = padded.view(blocks, BLOCK)
    # The blocks' absolute maxima, without an abs() copy of the chunk; NaN stays NaN.
    # abs_() makes an all-zero block's scale +0 on every device (CUDA's max of +0 and
    # -0 may give -0, the CPU's gives +0).
    scales = torch.maximum(padded.amax(dim=1), padded.amin(dim=1).neg_()).abs_()
    # An all-zero block keeps scale 0 (it decodes to zeros).
    padded.div_(scales.masked_fill(scales == 0, 1.0).unsqueeze(1))
    codes = torch.bucketize(padded.view(-1)[:n], midpoints, out_int32=True).to(torch.uint8)
    return codes, scales


@torch.no_grad()
def dequantize_chunk(
    codes: torch.Tensor, scales: torch.Tensor, signed: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 values of ``codes`` (blocks starting at ``codes[0]``) under ``scales``,
    into ``out`` when given (it may overlap ``codes``: they are read first).
    Scratch: 4 bytes per code."""
    values, _ = tables(signed, codes.device)
    n, full = codes.numel(), codes.numel() // BLOCK * BLOCK
    index = codes.int()  # every code read before out is written
    out = torch.index_select(
        values, 0, index, out=out if out is not None else torch.empty_like(index, dtype=values.dtype)
    )
    del index
    out[:full].view(-1, BLOCK).mul_(scales[: full // BLOCK].unsqueeze(1))
    if full < n:
        out[full:].mul_(scales[-1])
    return out


@torch.no_grad()
def encode_in_place(t: torch.Tensor, signed: bool, sqrt: bool) -> None:
    """Rewrite the fp32 tensor ``t`` in its stored form, in its first
    ``stored_nbytes`` bytes; its fp32 values are gone afterwards (an entry too
    small to quantize is its own stored form: left as it is). ``sqrt``: store
    the square root (``t`` must be non-negative)."""
    if not quantizes(t.numel()):
        return
    flat = t.view(-1)
    codes_out, scales_out = codes_and_scales(t)
    scales = torch.empty(-(-flat.numel() // BLOCK), dtype=SCALE_DTYPE, device=t.device)
    for s, e in chunks(flat.numel()):
        # quantize_chunk reads the whole chunk before its codes are written over it.
        codes, scales[s // BLOCK : -(-e // BLOCK)] = quantize_chunk(flat[s:e], signed, sqrt)
        codes_out[s:e].copy_(codes)
        del codes  # before the next chunk's scratch is allocated
    # Bytes [n, n + 4 * blocks) are fp32 elements [n / 4, ...): all read by now.
    scales_out.copy_(scales.view(torch.uint8))


@torch.no_grad()
def decode_in_place(t: torch.Tensor, signed: bool, sqrt: bool) -> None:
    """Turn ``t``'s stored form (just read into its first bytes) back into fp32, in place."""
    if not quantizes(t.numel()):
        return
    flat = t.view(-1)
    codes_in, scales_in = codes_and_scales(t)
    scales = scales_in.clone().view(SCALE_DTYPE)  # the first chunks' fp32 values land on them
    for s, e in chunks(flat.numel(), backwards=True):
        # fp32 chunk [s, e) is bytes [4s, 4e): its own codes (read first) and later
        # chunks' codes (converted already), never an earlier chunk's.
        dequantize_chunk(codes_in[s:e], scales[s // BLOCK : -(-e // BLOCK)], signed, out=flat[s:e])
        if sqrt:
            flat[s:e].square_()
