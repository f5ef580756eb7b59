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

The contract: between :func:`encode` and :func:`decode` the bf16 param must not
change. Megatron and the torch front end guarantee it: params change only in
the step (which re-encodes) and in ``reload_model_params`` / checkpoint loads
(which re-encode or restore the low bits saved with the same params).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STORAGE_DTYPE = torch.int16  # the low 16 bits, as stored
_TIE = -0x8000  # 0x8000 read as int16


@dataclass
class Exceptions:
    """Elements whose high bits the rounding rule gets wrong: flat indices into
    the main and their true high 16 bits. Kept on the CPU (they are few)."""

    index: torch.Tensor  # int64
    high: torch.Tensor  # int16

    @classmethod
    def none(cls) -> Exceptions:
        return cls(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=STORAGE_DTYPE))

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
    return param.view(-1).view(STORAGE_DTYPE) - rounded_up.to(STORAGE_DTYPE)


def check_param(param: torch.Tensor) -> None:
    if param.dtype != torch.bfloat16:
        raise ValueError(f"remainder mains need bf16 params (the main's high half), got {param.dtype}")


@torch.no_grad()
def encode(main: torch.Tensor, param: torch.Tensor, low_out: torch.Tensor) -> Exceptions:
    """Store ``main``'s low 16 bits into ``low_out`` (int16, same numel); return
    the exceptions :func:`decode` needs beside ``param`` to rebuild it exactly."""
    low, high = _halves(main)
    low_out.view(-1).copy_(low)
    wrong = high != _guess_high(low, param)
    index = wrong.nonzero().view(-1)
    if index.numel() == 0:
        return Exceptions.none()
    return Exceptions(index.cpu(), high[index].cpu())


@torch.no_grad()
def decode(low: torch.Tensor, param: torch.Tensor, exceptions: Exceptions, main_out: torch.Tensor) -> None:
    """Rebuild the fp32 main into ``main_out`` from its stored low bits, the
    unchanged bf16 param and the exceptions :func:`encode` returned."""
    low = low.view(-1)
    out_low, out_high = _halves(main_out)
    out_low.copy_(low)
    out_high.copy_(_guess_high(low, param))
    if len(exceptions):
        out_high[exceptions.index.to(main_out.device)] = exceptions.high.to(main_out.device)
