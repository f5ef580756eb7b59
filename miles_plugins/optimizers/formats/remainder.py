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

The functions here are the reference (and the CPU path); on CUDA with Triton
installed the fused kernels do both directions (``fused_remainder.py`` encodes,
``fused.py`` decodes by the rule) with the same bytes and exceptions, and
``entry_codecs.py`` chooses between them.

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

from miles_plugins.optimizers.formats.convert import CHUNK_ELEMENTS, chunks, stored_view

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


def _chunk_exceptions(
    flat: torch.Tensor, param: torch.Tensor, s: int, e: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exceptions of fp32 elements ``[s, e)`` (still fp32): flat indices and true high
    bits, on the CPU; and the chunk's low bits (a copy, read before any write)."""
    low, high = (h.clone() for h in _halves(flat[s:e]))
    index = (high != _guess_high(low, param[s:e])).nonzero().view(-1)
    return index.cpu() + s, high[index].cpu(), low


def find_exceptions(flat: torch.Tensor, param: torch.Tensor, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_chunk_exceptions` of elements ``[s, e)``, a conversion chunk at a time (the
    fused encoder's fallback: its chunks may be far longer than the conversion scratch)."""
    found = [_chunk_exceptions(flat, param, s + a, s + b)[:2] for a, b in chunks(e - s)]
    return torch.cat([index for index, _ in found]), torch.cat([high for _, high in found])


@torch.no_grad()
def encode_in_place(main: torch.Tensor, param: torch.Tensor) -> Exceptions:
    """Rewrite the fp32 ``main`` as its low 16 bits, in the first half of its bytes
    (front to back); return what :func:`decode_in_place` needs beside ``param``.
    ``main``'s fp32 values are gone afterwards."""
    flat, param, out = main.view(-1), param.view(-1), stored_view(main, STORAGE_DTYPE)
    indices, highs = [], []
    for s, e in chunks(main.numel()):
        index, high, low = _chunk_exceptions(flat, param, s, e)  # the chunk read before writing over it
        if index.numel():
            indices.append(index)
            highs.append(high)
        out[s:e].copy_(low)
    if not indices:
        return Exceptions.none()
    return Exceptions(torch.cat(indices), torch.cat(highs))


@torch.no_grad()
def decode_in_place(main: torch.Tensor, param: torch.Tensor, exceptions: Exceptions) -> None:
    """``main`` holds its low 16 bits in the first half of its bytes (as
    :func:`encode_in_place` left them); rebuild the fp32 main from them, the unchanged
    bf16 ``param`` and the exceptions."""
    decode_by_rule_in_place(main, param)
    put_exceptions(main, exceptions)


@torch.no_grad()
def decode_by_rule_in_place(main: torch.Tensor, param: torch.Tensor) -> None:
    """:func:`decode_in_place` but the exceptions (back to front): the high halves the
    rounding rule implies; :func:`put_exceptions` then corrects the exceptions'. Apart
    so that the codec's CUDA graphs can hold this part (it reads no host memory)."""
    flat, param, stored = main.view(-1), param.view(-1), stored_view(main, STORAGE_DTYPE)
    for s, e in chunks(main.numel(), backwards=True):
        low = stored[s:e].clone()  # read the chunk before writing over it
        high = _guess_high(low, param[s:e])
        out_low, out_high = _halves(flat[s:e])
        out_low.copy_(low)
        out_high.copy_(high)


@torch.no_grad()
def put_exceptions(main: torch.Tensor, exceptions: Exceptions) -> None:
    """The exceptions' true high halves into the fp32 ``main`` (after
    :func:`decode_by_rule_in_place`, or the fused decoder's), in groups whose device
    copies stay within the conversion scratch (10 bytes each): usually one group."""
    flat = main.view(-1)
    highs = _halves(flat)[1]
    group = CHUNK_ELEMENTS // 4
    for s in range(0, len(exceptions), group):
        index, high = exceptions.index[s : s + group], exceptions.high[s : s + group]
        highs[_to_device(index, flat.device)] = _to_device(high, flat.device)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the CPU) on ``device``. To CUDA through a pinned copy: from pageable memory
    a copy holds the host until the device has run everything queued before it (an
    entry's decode), which then idles while the host catches up."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
