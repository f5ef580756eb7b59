"""The 8-bit and remainder codecs as the store's codec calls them, for one entry or a
bucket's entries at once: by the fused kernels (``fused.py``, ``fused_remainder.py``)
where the registry says they serve the tensors (``kernels.serve``), by the reference
formulations (``quant8.py``, ``remainder.py``) elsewhere. The same bytes and the same
exceptions either way.

Where the kernels serve, a bucket's small entries (biases, norms) are converted packed,
a group at a time (:func:`plan_packed`): their conversion costs host time per
operation, not device time per byte.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from miles_plugins.optimizers.formats import fused, kernels, quant8, remainder
from miles_plugins.optimizers.formats.convert import stored_view
from miles_plugins.optimizers.formats.fused_remainder import ExceptionSlots, RemainderEncoding
from miles_plugins.optimizers.formats.remainder import Exceptions


def plan_packed(tensors: list[torch.Tensor], unit: int = 1) -> tuple[list[int], list[list[int]]]:
    """Which of ``tensors`` (one kind of conversion) to convert one by one, and which
    packed: ``fused.plan_sizes`` of those the kernels serve (the others one by one).
    ``unit``: the packed entries' sizes must be its multiples (whole 8-bit blocks)."""
    return fused.plan_sizes([t.numel() if kernels.serve(t) else 0 for t in tensors], unit)


# ---- 8-bit moments ------------------------------------------------------------------


@torch.no_grad()
def quant8_encode(t: torch.Tensor, signed: bool, sqrt: bool) -> None:
    """``quant8.encode_in_place`` of ``t``, by the fused kernels where they serve it."""
    if not quant8.quantizes(t.numel()):
        return
    if not kernels.serve(t):
        quant8.encode_in_place(t, signed, sqrt)
        return
    codes_out, scales_out = quant8.codes_and_scales(t)
    scales = torch.empty(-(-t.numel() // quant8.BLOCK), dtype=quant8.SCALE_DTYPE, device=t.device)
    guide = fused.quant8_guide(signed, t.device)
    fused.quant8_encode(t.view(-1), codes_out, scales, guide, sqrt, quant8.BLOCK, kernels.for_device(t.device))
    # Bytes [n, n + 4 * blocks) are fp32 elements [n / 4, ...): all read by now.
    scales_out.copy_(scales.view(torch.uint8))


@torch.no_grad()
def quant8_decode(t: torch.Tensor, signed: bool, sqrt: bool) -> None:
    """``quant8.decode_in_place`` of ``t``, by the fused kernels where they serve it."""
    if not quant8.quantizes(t.numel()):
        return
    if not kernels.serve(t):
        quant8.decode_in_place(t, signed, sqrt)
        return
    codes_in, scales_in = quant8.codes_and_scales(t)
    scales = scales_in.clone().view(quant8.SCALE_DTYPE)  # the first chunks' fp32 values land on them
    values = quant8.tables(signed, t.device)[0]
    fused.quant8_decode(t.view(-1), codes_in, scales, values, sqrt, quant8.BLOCK, kernels.for_device(t.device))


def quant8_encode_many(tensors: list[torch.Tensor], signed: bool, sqrt: bool) -> None:
    """:func:`quant8_encode` of every tensor, the small ones packed (:func:`plan_packed`)."""
    _each_or_packed(tensors, signed, sqrt, quant8_encode, fused.quant8_encode_packed, fused.quant8_guide)


def quant8_decode_many(tensors: list[torch.Tensor], signed: bool, sqrt: bool) -> None:
    """:func:`quant8_decode` of every tensor, packed as :func:`quant8_encode_many` packs."""
    _each_or_packed(tensors, signed, sqrt, quant8_decode, fused.quant8_decode_packed, lambda *a: quant8.tables(*a)[0])


def _each_or_packed(tensors: list[torch.Tensor], signed: bool, sqrt: bool, one, packed, table: Callable) -> None:
    """``one(t, signed, sqrt)`` for the tensors :func:`plan_packed` leaves alone, and
    ``packed`` for each of its groups, with the map's ``table(signed, device)``."""
    singles, groups = plan_packed(tensors, unit=quant8.BLOCK)
    for k in singles:
        one(tensors[k], signed, sqrt)
    for group in groups:
        device = tensors[group[0]].device
        packed(
            [tensors[k].view(-1) for k in group],
            [quant8.codes_and_scales(tensors[k]) for k in group],
            table(signed, device),
            sqrt,
            quant8.BLOCK,
            kernels.for_device(device),
        )


# ---- remainder mains ----------------------------------------------------------------


class RemainderBucketEncoding:
    """``remainder.encode_in_place`` of several mains (a bucket's) at once, in two
    halves: :meth:`launch` queues the conversion, :meth:`finish` returns every main's
    exceptions. Where the fused kernels serve, the small mains are packed a group at a
    time (:func:`plan_packed`), nothing in :meth:`launch` reads back to the host (the
    codec's CUDA graphs hold it) and :meth:`finish` waits on the device once for all;
    elsewhere :meth:`launch` encodes by the reference. ``slots``: where the kernels
    collect the exceptions (the codec keeps one so that its addresses repeat), a new
    one when not given."""

    def __init__(
        self, mains: list[torch.Tensor], params: list[torch.Tensor], slots: ExceptionSlots | None = None
    ) -> None:
        self.mains, self.params = mains, params
        self._found: list[Exceptions] | None = None if mains else []
        self._fused: RemainderEncoding | None = None
        if mains and kernels.serve(mains[0]):
            singles, groups = plan_packed(mains)
            self._fused = RemainderEncoding(
                [m.view(-1) for m in mains],
                [p.view(-1) for p in params],
                [stored_view(m, remainder.STORAGE_DTYPE) for m in mains],
                singles=singles,
                groups=groups,
                slots=slots or ExceptionSlots(),
                # Now, not at launch: a replayed graph launches nothing, and finish() may resume a run.
                kernels=kernels.for_device(mains[0].device),
            )

    def key(self) -> tuple | None:
        """What a CUDA graph of :meth:`launch` depends on beyond its tensors' addresses."""
        return self._fused.key() if self._fused is not None else None

    def launch(self) -> None:
        if self._fused is not None:
            self._fused.launch()
        else:
            self._found = [remainder.encode_in_place(m, p) for m, p in zip(self.mains, self.params, strict=True)]

    def finish(self) -> list[Exceptions]:
        if self._fused is not None:
            return self._fused.finish()
        if self._found is None:
            raise RuntimeError(
                "RemainderBucketEncoding.finish() before launch(): the reference path encodes in launch()"
            )
        return self._found


def remainder_encode_many(mains: list[torch.Tensor], params: list[torch.Tensor]) -> list[Exceptions]:
    """``remainder.encode_in_place`` of every main (beside its param), as
    :class:`RemainderBucketEncoding` encodes them."""
    encoding = RemainderBucketEncoding(mains, params)
    encoding.launch()
    return encoding.finish()


def remainder_decode_by_rule_many(mains: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    """``remainder.decode_by_rule_in_place`` of every main, by the fused kernels where
    they serve it, the small ones packed as :func:`remainder_encode_many` packs them;
    ``remainder.put_exceptions`` then corrects each main's exceptions."""
    singles, groups = plan_packed(mains)
    for k in singles:
        main, param = mains[k], params[k]
        if kernels.serve(main):
            low = stored_view(main, remainder.STORAGE_DTYPE)
            fused.remainder_decode_by_rule(main.view(-1), param.view(-1), low, kernels.for_device(main.device))
        else:
            remainder.decode_by_rule_in_place(main, param)
    for group in groups:
        fused.remainder_decode_by_rule_packed(
            [mains[k].view(-1) for k in group],
            [params[k].view(-1) for k in group],
            [stored_view(mains[k], remainder.STORAGE_DTYPE) for k in group],
            kernels.for_device(mains[group[0]].device),
        )
