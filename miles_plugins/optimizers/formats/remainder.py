"""Remainder mains: an fp32 main stored as 16 bits beside its resident bf16 param.

A bf16 param is the fp32 main rounded to nearest-even: its bits are the main's
high 16 bits ``hi``, or ``hi + 1`` when rounding went up (the low 16 bits
``lo`` above 0x8000, or exactly 0x8000 with ``hi`` odd). So the store keeps
``lo`` only, and rebuilds the main from the param ``p`` it finds at the next
step::

    hi = p - 1   if lo > 0x8000 (unsigned)
    hi = p       otherwise

That guess is wrong only for an exact tie (``lo == 0x8000`` with ``hi`` odd:
about one element in 2**17 of a trained model) and for mains whose rounding is
not a bit increment (NaN). Those elements are *exceptions*: their index and
true ``hi`` are kept on the side, so the pair (low bits, exceptions) rebuilds
every main exactly, whatever its value. 2 bytes per main instead of 4.

On CUDA with Triton installed, ``fused.py`` does both directions in fused kernels
(the same bytes, the same exceptions); the functions here are the reference.

Both directions work inside the main's own storage, chunk by chunk (see
``convert.py`` for why the directions are safe): the low bits occupy the first
half of the fp32 main's bytes.

The contract: between :func:`encode_in_place` and :func:`decode_in_place` the
bf16 param must not change. Megatron and the torch front end guarantee it:
params change only in the step (which re-encodes) and in
``reload_model_params`` / checkpoint loads (which re-encode, or restore the
low bits saved with the same params).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_plugins.optimizers.formats import fused
from miles_plugins.optimizers.formats.convert import chunks, stored_view

STORAGE_DTYPE = torch.int16  # the low 16 bits, as stored
_TIE = -0x8000  # 0x8000 read as int16


@dataclass
class Exceptions:
    """Elements whose high bits the rounding rule gets wrong: flat indices into
    the main (ascending) and their true high 16 bits. Kept on the CPU (they are few)."""

    index: torch.Tensor  # int64
    high: torch.Tensor  # int16

    @classmethod
    def none(cls) -> Exceptions:
        return cls(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=STORAGE_DTYPE))

    @classmethod
    def of(cls, index: torch.Tensor, high: torch.Tensor) -> Exceptions:
        """Found ones (``none()`` where there are none)."""
        return cls(index, high) if index.numel() else cls.none()

    def __len__(self) -> int:
        return self.index.numel()


def _halves(main: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided int16 views of the low and high halves of a flat fp32 tensor's bits
    (little-endian: the low half comes first)."""
    pairs = main.view(-1).view(STORAGE_DTYPE).view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def _guess_high(low: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The high bits the rounding rule implies, from the stored low bits and the param."""
    rounded_up = (low < 0) & (low != _TIE)  # lo > 0x8000 unsigned
    return param.view(STORAGE_DTYPE) - rounded_up.to(STORAGE_DTYPE)


def _chunk_exceptions(flat: torch.Tensor, param: torch.Tensor, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exceptions of fp32 elements ``[s, e)`` (still fp32): flat indices and true high
    bits, on the CPU; and the chunk's low bits (a copy, read before any write)."""
    low, high = (h.clone() for h in _halves(flat[s:e]))
    index = (high != _guess_high(low, param[s:e])).nonzero().view(-1)
    return index.cpu() + s, high[index].cpu(), low


def _encode_range(flat: torch.Tensor, param: torch.Tensor, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode fp32 elements ``[s, e)`` of ``flat`` in place, a chunk at a time front to
    back (each chunk read before its low bits are written); returns their exceptions.
    Every earlier element must already be read (encoded, or ``s`` is 0)."""
    out = stored_view(flat, STORAGE_DTYPE)
    indices, highs = [torch.empty(0, dtype=torch.int64)], [torch.empty(0, dtype=STORAGE_DTYPE)]
    for a, b in chunks(e - s):
        index, high, low = _chunk_exceptions(flat, param, s + a, s + b)
        out[s + a : s + b].copy_(low)
        indices.append(index)
        highs.append(high)
    return torch.cat(indices), torch.cat(highs)


@torch.no_grad()
def encode_in_place(main: torch.Tensor, param: torch.Tensor) -> Exceptions:
    """Rewrite the fp32 ``main`` as its low 16 bits, in the first half of its bytes
    (front to back); return what :func:`decode_in_place` needs beside ``param``.
    ``main``'s fp32 values are gone afterwards."""
    flat, param = main.view(-1), param.view(-1)
    if fused.applies(main) and main.numel():
        return Exceptions.of(*fused.remainder_encode([flat], [param], _encode_range)[0])
    return Exceptions.of(*_encode_range(flat, param, 0, flat.numel()))


@torch.no_grad()
def decode_in_place(main: torch.Tensor, param: torch.Tensor, exceptions: Exceptions) -> None:
    """``main`` holds its low 16 bits in the first half of its bytes (as
    :func:`encode_in_place` left them); rebuild the fp32 main (back to front)
    from them, the unchanged bf16 ``param`` and the exceptions."""
    flat, param, stored = main.view(-1), param.view(-1), stored_view(main, STORAGE_DTYPE)
    if fused.applies(main) and main.numel():
        fused.remainder_decode([flat], [param], [(exceptions.index, exceptions.high)])
        return
    for s, e in chunks(main.numel(), backwards=True):
        low = stored[s:e].clone()  # read the chunk before writing over it
        high = _guess_high(low, param[s:e])
        first, last = torch.searchsorted(exceptions.index, torch.tensor([s, e])).tolist()
        if last > first:
            high[(exceptions.index[first:last] - s).to(main.device)] = exceptions.high[first:last].to(main.device)
        out_low, out_high = _halves(flat[s:e])
        out_low.copy_(low)
        out_high.copy_(high)


def encode_many(mains: list[torch.Tensor], params: list[torch.Tensor]) -> list[Exceptions]:
    """:func:`encode_in_place` of every main (beside its param); on CUDA, all in one
    fused launch."""
    found = [Exceptions.none()] * len(mains)
    some = [k for k, main in enumerate(mains) if main.numel()]
    if some and all(fused.applies(mains[k]) for k in some):
        pairs = fused.remainder_encode(
            [mains[k].view(-1) for k in some], [params[k].view(-1) for k in some], _encode_range
        )
        for k, pair in zip(some, pairs, strict=True):
            found[k] = Exceptions.of(*pair)
        return found
    return [encode_in_place(main, param) for main, param in zip(mains, params, strict=True)]


def decode_many(mains: list[torch.Tensor], params: list[torch.Tensor], exceptions: list[Exceptions]) -> None:
    """:func:`decode_in_place` of every main; on CUDA, all in one fused launch."""
    some = [k for k, main in enumerate(mains) if main.numel()]
    if some and all(fused.applies(mains[k]) for k in some):
        fused.remainder_decode(
            [mains[k].view(-1) for k in some],
            [params[k].view(-1) for k in some],
            [(exceptions[k].index, exceptions[k].high) for k in some],
        )
        return
    for main, param, found in zip(mains, params, exceptions, strict=True):
        decode_in_place(main, param, found)
