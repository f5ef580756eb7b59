"""Host memory is bounded by the staging chunks and the buckets in flight, not by the state size."""

import logging

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
from tests.helpers import STEPS, fresh, state_of, train
from tests.unit.reference import assert_same_training, reference_run

CAP = 1 << 20  # elements per bucket: 12 MiB materialized
LAYERS = 32  # 1M elements each: 32 buckets, 384 MiB of state


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


@pytest.mark.parametrize("engine", ["pipelined", "sync"])
def test_host_memory_does_not_grow_with_state_size(tmp_path, engine):
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(LAYERS))).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())
    config = StreamConfig(directory=str(tmp_path), bucket_cap_elements=CAP, staging_budget_mb=32, engine=engine)
    with StreamedOptimizer(optimizer, config) as streamed:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()  # first step: allocator warm-up, moments created
        baseline = _status("VmRSS")
        _reset_peak_rss()
        optimizer.step()
        optimizer.step()
        growth = _status("VmHWM") - baseline
        state = streamed.store.state_bytes_total
    # On the CPU the "device" buckets are host memory too: the buckets in flight,
    # the computing bucket's fp32 grads and Adam temporaries (about two buckets'
    # worth), the staging chunks, allocator slack. None of it scales with the state.
    bound = (config.max_in_flight + 2) * CAP * 12 + config.staging_bytes_total + 8 * 2**20
    assert state >= 3 * bound
    assert growth <= bound, f"peak RSS grew {growth} bytes for a {state}-byte state (bound {bound})"


@pytest.mark.parametrize(
    "budget_mb, threads, chunk_mb",
    [(16, 1, 8), (32, 2, 8), (64, 4, 8), (256, 4, 32), (8, 1, 4), (4, 1, 2)],
    ids=["16MiB-one-thread", "32MiB-two-threads", "64MiB", "256MiB-miles-default", "8MiB", "4MiB-smallest"],
)
def test_the_staging_budget_is_the_total_split_among_the_io_threads(tmp_path, caplog, budget_mb, threads, chunk_mb):
    """miles documents --offload-train-disk-chunk-mb as the pinned buffer that bounds
    host memory: the engine's staging chunks add up to it, never 2 x io_threads times it."""
    model = torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16)
    config = StreamConfig(directory=str(tmp_path), staging_budget_mb=budget_mb)
    with caplog.at_level(logging.INFO), StreamedOptimizer(torch.optim.AdamW(model.parameters()), config) as streamed:
        stagings = streamed.store._engine._stagings
        assert len(stagings) == 2 * threads
        assert {s.nbytes for s in stagings} == {chunk_mb << 20}
        assert sum(s.nbytes for s in stagings) == config.staging_bytes_total <= budget_mb << 20
    reduced = [r.getMessage() for r in caplog.records if "funds" in r.getMessage()]
    assert bool(reduced) == (threads < 4), reduced
    if reduced:  # what it says is what it allocated
        assert f"{budget_mb} MiB of staging (this store's) funds {threads} of the 4 I/O threads" in reduced[0]
        assert f"requests of {chunk_mb:g} MiB" in reduced[0]


@pytest.mark.parametrize("budget_mb", [16, 4], ids=["16MiB-one-8MiB-request", "4MiB-smallest"])
def test_one_transfer_thread_per_direction_trains_as_the_reference(tmp_path, budget_mb):
    """Small budgets fund one I/O thread per direction: every bucket's reads and writes
    queue on it, while three buckets are in flight, and training is unchanged."""

    model, optimizer, scheduler, streamed = fresh(
        tmp_path, "rank0", bucket_cap_elements=500, staging_budget_mb=budget_mb
    )
    assert streamed.store.config.transfer_threads == 1 and len(streamed.store.buckets) > 3
    train(model, optimizer, scheduler, range(STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()
