"""Storage-format conversions done inside the fp32 tensor's own storage.

A bucket's fp32 moments (and remainder mains) are stored in fewer bytes than
they compute in. Converting through a full-size temporary would add that temporary to
the device memory of every bucket in flight; instead the stored bytes live in
the first bytes of the fp32 tensor's storage, and conversions walk it in chunks
in the one direction that never overwrites bytes still to be read:

- decoding (stored -> fp32) goes back to front: fp32 chunk ``[s, e)`` covers
  stored elements ``[2s, 2e)`` (for a 2-byte format), which are either in this
  chunk (copied out first) or in later chunks (already converted);
- encoding (fp32 -> stored) goes front to back: stored chunk ``[s, e)`` covers
  fp32 elements ``[s/2, e/2)``, all already read.

Each chunk is read into a small temporary before anything is written (the
kernels run in stream order), so the device scratch is one chunk.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Elements per conversion chunk: the scratch a conversion needs is this many
# fp32 values (16 MiB), whatever the bucket size.
CHUNK_ELEMENTS = 1 << 22


def stored_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The first ``numel * dtype.itemsize`` bytes of ``t``'s storage, as ``dtype``."""
    return t.view(-1).view(torch.uint8)[: t.numel() * dtype.itemsize].view(dtype)


def chunks(n: int, backwards: bool = False) -> Iterator[tuple[int, int]]:
    """Chunks ``[s, e)`` of ``n`` elements, ``CHUNK_ELEMENTS`` each (the last shorter),
    front to back or back to front."""
    starts = range(0, n, CHUNK_ELEMENTS)
    for start in reversed(starts) if backwards else starts:
        yield start, min(start + CHUNK_ELEMENTS, n)


@torch.no_grad()
def decode_in_place(t: torch.Tensor, stored: torch.dtype) -> None:
    """``t`` (fp32) holds its values in format ``stored`` in its first bytes; make them fp32."""
    src, dst = stored_view(t, stored), t.view(-1)
    for s, e in chunks(t.numel(), backwards=True):
        dst[s:e].copy_(src[s:e].float())


@torch.no_grad()
def encode_in_place(t: torch.Tensor, stored: torch.dtype) -> torch.Tensor:
    """Rewrite ``t`` (fp32) in format ``stored`` into its first bytes; returns that view.
    ``t``'s fp32 values are gone afterwards."""
    src, dst = t.view(-1), stored_view(t, stored)
    for s, e in chunks(t.numel()):
        dst[s:e].copy_(src[s:e].to(stored))
    return dst
