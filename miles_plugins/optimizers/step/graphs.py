"""CUDA graphs of a bucket's conversions (``codec.py``), replayed once its tensors'
addresses repeat.

Why: the fused codec is bound by the host's launches, not by the device: a bucket's
conversions issue hundreds of Triton launches and thousands of tensor views for
little device work (docs/design.md gives the figures). A graph replays a bucket's
launches in one call.

A graph bakes in every address it touches, and the store materializes a bucket's fp32
tensors from the caching allocator at every step. So a graph is keyed by those
addresses (and what each tensor's conversion is), and captured when a bucket's
tensors are where they were at its last eager conversion. Where the caching
allocator repeats itself from step to step, every bucket then replays
(``StepStats`` counts each step's replays and eager runs). Where a bucket's tensors
moved, it converts eagerly; once the new addresses repeat, its graph is captured
again. At most one graph per bucket and direction.

What a graph must not hold stays out of it, and the codec runs it after the replay:
the remainder encoder's exceptions are read back to the host (from slots at fixed
addresses, ``fused_remainder.ExceptionSlots``), and the decoder's exceptions, which come
from host memory, are put eagerly.

Memory: a codec's graphs share one private pool of the caching allocator (they
replay one after another on the stream of the step). A capture allocates there what
the eager conversion would (its scratch, all freed within the capture), so the pool
holds about one bucket's conversion scratch for as long as any of them is held:
reserved, not allocated, memory. :meth:`BucketGraphs.release` drops them (the
store's ``close`` and ``offload_device_home``); the next capture takes a new pool
(torch refuses to capture into one whose last graph is gone).

A capture that fails raises, and so does every later conversion of the process:
torch leaves its allocator and the device's random generator mid-capture then (later
random draws fail), so the process cannot go on safely. The error names
``MILES_CODEC_GRAPHS=0``. Graphs need torch's ``_cuda_endAllocateToPool`` (to end a
failed capture); without it they stay off, with a warning. A capture runs nothing on the
device, so the bucket's tensors are as the failed step found them; the allocator is
taken out of its capture mode before the error is raised, for the store's clean-up.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Hashable

import torch

from miles_plugins.optimizers.formats.fused import on_device

logger = logging.getLogger(__name__)

# MILES_CODEC_GRAPHS=0 runs every conversion eagerly (a kill switch; the bench flips it
# to time both in one process).
enabled = os.environ.get("MILES_CODEC_GRAPHS", "1") != "0"
# The error of a capture that failed in this process: every later conversion raises it.
failed: RuntimeError | None = None


class BucketGraphs:
    """At most one CUDA graph per (direction, bucket) slot: captured when the slot is
    asked to convert at the addresses of its last eager conversion, replayed while
    they stay (see the module's docstring)."""

    def __init__(self) -> None:
        self._graphs: dict[Hashable, tuple[Hashable, torch.cuda.CUDAGraph]] = {}
        self._last_key: dict[Hashable, Hashable] = {}
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        # Counts of the process's conversions through this cache: graphs captured; runs
        # replayed (a capture's first run included) and run eagerly.
        self.captures = 0
        self.replays = 0
        self.eager = 0
        # The slots run eagerly since the last take_eager_slots(), in order, each once.
        self._eager_slots: dict[Hashable, None] = {}

    def run(self, slot: Hashable, key: Hashable, device: torch.device, convert: Callable[[], None]) -> None:
        """``convert()`` of tensors on the CUDA ``device``, queued on its current stream:
        replayed from ``slot``'s graph when it was captured at ``key`` (what ``convert``
        touches: addresses, sizes, conversions), captured then replayed when ``key``
        was ``slot``'s at its last eager conversion, else run eagerly. Raises again,
        once a capture failed in this process (see the module's docstring)."""
        if failed is not None:
            raise RuntimeError(f"not converting: {failed}") from failed
        if not enabled:
            self._eagerly(slot, convert)
            return
        held = self._graphs.get(slot)
        if held is not None and held[0] == key:
            with on_device(device):  # its current stream, whichever device is current
                held[1].replay()
            self.replays += 1
            return
        if self._last_key.get(slot) != key:
            self._last_key[slot] = key
            self._eagerly(slot, convert)
            return
        with on_device(device):
            graph = self._capture(device, convert)
            if graph is None:  # graphs just turned off (see _capture)
                self._eagerly(slot, convert)
                return
            self._graphs[slot] = (key, graph)  # replaces the graph of the addresses before
            self.captures += 1
            graph.replay()
        self.replays += 1

    def _eagerly(self, slot: Hashable, convert: Callable[[], None]) -> None:
        convert()
        self.eager += 1
        self._eager_slots[slot] = None

    def take_eager_slots(self) -> list[Hashable]:
        """The slots that converted eagerly since the last call (each once, first run
        first), forgotten here: which buckets' tensors keep moving."""
        slots, self._eager_slots = list(self._eager_slots), {}
        return slots

    def _capture(self, device: torch.device, convert: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
        global enabled, failed
        if not hasattr(torch.cuda.memory, "_cuda_endAllocateToPool"):
            # Without it a failed capture would leave the allocator in its capture mode too.
            enabled = False
            logger.warning("codec CUDA graphs off: this torch cannot end a failed capture; converting eagerly")
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        if not self._graphs:
            self._pool = torch.cuda.graph_pool_handle()  # none left in the pool before: a new one
        graph = torch.cuda.CUDAGraph()
        try:
            # Not torch.cuda.graph(): it synchronizes the device and empties the cache,
            # which a capture does not need. Thread-local: the engine's threads keep
            # copying on their own streams meanwhile.
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    convert()
                except BaseException:
                    with contextlib.suppress(Exception):  # the capture's own failure, not the cause
                        graph.capture_end()
                    raise
                graph.capture_end()
        except BaseException as exc:
            _abandon(graph, self._stream, device, self._pool)
            if not isinstance(exc, Exception):
                raise  # an interrupt, as it came
            failed = RuntimeError(
                f"a CUDA graph of the codec's conversions could not be captured ({type(exc).__name__}: {exc}); "
                "torch's allocator and random generator may be left mid-capture, so this process cannot go on "
                "safely: restart with MILES_CODEC_GRAPHS=0 (the conversions then run eagerly)"
            )
            raise failed from exc
        return graph

    def release(self) -> None:
        """Drop every graph (and with the last, the pool's memory, to the caching
        allocator). The next conversions run eagerly until their addresses repeat."""
        self._graphs.clear()
        self._last_key.clear()


def _abandon(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, device: torch.device, pool) -> None:
    """After a failed capture: end the stream's capture if it still runs, and take the
    allocator out of routing allocations to the pool (torch's ``capture_end`` leaves it
    there when the capture was invalidated); each only where it is still needed."""
    with torch.cuda.stream(stream):
        if torch.cuda.is_current_stream_capturing():
            with contextlib.suppress(Exception):  # invalidated: ended anyway
                graph.capture_end()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with contextlib.suppress(Exception):  # capture_begin never routed, or capture_end already stopped it
        torch.cuda.memory._cuda_endAllocateToPool(index, pool)
