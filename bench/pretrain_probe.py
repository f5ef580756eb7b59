"""A Megatron-LM script through the launcher, with a record of every iteration: the probe
the GPU tier and ``bench.suite`` share.

    torchrun --nproc-per-node=N -m bench.pretrain_probe pretrain_gpt.py [args]
    (PRETRAIN_PROBE_OUT=file.jsonl)

Wraps ``megatron.training.training.train_step`` (instrumentation, not part of the
launcher): after each step, rank 0 appends one JSON line to ``$PRETRAIN_PROBE_OUT``
with the iteration's reduced losses (``float.hex``, exact), a SHA-256 over a digest
of every model param's bits taken on the device (``_param_digest``;
``PRETRAIN_PROBE_HASH=0`` skips it), the train step's seconds (``seconds``), the
seconds since the probe's previous record (``interval_seconds``: the whole
iteration, Megatron's logging and checks between two steps included, the probe's
own hashing not; absent for the first), the optimizer step's seconds, the device memory reserved and allocated
at the run's peak so far (kept across resets of the allocator's statistics, the
probe's and an auto budget's), and, where streaming is on, what the step added to the device memory
allocated before it against the stores' ``step_device_bytes_bound``, and where
the state lives. Then it runs ``miles_plugins.launch`` on the arguments, so the
same harness serves the resident run (no streaming flag) and the streamed one.

The step's own peak is measured from a run's third iteration on: the peak statistics
are reset right before the step, and read again wherever something else (an auto
GPU budget, at the end of its step) resets them. Not earlier: an auto GPU budget
learns the forward/backward peak from the first iterations' statistics (later it
keeps the largest need seen, so a reset before the step no longer changes it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch

# The iteration of a run (1-based) from which the optimizer step's own peak is measured.
STEP_PEAKS_FROM = 3


# Elements per piece of the on-device digest (bounds its int64 temporaries to 512 MiB).
DIGEST_PIECE = 1 << 26


def _param_digest(param: torch.Tensor) -> int:
    """A position-weighted sum of the param's raw bits, on its device (hashing 15 GB of
    params on the CPU took seconds per iteration): any change of one element changes it
    (each weight is odd, the difference of two bit patterns below 2**32), and distinct
    changes cancel only by accident."""
    bits = param.detach().contiguous().view(-1)
    bits = bits.view({2: torch.int16, 4: torch.int32}.get(bits.element_size(), torch.uint8))
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), DIGEST_PIECE):
        piece = bits[start : start + DIGEST_PIECE].to(torch.int64)
        index = torch.arange(start, start + piece.numel(), dtype=torch.int64, device=bits.device)
        total += (piece * ((index * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) | 1)).sum()
    return int(total)


def _params_hash(model) -> str:
    digest = hashlib.sha256()
    for chunk in model:
        for param in chunk.parameters():
            digest.update(_param_digest(param).to_bytes(8, "little", signed=True))
    return digest.hexdigest()


class _StepProbe:
    """Times the optimizer's step and measures its own device peak (see the module docstring)."""

    def __init__(self) -> None:
        self.calls = 0
        self.measure = False
        self.seconds = 0.0
        self.added: int | None = None
        self._before = 0
        self._peak_at_reset = 0
        self.reserved_peak = 0  # the run's, across every reset of the statistics
        self.allocated_peak = 0
        reset = torch.cuda.reset_peak_memory_stats

        def reset_peak_memory_stats(*args, **kwargs):
            # Something resets the statistics inside the step (an auto GPU budget): keep its peak.
            self._peak_at_reset = max(self._peak_at_reset, torch.cuda.max_memory_allocated())
            self.keep_run_peaks()
            return reset(*args, **kwargs)

        torch.cuda.reset_peak_memory_stats = reset_peak_memory_stats
        self._reset = reset

    def keep_run_peaks(self) -> None:
        """Fold the allocator's peaks into the run's before its statistics are reset."""
        self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved())
        self.allocated_peak = max(self.allocated_peak, torch.cuda.max_memory_allocated())

    def wrap(self, optimizer) -> None:
        if getattr(optimizer, "_probe_wrapped", False):
            return
        step = optimizer.step

        def probed_step(*args, **kwargs):
            if self.measure:
                torch.cuda.synchronize()
                self._before = torch.cuda.memory_allocated()
                self.keep_run_peaks()
                self._reset()
                self._peak_at_reset = 0
            start = time.perf_counter()
            result = step(*args, **kwargs)
            torch.cuda.synchronize()
            self.seconds = time.perf_counter() - start
            if self.measure:
                self.added = max(self._peak_at_reset, torch.cuda.max_memory_allocated()) - self._before
            return result

        optimizer.step = probed_step
        optimizer._probe_wrapped = True


def _stores(optimizer) -> list:
    from megatron_hooks.contract import STORE_ATTR

    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(member, STORE_ATTR).store for member in chain if hasattr(member, STORE_ATTR)]


def _record_each_step(training, out: str) -> None:
    original = training.train_step
    hashing = os.environ.get("PRETRAIN_PROBE_HASH", "1") != "0"
    probe = _StepProbe()
    last_end: list[float] = []  # when the previous record was written: the probe's own work is no iteration's

    def train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        probe.wrap(optimizer)
        iteration = kwargs.get("iteration")
        probe.calls += 1  # this run's iterations: a resumed run's auto budget learns afresh
        probe.measure = probe.calls >= STEP_PEAKS_FROM
        probe.added = None
        start = time.perf_counter()
        result = original(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        torch.cuda.synchronize()
        end = time.perf_counter()
        seconds = end - start
        interval = end - last_end[0] if last_end else None
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            stores = _stores(optimizer)
            record = {
                "iteration": iteration,
                "losses": {k: float(v).hex() for k, v in result[0].items()},
                "params": _params_hash(model) if hashing else None,
                "seconds": seconds,
                "interval_seconds": interval,
                "step_seconds": probe.seconds,
                "max_reserved_bytes": max(probe.reserved_peak, torch.cuda.max_memory_reserved()),
                "max_allocated_bytes": max(probe.allocated_peak, torch.cuda.max_memory_allocated()),
                "device_total_bytes": torch.cuda.mem_get_info()[1],
            }
            if stores:
                record.update(
                    step_added_bytes=probe.added,
                    step_device_bytes_bound=sum(s.step_device_bytes_bound for s in stores),
                    placement={h: sum(s.placement[h] for s in stores) for h in ("gpu", "host", "disk")},
                    home_bytes={h: sum(s.home_bytes[h] for s in stores) for h in ("gpu", "host", "disk")},
                    stored_bytes=sum(s.file_bytes_total for s in stores),
                    overlap_bytes_bound=sum(s.overlap_bytes_bound for s in stores),
                    carried_peak_bytes=sum(s.carried_peak_bytes for s in stores),
                    step_bytes_moved={
                        "read": sum(s.last_step.bytes_read for s in stores),
                        "written": sum(s.last_step.bytes_written for s in stores),
                    },
                    conversions={
                        "replayed": sum(s.last_step.conversions_replayed for s in stores),
                        "eager": sum(s.last_step.conversions_eager for s in stores),
                        "eager_slots": [f"{d} {b}" for s in stores for d, b in s.last_step.eager_slots],
                    },
                )
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
        last_end[:] = [time.perf_counter()]
        return result

    training.train_step = train_step


def main() -> int:
    from miles_plugins import launch

    out = os.environ["PRETRAIN_PROBE_OUT"]
    # Wrapped when the script imports it, as the launcher wraps its names: nothing
    # is imported ahead of the script here either.
    recorder = launch._AfterImport({"megatron.training.training": lambda m: _record_each_step(m, out)})
    sys.meta_path.insert(0, recorder)
    return launch.main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
