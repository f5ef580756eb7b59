"""An entry's remainder main and 8-bit moments, converted together on CUDA.

The compact formats' usual combination (``--stream-optimizer-state-main-storage
remainder`` with 8-bit moments) converts each entry's three fp32 tensors with one
fused launch per chunk (``fused.entry_encode`` / ``entry_decode``) instead of one
per chunk and tensor: the same bytes as :mod:`remainder` and :mod:`quant8`
convert each alone, which stay the reference (and the CPU path). Small entries
stay packed as before (``fused.plan_packed``).
"""

from __future__ import annotations

import torch

from miles_plugins.optimizers.formats import fused, quant8, remainder

# The kernels convert exp_avg signed and exp_avg_sq as its root, unsigned.
assert quant8.MOMENT_FORMATS == {"exp_avg": (True, False), "exp_avg_sq": (False, True)}, "fused.entry_* fit no more"


def applies(main: torch.Tensor) -> bool:
    """Whether an entry whose main is ``main`` (remainders) and whose moments are 8-bit
    is converted together: on CUDA with the fused kernels, not a packed small one."""
    return fused.entry_fits(main.numel()) and fused.applies(main)


def encode_many(entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> list:
    """``remainder.encode_in_place(main, param)`` and ``quant8.narrow_in_place`` of both
    moments, in place, for each (main, exp_avg, exp_avg_sq, param) of ``entries``;
    returns each main's :class:`remainder.Exceptions`.

    Pipelined: an entry's exception counts (the host's one wait on the device per
    entry) are read once the next entry's launches are queued, so the device converts
    that one meanwhile instead of idling while the host catches up. Two entries' scratch
    at most: the one queued (16 MiB) and the low bits of the one before (8 MiB)."""
    found: list = []
    pending = None
    for main, exp_avg, exp_avg_sq, param in entries:
        device = main.device
        started = fused.entry_encode_start(
            (main.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)),
            param.view(-1),
            _stored(main, exp_avg, exp_avg_sq),
            (quant8._search_guide(True, device), quant8._search_guide(False, device)),
            quant8.BLOCK,
        )
        if pending is not None:
            found.append(_finish(pending))
        pending = started
    if pending is not None:
        found.append(_finish(pending))
    return found


def _finish(pending: fused.PendingEntry) -> remainder.Exceptions:
    return remainder.Exceptions.of(*fused.entry_encode_finish(pending, reference=remainder._exceptions))


def decode(
    main: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param: torch.Tensor,
    exceptions: remainder.Exceptions,
) -> None:
    """Undo :func:`encode_many` for one entry: the three fp32 tensors back from their stored forms, in place."""
    device = main.device
    fused.entry_decode(
        (main.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)),
        param.view(-1),
        _stored(main, exp_avg, exp_avg_sq),
        (quant8._tables(True, device)[0], quant8._tables(False, device)[0]),
        (exceptions.index, exceptions.high),
        quant8.BLOCK,
    )


def _stored(main: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor):
    """The views of the three stored forms: the main's low bits, each moment's codes and scales' bytes."""
    return (
        remainder.stored_view(main, remainder.STORAGE_DTYPE),
        quant8._codes_and_scales(exp_avg),
        quant8._codes_and_scales(exp_avg_sq),
    )
