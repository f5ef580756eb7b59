"""A release cut short never costs stored state.

``Pipeline.abort`` releases its flights one by one (``drop_prefetch``, as
Megatron's ``zero_grad`` or any settle calls it, and every failure path). An
interrupt inside one release, or a file's close failing, used to skip the later
flights: their mains and moments kept viewing the gpu home's buffer, the store
went on as usable, and the next fetch's abort freed the home's storage through
such a view. Now every flight is handled, the first error raised after, the
store refuses to go on (one line), and a release frees only storage it counted.
The device home is CPU memory here, which lends its bytes as a GPU's does.
"""

import errno
import os

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
from miles_plugins.optimizers.errors import StoreUnusableError
from miles_plugins.optimizers.step import pipeline
from miles_plugins.optimizers.step.flight import StateAccounting
from tests.unit.reference import Net, between_steps, groups, loss_fn, schedule


def _trained(tmp_path, **config):
    """Three steps of the reference model, then the grads of a fourth and its prefetch."""
    model = Net(torch.bfloat16)
    optimizer = torch.optim.AdamW(groups(model))
    config.setdefault("bucket_cap_elements", 500)
    streamed = StreamedOptimizer(optimizer, StreamConfig(directory=str(tmp_path), **config))
    scheduler = schedule(optimizer)
    for step in range(3):
        loss_fn(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
        between_steps(optimizer, scheduler, step)
    loss_fn(model, 3).backward()
    streamed.store.prefetch()
    assert len(streamed.store._pipeline._prefetched) >= 2
    return optimizer, streamed


def _fail_first_release(monkeypatch, error: BaseException) -> list[int]:
    real, failed = pipeline.Pipeline._release, []

    def release(self, flight):
        if not failed:
            failed.append(flight.bucket.index)
            raise error
        return real(self, flight)

    monkeypatch.setattr(pipeline.Pipeline, "_release", release)
    return failed


@pytest.mark.fault
def test_an_interrupt_inside_a_release_leaves_the_gpu_home_whole_and_the_store_refusing(
    tmp_path, monkeypatch, fault_report
):
    optimizer, streamed = _trained(tmp_path, tier="host", gpu_budget_bytes=1 << 30)
    store = streamed.store
    home = store._backing.by_key["gpu"]
    stored = {i: buffer.clone() for i, buffer in home.buffers.items()}
    failed = _fail_first_release(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        store.drop_prefetch()
    monkeypatch.undo()
    viewing = [
        i
        for b in store.buckets
        if b.index not in failed and b.streams_main
        for i in b.entry_indices
        if store.entries[i].main.untyped_storage().nbytes()
    ]
    assert not viewing, f"the mains of entries {viewing} were left viewing the gpu home"
    for attempt in (optimizer.step, lambda: streamed.save_to(str(tmp_path / "ckpt"))):
        with pytest.raises(StoreUnusableError, match="releasing a bucket's device memory was cut short") as refused:
            attempt()
        assert "\n" not in str(refused.value)
    assert all(torch.equal(home.buffers[i], before) for i, before in stored.items()), "a home buffer changed"
    streamed.close()
    fault_report(
        "interrupt inside one bucket's release (drop_prefetch)",
        "the other flights released; the gpu home's bytes kept; the store refuses to go on",
        f"bucket {failed[0]} cut short, the rest released; step and save refused in one line; home unchanged",
        "the process's live state (load the last checkpoint)",
    )


def test_a_file_close_that_fails_during_an_abort_still_releases_every_other_flight(tmp_path, monkeypatch):
    optimizer, streamed = _trained(tmp_path, tier="disk")
    store = streamed.store
    flights = list(store._pipeline._prefetched)
    real_close, closed = os.close, []

    def close(fd):
        closed.append(fd)
        real_close(fd)
        if len(closed) == 1:
            raise OSError(errno.EIO, "Input/output error")  # as close(2) reports a failed writeback

    monkeypatch.setattr(os, "close", close)
    with pytest.raises(OSError, match="Input/output error"):
        store.drop_prefetch()
    monkeypatch.undo()
    assert all(f.handle is None for f in flights), "a flight's files were left open"
    assert store._pipeline.accounting.current == 0, "a flight's device memory was left allocated"
    with pytest.raises(StoreUnusableError, match="releasing a bucket's device memory was cut short"):
        optimizer.step()
    streamed.close()


def test_a_release_frees_only_the_storage_it_counted():
    accounting = StateAccounting()
    home = torch.arange(16, dtype=torch.float32)
    own = torch.empty(8)
    own.untyped_storage().resize_(0)
    accounting.materialize(own)
    assert accounting.current == 32
    viewing = torch.empty(8)
    viewing.data = home[:8]  # a tensor sharing a home's bytes whose flight was never released
    accounting.release(viewing)
    assert home.untyped_storage().nbytes() == 64 and torch.equal(home, torch.arange(16, dtype=torch.float32))
    own.data = home[8:]  # counted, but now viewing another's bytes: the count goes, the bytes stay
    accounting.release(own)
    assert accounting.current == 0 and home.untyped_storage().nbytes() == 64
    counted = torch.empty(4)
    accounting.adopt(counted)
    accounting.release(counted)
    assert counted.untyped_storage().nbytes() == 0
