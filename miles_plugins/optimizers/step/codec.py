"""Storage formats, per segment: what a bucket's fp32 tensors become on their way to
storage and back.

Every tensor of a bucket in flight is fp32 (mains and both moments); its bytes
in storage are in the segment's dtype (``layout.Segment.dtype``):

- ``main`` as fp32 (as is), or as int16 remainders (``remainder.py``): the low
  16 bits, plus per entry the few *exceptions* the bf16 param cannot imply;
- ``exp_avg`` / ``exp_avg_sq`` as fp32 (as is), bf16 (``convert.py``), or
  8-bit codes with per-block scales (``quant8.py``).

The stored bytes always live in the first bytes of the fp32 tensor's own
storage: a read fills them there and :meth:`Codec.decode` decodes them in place;
:meth:`Codec.encode` encodes in place before a write, a bucket's entries at once
(``formats/entry_codecs.py``: on CUDA, small entries are converted packed, and a
bucket's conversions are replayed from a CUDA graph once its addresses repeat: see
``graphs.py``). No full-size temporary.

The codec owns the remainder exceptions, which are state: they travel with
checkpoints (:meth:`export` / :meth:`check` / :meth:`restore`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_plugins.optimizers.formats import convert, entry_codecs, fused_remainder, kernels, quant8, remainder
from miles_plugins.optimizers.formats.layout import BucketLayout, Segment
from miles_plugins.optimizers.step.graphs import BucketGraphs

# What the codec converts: (segment, entry index in the bucket, fp32 tensor, bf16 param).
Item = tuple[Segment, int, torch.Tensor, torch.Tensor]


def stored_bytes(tensor: torch.Tensor, segment: Segment) -> torch.Tensor:
    """The flat uint8 view of ``tensor``'s storage that holds its stored form."""
    return tensor.view(-1).view(torch.uint8)[: segment.stored_nbytes(tensor.numel())]


class Codec:
    """The per-segment encode/decode of one store's buckets."""

    def __init__(self, buckets: Sequence[BucketLayout], device: torch.device | None = None) -> None:
        # The fused kernels are built and self-tested here, at setup, where they will serve:
        # inside the first step their test inputs would add to the step's device memory.
        if device is not None and device.type == "cuda" and any(b.converted_bytes for b in buckets):
            kernels.for_device(device)
        # Remainder mains: per bucket, per entry, the elements the rounding rule misses.
        self.exceptions = [[remainder.Exceptions.none() for _ in b.numels] for b in buckets]
        self.graphs = BucketGraphs()  # on CUDA with the fused kernels: see graphs.py
        # The fused remainder encoder's exception slots, kept for the graphs; the largest
        # bucket's reserved at the first encode, so that their addresses repeat from then on.
        self.slots = fused_remainder.ExceptionSlots()
        remainders = [b.numels for b in buckets if b.streams_main and self.is_remainder(b.segments["main"])]
        needed = [fused_remainder.slots_needed(list(numels)) for numels in remainders] or [(0, 0)]
        self._slots_needed = (max(rows for rows, _ in needed), max(total for _, total in needed))

    @staticmethod
    def is_remainder(segment: Segment) -> bool:
        return segment.name == "main" and segment.dtype == remainder.STORAGE_DTYPE

    @staticmethod
    def converts(segment: Segment, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s stored form may differ from its fp32 form (it is
        then decoded after a read)."""
        return segment.blockwise or segment.dtype != tensor.dtype

    def decode(self, bucket: BucketLayout, items: Sequence[Item]) -> None:
        """Turn the stored forms (just read) of ``items`` (entries of ``bucket``) into
        fp32, in place."""
        groups = self._by_conversion(items)
        self._run(("decode", bucket.index), groups, lambda: self._decode_groups(groups))
        # After the graph (they come from host memory): the remainder exceptions.
        for _, k, tensor, _ in dict(groups).get("remainder", ()):
            remainder.put_exceptions(tensor, self.exceptions[bucket.index][k])

    def encode(self, bucket: BucketLayout, items: Sequence[Item]) -> None:
        """Turn the fp32 tensors of ``items`` (entries of ``bucket``) into their stored
        forms, in place (their fp32 values are gone afterwards). Each param must
        already hold its updated main rounded to bf16 (remainder mains)."""
        groups = self._by_conversion(items)
        mains = dict(groups).get("remainder", [])
        rest = [(kind, group) for kind, group in groups if kind != "remainder"]
        if mains and kernels.serve(mains[0][2]):
            self.slots.reserve(*self._slots_needed, mains[0][2].device)
        encoding = entry_codecs.RemainderBucketEncoding(
            [t for _, _, t, _ in mains], [param for *_, param in mains], self.slots
        )

        def encode_all() -> None:
            self._encode_groups(rest)
            encoding.launch()

        self._run(("encode", bucket.index), groups, encode_all, encoding.key())
        # After the graph: the remainder exceptions, read back from the device.
        for (_, k, _, _), exceptions in zip(mains, encoding.finish(), strict=True):
            self.exceptions[bucket.index][k] = exceptions

    def release(self) -> None:
        """Drop the graphs and the remainder encoder's slots (device memory; the next
        conversions run eagerly, and the slots come back at their first encode)."""
        self.graphs.release()
        self.slots.release()

    def _run(self, slot: tuple[str, int], groups: list[tuple[object, list[Item]]], convert, extra=None) -> None:
        """``convert()`` of ``groups``, through ``self.graphs`` where the fused kernels serve
        (``extra``: what else the conversion's addresses depend on)."""
        tensors = [(kind, tensor, param) for kind, group in groups for _, _, tensor, param in group]
        if not tensors or not kernels.serve(tensors[0][1]):
            convert()
            return
        # The param's address only where the conversion reads it: a moved param (an RL
        # offload and reload) leaves the moments' graphs valid.
        key = tuple(
            (kind, t.data_ptr(), t.numel(), p.data_ptr() if kind == "remainder" else 0) for kind, t, p in tensors
        ) + (extra,)
        self.graphs.run(slot, key, tensors[0][1].device, convert)

    @staticmethod
    def _decode_groups(groups: list[tuple[object, list[Item]]]) -> None:
        for kind, group in groups:
            tensors = [tensor for _, _, tensor, _ in group]
            if kind == "remainder":
                entry_codecs.remainder_decode_by_rule_many(tensors, [param for *_, param in group])
            elif kind in quant8.MOMENT_FORMATS:
                entry_codecs.quant8_decode_many(tensors, *quant8.MOMENT_FORMATS[kind])
            else:
                for tensor in tensors:
                    convert.decode_in_place(tensor, kind)

    @staticmethod
    def _encode_groups(groups: list[tuple[object, list[Item]]]) -> None:
        for kind, group in groups:
            tensors = [tensor for _, _, tensor, _ in group]
            if kind in quant8.MOMENT_FORMATS:
                entry_codecs.quant8_encode_many(tensors, *quant8.MOMENT_FORMATS[kind])
            else:
                for tensor in tensors:
                    convert.encode_in_place(tensor, kind)

    def _by_conversion(self, items: Sequence[Item]) -> list[tuple[object, list[Item]]]:
        """``items`` whose stored form differs from fp32, grouped by conversion: "remainder",
        an 8-bit moment's name, or the stored dtype (the group's first item's order)."""
        groups: dict[object, list[Item]] = {}
        for item in items:
            segment, _, tensor, _ = item
            if self.is_remainder(segment):
                groups.setdefault("remainder", []).append(item)
            elif segment.blockwise:
                groups.setdefault(segment.name, []).append(item)
            elif self.converts(segment, tensor):
                groups.setdefault(segment.dtype, []).append(item)
        return list(groups.items())

    # ---- checkpoints -------------------------------------------------------------

    def export(self) -> list:
        """The exceptions as JSON: per bucket, per entry, [indices, high bits]."""
        return [[[e.index.tolist(), e.high.tolist()] for e in bucket] for bucket in self.exceptions]

    def check(self, saved: object, buckets: Sequence[BucketLayout]) -> list[str]:
        """What keeps ``saved`` (:meth:`export`'s output) from fitting ``buckets``;
        empty when it fits. Changes nothing."""
        if not isinstance(saved, list) or len(saved) != len(buckets):
            return [f"remainder exceptions for {_count(saved)} buckets, the layout has {len(buckets)}"]
        problems = []
        for bucket, entries in zip(buckets, saved, strict=True):
            if not isinstance(entries, list) or len(entries) != len(bucket.numels):
                problems.append(
                    f"bucket {bucket.index}: exceptions for {_count(entries)} entries, not {len(bucket.numels)}"
                )
                continue
            for k, (numel, pair) in enumerate(zip(bucket.numels, entries, strict=True)):
                if not _valid_exceptions(pair, numel):
                    problems.append(f"bucket {bucket.index}, entry {k}: malformed remainder exceptions")
        return problems

    def restore(self, saved: list) -> None:
        """Adopt :meth:`export`'s output (checked by :meth:`check`)."""
        self.exceptions = [
            [
                remainder.Exceptions(
                    torch.tensor(index, dtype=torch.int64), torch.tensor(high, dtype=remainder.STORAGE_DTYPE)
                )
                for index, high in bucket
            ]
            for bucket in saved
        ]


def _count(value: object) -> object:
    return len(value) if isinstance(value, list) else value


def _valid_exceptions(pair: object, numel: int) -> bool:
    """[indices ascending within [0, numel), int16 high bits], equally long."""
    if not isinstance(pair, list) or len(pair) != 2:
        return False
    index, high = pair
    if not isinstance(index, list) or not isinstance(high, list) or len(index) != len(high):
        return False
    if not all(type(i) is int for i in index) or not all(type(h) is int and -(2**15) <= h < 2**15 for h in high):
        return False
    in_range = not index or (0 <= index[0] and index[-1] < numel)
    return in_range and all(a < b for a, b in zip(index, index[1:], strict=False))
