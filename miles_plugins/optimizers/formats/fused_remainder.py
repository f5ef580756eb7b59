"""The fused remainder encoder: the low 16 bits of fp32 mains written into their own
storage by the ``remainder_encode`` kernel (``triton_kernels.py``), the exceptions the
rounding rule misses (``remainder.py``) collected on the device in slots a CUDA graph
can hold, and read back once per bucket. The same low bits and exceptions as
``remainder.encode_in_place``, the reference.

A run of the encoder is an entry's chunks (``fused.geometric_chunks``, up to
``_MAX_RUN_CHUNKS``) or a packed group (``fused.plan_sizes``), with a region of slots
of its own (:func:`exception_capacity`). Exceptions past a run's slots (a chunk full of
NaN mains, say) are found by the reference finder (``remainder.find_exceptions``) from
fp32 values the kernels left unread: see :class:`RemainderEncoding`.
"""

from __future__ import annotations

from types import ModuleType

import torch

from miles_plugins.optimizers.formats import fused
from miles_plugins.optimizers.formats.remainder import Exceptions, find_exceptions

# Slots per run: one per 4096 elements, at least 1024 (a trained model's rate of
# exceptions is about one in 2**17).
_SLOTS_MIN = 1 << 10
_ELEMENTS_PER_SLOT = 1 << 12
# Chunks of one run (the encoder's exception counts per chunk): 4M elements, then
# doubling to the longest chunk of a launch, then that each; far past any entry
# Megatron builds.
_MAX_RUN_CHUNKS = 32
assert _MAX_RUN_CHUNKS & (_MAX_RUN_CHUNKS - 1) == 0, "the kernel loads the counts with tl.arange: a power of two"


def exception_capacity(n: int) -> int:
    """Device slots for the exceptions of an encoder run of ``n`` elements."""
    return max(_SLOTS_MIN, n // _ELEMENTS_PER_SLOT)


def _run_sizes(sizes: list[int], singles: list[int], groups: list[list[int]]) -> list[int]:
    """Elements per run of the encoder: each single, then each packed group."""
    return [sizes[k] for k in singles] + [sum(sizes[k] for k in group) for group in groups]


def slots_needed(sizes: list[int]) -> tuple[int, int]:
    """Runs and slots in all that :class:`RemainderEncoding` takes for mains of ``sizes``
    elements on a device where the kernels serve (what ``ExceptionSlots.reserve`` takes)."""
    capacities = [exception_capacity(n) for n in _run_sizes(sizes, *fused.plan_sizes(sizes, 1))]
    return len(capacities), sum(capacities)


def _launch_encode(kernels: ModuleType, bits, param, low, counts, chunk: int, found, n: int, base: int, capacity: int):
    kernels.remainder_encode[(fused.cdiv(n, fused.ELEMENTS_PER_PROGRAM),)](
        bits,
        param,
        low,
        counts,
        chunk,
        found,
        n,
        base,
        capacity,
        SPAN=fused.ELEMENTS_PER_PROGRAM,
        CHUNKS=_MAX_RUN_CHUNKS,
        num_warps=fused.WARPS_PER_PROGRAM,
    )


class ExceptionSlots:
    """Where the remainder encoder's kernels leave the exceptions they find, on one
    device: per run, a row of per-chunk counts and a region of slots
    (:func:`exception_capacity`), each slot an exception's element number and true
    high half in one int64 (``number << 16 | high & 0xFFFF``: sorting them sorts by
    number). Counts and slots share one device buffer (the counts' rows first), so that
    :meth:`read_back` brings both to the host in one copy, into a pinned copy of the
    buffer. Grown to the largest need seen and then kept (the codec reserves its
    largest bucket's :func:`slots_needed` at its first encode), so that the addresses
    repeat from step to step and a CUDA graph can hold the encoder's launches: 8 bytes
    per slot and 128 per run, so 8 KiB per run of up to 4M elements and 2 bytes per
    1024 elements beyond, on the device and again in host memory (pinned for a CUDA
    buffer: torch's pinned allocator rounds that up to a power of two, and keeps it
    cached after :meth:`release`)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # int64: `rows` rows of counts (as int32), then the slots
        self.host: torch.Tensor | None = None  # read_back's snapshot of it (pinned for a CUDA buffer)
        self.rows = 0
        self.width = _MAX_RUN_CHUNKS  # counts per row, as at the buffer's allocation (tests shrink it)

    @property
    def counts(self) -> torch.Tensor:
        """int32, a row of :attr:`width` counts per run (a view of the buffer)."""
        return self._counts(self.buffer)

    @property
    def found(self) -> torch.Tensor:
        """int64, every run's region of slots end to end (a view of the buffer)."""
        return self.buffer[self._words :]

    @property
    def _words(self) -> int:
        """int64 words the counts' rows take (two int32 counts each)."""
        return self.rows * -(-self.width // 2)

    def _counts(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[: self._words].view(torch.int32)[: self.rows * self.width].view(self.rows, self.width)

    def reserve(self, rows: int, total: int, device: torch.device) -> None:
        """Room for ``rows`` runs of ``total`` slots in all on ``device``: a larger buffer
        where the present one falls short (at a new address: the sizes enter :meth:`key`)."""
        if device.type == "cuda" and device.index is None:  # as a tensor's device reads
            device = torch.device("cuda", torch.cuda.current_device())
        if self.buffer is not None and self.buffer.device == device and self.width == _MAX_RUN_CHUNKS:
            if self.rows >= rows and self.found.numel() >= total:
                return
            rows, total = max(rows, self.rows), max(total, self.found.numel())
        self.release()  # before the larger one is allocated
        self.rows, self.width = rows, _MAX_RUN_CHUNKS
        self.buffer = torch.zeros(self._words + total, dtype=torch.int64, device=device)
        self.host = torch.empty_like(self.buffer, device="cpu", pin_memory=device.type == "cuda")

    def read_back(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every run's counts and the first ``used`` slots, as they are once everything
        queued on the device's current stream has run (this waits for it): views of a
        snapshot in host memory, taken in one copy and valid until the next call."""
        if used > self.found.numel():
            raise ValueError(f"{used} slots read back from {self.found.numel()}")
        n = self._words + used
        if self.buffer.is_cuda:
            self.host[:n].copy_(self.buffer[:n], non_blocking=True)
            torch.cuda.current_stream(self.buffer.device).synchronize()
        else:  # Triton's interpreter: a snapshot all the same, so later launches leave it be
            self.host[:n].copy_(self.buffer[:n])
        return self._counts(self.host), self.host[self._words : n]

    def key(self) -> tuple | None:
        """What a CUDA graph of launches into these slots depends on."""
        if self.buffer is None:
            return None
        return self.buffer.data_ptr(), self.rows, self.buffer.numel()

    def nbytes(self) -> int:
        """Device bytes (the host snapshot takes as many, before the pinned allocator's rounding)."""
        return 0 if self.buffer is None else self.buffer.nbytes

    def release(self) -> None:
        self.buffer = self.host = None
        self.rows = 0


class RemainderEncoding:
    """The fused remainder encoder over several mains at once (a bucket's), in two
    halves: :meth:`launch` queues every kernel and reads nothing back, so that a CUDA
    graph can hold it; :meth:`finish` then reads back every run's counts and exceptions
    (one copy to the host, whatever the count of runs; one more per run resumed after
    an overflow), and completes any run that overflowed its slots.

    Each chunk of a run stands down once the earlier ones overflowed (the kernel
    checks), so the overflowing chunk's fp32 elements, which the next chunk's low bits
    would land on, are still there for ``remainder.find_exceptions``; the run then
    resumes after it, eagerly. The low bits whose place is their own fp32 bytes (an
    entry's first chunk, a packed group's) wait in a scratch and are committed on the
    device unless their run overflowed there, leaving those fp32 bytes for the finder
    too.

    The kernels number the elements of all the runs in one sequence (the singles, then
    the groups' entries, in order), so one sort and one search split a bucket's
    exceptions by entry.

    ``flats``: the fp32 mains, flat; ``params``: their bf16 params, flat; ``lows``: the
    int16 views of each main's first half, where its low bits go; ``singles`` and
    ``groups``: indices into them (see ``fused.plan_sizes``); ``kernels``: the kernels'
    module to launch."""

    def __init__(
        self,
        flats: list[torch.Tensor],
        params: list[torch.Tensor],
        lows: list[torch.Tensor],
        *,
        singles: list[int],
        groups: list[list[int]],
        slots: ExceptionSlots,
        kernels: ModuleType,
    ) -> None:
        self.flats, self.params, self.lows = flats, params, lows
        self.singles, self.groups, self.slots, self.kernels = singles, groups, slots, kernels
        self.device = flats[0].device if flats else None
        self.spans = {k: list(fused.geometric_chunks(flats[k].numel(), ratio=2)) for k in singles}
        order = singles + [k for group in groups for k in group]
        # Entry k's first element's number in the kernels' one sequence.
        self.numbered = dict(zip(order, _offsets([flats[k].numel() for k in order]), strict=True))
        self.capacities = [exception_capacity(n) for n in _run_sizes([f.numel() for f in flats], singles, groups)]
        self.starts = _offsets(self.capacities)
        if self.capacities:
            slots.reserve(len(self.capacities), sum(self.capacities), self.device)

    def key(self) -> tuple:
        """What a CUDA graph of :meth:`launch` depends on beyond its tensors' addresses."""
        return self.slots.key(), tuple(self.capacities)

    @torch.no_grad()
    def launch(self) -> None:
        """Queue the runs' kernels on the current stream; no host reads."""
        if not self.capacities:
            return
        with fused.on_device(self.device):
            for r, k in enumerate(self.singles):
                self._launch_chunks(r, k, 0)
            for g, group in enumerate(self.groups):
                self._launch_group(len(self.singles) + g, group)

    @torch.no_grad()
    def finish(self) -> list[Exceptions]:
        """After :meth:`launch` (or a replay of its graph): every main's exceptions, on the
        CPU; those of a run that overflowed its slots found from their fp32 values."""
        found = [_NO_EXCEPTIONS] * len(self.flats)
        if not self.capacities:
            return [Exceptions.of(*pair) for pair in found]
        with fused.on_device(self.device):
            counts, slots = self.slots.read_back(sum(self.capacities))  # the wait on the device
            rows = counts[: len(self.capacities)].tolist()
            chunks = [min(len(self.spans[k]), _MAX_RUN_CHUNKS) for k in self.singles] + [1] * len(self.groups)
            fits = [_chunks_that_fit(row, n, cap) for row, n, cap in zip(rows, chunks, self.capacities, strict=True)]
            number, high = self._read(slots, [(r, total) for r, (_, total) in enumerate(fits)])
            if number.numel():  # each entry's share, by its numbers
                entries = list(self.numbered.items())
                bounds = torch.searchsorted(number, torch.tensor([n for _, n in entries])).tolist()
                for (k, first), a, b in zip(entries, bounds, bounds[1:] + [number.numel()], strict=True):
                    if a < b:
                        found[k] = (number[a:b] - first, high[a:b])
            for r, k in enumerate(self.singles):
                if fits[r][0] < len(self.spans[k]):  # overflowed, or longer than a run
                    found[k] = self._finish_chunks(r, k, fits[r][0], found[k])
            for g, group in enumerate(self.groups):
                if not fits[len(self.singles) + g][0]:
                    for k in group:  # overflowed: nothing committed, every entry's fp32 values intact
                        flat = self.flats[k]
                        found[k] = find_exceptions(flat, self.params[k], 0, flat.numel())
                        _commit_from_fp32(flat, self.lows[k], flat.numel())
        return [Exceptions.of(*pair) for pair in found]

    def _region(self, r: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        start, capacity = self.starts[r], self.capacities[r]
        return self.slots.counts[r], self.slots.found[start : start + capacity], capacity

    def _launch_chunks(self, r: int, k: int, chunk: int) -> None:
        """Single ``k``'s chunks from its ``chunk``-th on, as run ``r``."""
        spans = self.spans[k][chunk : chunk + _MAX_RUN_CHUNKS]
        if not spans:
            return
        counts, found, capacity = self._region(r)
        flat, low, number = self.flats[k], self.lows[k], self.numbered[k]
        bits, param = flat.view(torch.int32), self.params[k].view(torch.int16)
        counts.zero_()
        scratch = torch.empty(spans[0][1], dtype=torch.int16, device=flat.device) if spans[0][0] == 0 else None
        for c, (s, e) in enumerate(spans):
            target = scratch if s == 0 else low[s:e]
            _launch_encode(self.kernels, bits[s:e], param[s:e], target, counts, c, found, e - s, number + s, capacity)
        if scratch is not None:  # the first chunk's low bits, over its own fp32 bytes unless it overflowed
            e = spans[0][1]
            torch.where(counts[0] <= capacity, scratch, low[:e], out=scratch)
            low[:e].copy_(scratch)

    def _launch_group(self, r: int, group: list[int]) -> None:
        counts, found, capacity = self._region(r)
        x = torch.cat([self.flats[k] for k in group])
        p = torch.cat([self.params[k] for k in group])
        low = torch.empty(x.numel(), dtype=torch.int16, device=x.device)
        counts.zero_()
        bits, param = x.view(torch.int32), p.view(torch.int16)
        _launch_encode(self.kernels, bits, param, low, counts, 0, found, x.numel(), self.numbered[group[0]], capacity)
        del x, p, bits, param  # before the commit's temporary
        lows = [self.lows[k] for k in group]
        torch.where(counts[0] <= capacity, low, torch.cat(lows), out=low)  # unless overflowed: as they were
        torch._foreach_copy_(lows, list(low.split([self.flats[k].numel() for k in group])))

    def _read(self, slots: torch.Tensor, totals: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``total`` exceptions of each run ``r`` (``slots``: as
        ``ExceptionSlots.read_back`` gave them), sorted into new host tensors: their
        element numbers and true high halves."""
        taken = [slots[self.starts[r] : self.starts[r] + total] for r, total in totals if total]
        if not taken:
            return _NO_EXCEPTIONS
        found = torch.sort(torch.cat(taken)).values  # by number: a few hundred per bucket, usually
        low16 = found & 0xFFFF
        return found >> 16, (low16 - ((low16 & 0x8000) << 1)).to(torch.int16)  # the high half, signed

    def _finish_chunks(self, r: int, k: int, ran: int, found) -> tuple[torch.Tensor, torch.Tensor]:
        """Single ``k``'s exceptions after its first run stopped at chunk ``ran`` (overflowed
        there, or ended; ``found``: those of the chunks before it): an overflowing chunk's
        by the reference finder, then the rest of the entry's chunks eagerly."""
        flat, param, spans = self.flats[k], self.params[k], self.spans[k]
        parts, first = [found], 0
        while first < len(spans):
            run = spans[first : first + _MAX_RUN_CHUNKS]
            if first:  # the entry's chunks past the overflow (or past the first run)
                self._launch_chunks(r, k, first)
                counts, slots = self.slots.read_back(sum(self.capacities))
                ran, total = _chunks_that_fit(counts[r].tolist(), len(run), self.capacities[r])
                number, high = self._read(slots, [(r, total)])
                parts.append((number - self.numbered[k], high))
            if ran < len(run):  # chunk `ran` overflowed (those after it stood down)
                s, e = run[ran]
                parts.append(find_exceptions(flat, param, s, e))
                if s == 0:  # its low bits were not committed: from its fp32 bytes, just read
                    _commit_from_fp32(flat, self.lows[k], e)
            first += ran + (ran < len(run))  # past the overflowing chunk, or the whole run
        parts = [part for part in parts if part[0].numel()]
        if len(parts) <= 1:
            return parts[0] if parts else _NO_EXCEPTIONS
        return torch.cat([i for i, _ in parts]), torch.cat([h for _, h in parts])


# No exceptions: shared by every entry without any (never written to: empty).
_NO_EXCEPTIONS = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int16))


def _offsets(sizes: list[int]) -> list[int]:
    """Where each of consecutive pieces of ``sizes`` elements starts."""
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    return offsets


def _chunks_that_fit(counts: list[int], chunks: int, capacity: int) -> tuple[int, int]:
    """How many of a run's first ``chunks`` fit its slots (counted in ``counts``; a chunk
    after them overflowed, those after it stood down: -1), and their exceptions' count."""
    ran = total = 0
    for count in counts[:chunks]:
        if count < 0 or total + count > capacity:
            break
        ran, total = ran + 1, total + count
    return ran, total


def _commit_from_fp32(flat: torch.Tensor, low_out: torch.Tensor, e: int) -> None:
    """The low bits of fp32 elements ``[0, e)`` into ``low_out[:e]`` (read out first: they
    land on the first of those elements' bytes)."""
    low_out[:e].copy_(flat.view(torch.int16).view(-1, 2)[:e, 0].clone())


@torch.no_grad()
def remainder_encode(flat: torch.Tensor, param: torch.Tensor, low_out: torch.Tensor, kernels: ModuleType) -> Exceptions:
    """Low 16 bits of the fp32 ``flat`` into ``low_out`` (the first half of its storage),
    by ``kernels``; returns the exceptions (on the CPU). :class:`RemainderEncoding` of
    one entry."""
    with fused.on_device(flat.device):
        encoding = RemainderEncoding(
            [flat], [param], [low_out], singles=[0], groups=[], slots=ExceptionSlots(), kernels=kernels
        )
        encoding.launch()
        return encoding.finish()[0]
