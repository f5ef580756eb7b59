"""The overlap window (``StreamConfig.overlap_bytes``): state held across the step
boundary so its transfers run between steps, judged against an independent
resident run (``reference.reference_run``), never against the store itself.

The "forward" here is the reference's loss computation, with ``progress()`` called
before it and between it and the backward, as the Megatron binding's forward
pre-hook calls it once per micro-batch.
"""

import time

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamConfigError
from miles_plugins.optimizers.errors import StoreUnusableError, StreamIOTimeout
from tests.faults import FaultPlan
from tests.helpers import STEPS, fresh, state_of
from tests.unit.reference import assert_same_training, between_steps, loss_fn, reference_run

SAVE_AT = 9


def _bucket_bytes(streamed) -> list[int]:
    return [b.materialized_bytes for b in streamed.store.buckets]


def _train(model, optimizer, scheduler, streamed, steps, held=None):
    """The reference's loop with ``progress()`` during the "forward"; ``held`` collects
    the state bytes on the device between steps."""
    for step in steps:
        streamed.progress()
        loss = loss_fn(model, step)
        streamed.progress()
        if held is not None:
            held.append(streamed.store._pipeline.accounting.current)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        between_steps(optimizer, scheduler, step)


def _progress_until(streamed, done, check=lambda: None, timeout_s: float = 30.0) -> None:
    """``progress()`` until ``done()``, running ``check()`` after each call; fails, not hangs."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "progress() never got there"
        streamed.progress()
        check()


def _window(streamed, buckets: int | None) -> int:
    """The bytes of the largest ``buckets`` buckets (all of them with None; "twice": the
    whole state twice over, so that room is never what holds a read back)."""
    sizes = sorted(_bucket_bytes(streamed), reverse=True)
    if buckets == "twice":
        return 2 * sum(sizes)
    return sum(sizes if buckets is None else sizes[:buckets])


MODES = [
    ("disk", "fp32", "fp32"),
    ("disk", "remainder", "8bit"),
    ("host", "fp32", "fp32"),
    ("host", "remainder", "bf16"),
]


@pytest.mark.parametrize("buckets", [2, None, "twice"], ids=["two-buckets", "whole-state", "twice-the-state"])
@pytest.mark.parametrize("tier, main_storage, moment_dtype", MODES, ids=["-".join(m) for m in MODES])
def test_the_window_changes_when_transfers_run_not_what_they_compute(
    tmp_path, tier, main_storage, moment_dtype, buckets
):
    """Byte-identical to the run without a window (fp32 moments: to the resident
    reference), moving the same bytes, with the state held between steps within
    its bound; a save with writes still landing, and a resume, change nothing."""
    config = dict(tier=tier, main_storage=main_storage, moment_dtype=moment_dtype)
    probe = fresh(tmp_path / "probe", "rank0", **config)[3]
    window = _window(probe, buckets)
    probe.close()

    plain = fresh(tmp_path / "plain", "rank0", **config)
    _train(*plain, range(STEPS))
    model, optimizer, scheduler, streamed = fresh(tmp_path / "window", "rank0", overlap_bytes=window, **config)
    store = streamed.store
    assert 0 < store.overlap_bytes_bound <= window
    held = []
    _train(model, optimizer, scheduler, streamed, range(SAVE_AT), held)
    assert store._pipeline.deferred_writes, "the last step's writes must still be pending after it"
    streamed.save_to(str(tmp_path / "ckpt"))  # lands them first
    torch.save({"model": model.state_dict(), "scheduler": scheduler.state_dict()}, tmp_path / "ckpt" / "rest.pt")
    _train(model, optimizer, scheduler, streamed, range(SAVE_AT, STEPS), held)

    assert_same_training(state_of(*plain[::3]), state_of(model, streamed))
    if moment_dtype == "fp32":
        assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    moved = (store.total.bytes_read, store.total.bytes_written)
    assert moved == (plain[3].store.total.bytes_read, plain[3].store.total.bytes_written)
    assert max(held) > 0, "the window must hold state between steps"
    assert max(held) <= store.overlap_bytes_bound and store.carried_peak_bytes <= store.overlap_bytes_bound
    plain[3].close()
    streamed.close()

    # A resume from the save taken while writes were landing, with the window on.
    model, optimizer, scheduler, streamed = fresh(tmp_path / "resumed", "rank0", overlap_bytes=window, **config)
    rest = torch.load(tmp_path / "ckpt" / "rest.pt")
    model.load_state_dict(rest["model"])
    scheduler.load_state_dict(rest["scheduler"])
    assert streamed.load_from(str(tmp_path / "ckpt"))
    _train(model, optimizer, scheduler, streamed, range(SAVE_AT, STEPS))
    plain = fresh(tmp_path / "plain2", "rank0", **config)
    _train(*plain, range(STEPS))
    assert_same_training(state_of(*plain[::3]), state_of(model, streamed))
    plain[3].close()
    streamed.close()


def test_a_bucket_is_read_only_after_its_write_landed_and_the_window_is_never_exceeded(tmp_path):
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", overlap_bytes=1 << 40)
    store, pipeline = streamed.store, streamed.store._pipeline
    _train(model, optimizer, scheduler, streamed, range(2))
    deferred = {f.bucket.index for f in pipeline.deferred_writes}
    assert deferred == {b.index for b in store.buckets}, "a window larger than the state defers every write"
    # The window is larger than the state: what bounds it is the state, each bucket once.
    assert store.overlap_bytes_bound == store.state_bytes_total

    def check():
        deferred_writes = {f.bucket.index for f in pipeline.deferred_writes}
        read = [f.bucket.index for f in pipeline._prefetched]
        assert read == list(range(len(read))), "reads go in walk order"
        assert not deferred_writes & set(read) and (not deferred_writes or max(read, default=-1) < min(deferred_writes))
        assert pipeline.accounting.current <= store.overlap_bytes_bound

    _progress_until(streamed, lambda: not pipeline.deferred_writes, check)
    streamed.progress()
    assert len(pipeline._prefetched) == len(store.buckets), "then the window reads the whole next step ahead"
    streamed.close()


def test_reading_the_state_back_survives_a_forward_between_its_buckets(tmp_path):
    """iter_state yields bucket by bucket; a forward's progress() in between reads ahead
    into the very tensors it materializes: it settles again before each bucket."""
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", overlap_bytes=1 << 40)
    _train(model, optimizer, scheduler, streamed, range(3))
    copies = []
    for item in streamed.iter_state():
        copies.append(item)
        streamed.progress()
        _progress_until(streamed, lambda: not streamed.store._pipeline.deferred_writes)
    by_param = {id(p): (main, m, v) for p, main, m, v in copies}
    read_back = ([p.detach().clone() for p in model.parameters()], [by_param[id(p)] for p in model.parameters()])
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, 3), read_back)
    # The next steps use what the last progress() read ahead (the bucket tensors the read-back shared).
    _train(model, optimizer, scheduler, streamed, range(3, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_reads_fill_only_the_room_the_landed_writes_left(tmp_path):
    probe = fresh(tmp_path / "probe", "rank0")[3]
    sizes = [b.materialized_bytes for b in probe.store.buckets]
    probe.close()
    window = sum(sizes[-3:])  # the last three buckets' writes fill it
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", overlap_bytes=window)
    store, pipeline = streamed.store, streamed.store._pipeline
    _train(model, optimizer, scheduler, streamed, range(2))
    assert [f.bucket.index for f in pipeline.deferred_writes] == list(range(len(sizes) - 3, len(sizes)))
    assert store.overlap_bytes_bound == window  # the three deferred, or as many first ones read

    def check():
        held = sum(f.bucket.materialized_bytes for f in (*pipeline.deferred_writes, *pipeline._prefetched))
        assert held <= window

    _progress_until(streamed, lambda: not pipeline.deferred_writes and pipeline._prefetched, check)
    streamed.close()


def test_the_next_step_reads_while_the_last_ones_writes_still_land(tmp_path):
    """The step waits for a deferred write just before reading its bucket, not for all
    of them first: on a drive, writes and reads then run together. Here the first
    deferred write stalls (1 s) and the step's first reads start meanwhile."""
    probe = fresh(tmp_path / "probe", "rank0")[3]
    window = sum(_bucket_bytes(probe)[-2:])  # the last two buckets' writes are deferred
    probe.close()
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", overlap_bytes=window)
    pipeline = streamed.store._pipeline
    _train(model, optimizer, scheduler, streamed, range(3))
    landing_at_read = []  # (bucket, the buckets still landing) as each read starts
    real_open = pipeline._open

    def open_bucket(index, *args, **kwargs):
        landing_at_read.append((index, {f.bucket.index for f in pipeline.deferred_writes}))
        return real_open(index, *args, **kwargs)

    pipeline._open = open_bucket
    loss_fn(model, 3).backward()  # no progress(): the step sends the deferred writes itself
    with FaultPlan(tmp_path / "scratch", "write", nth=1, fault="hang", hang_s=1.0) as plan:
        optimizer.step()
    assert plan.fired == 1
    last = len(streamed.store.buckets) - 1
    first_index, still_landing = landing_at_read[0]
    assert first_index == 0 and still_landing, "the step waited for every deferred write before its first read"
    assert all(index not in deferred_writes for index, deferred_writes in landing_at_read), (
        "a bucket was read before it landed"
    )
    assert {f.bucket.index for f in pipeline.deferred_writes} == {last - 1, last}
    optimizer.zero_grad()
    between_steps(optimizer, scheduler, 3)
    _train(model, optimizer, scheduler, streamed, range(4, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


@pytest.mark.parametrize("found_by", ["progress", "next-step"])
def test_a_deferred_write_that_fails_is_reported_and_the_store_refuses(tmp_path, found_by):
    """Found by a forward's progress() or by the next step's walk waiting for it (the
    write fails 0.5 s late, so the step's walk is already under way), the failure
    names the step that wrote it, and the step and the save refuse."""
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", overlap_bytes=1 << 40)
    _train(model, optimizer, scheduler, streamed, range(3))
    loss_fn(model, 3).backward()
    optimizer.step()  # returns with its writes deferred
    optimizer.zero_grad()
    fault = dict(fault="eio") if found_by == "progress" else dict(fault="late-eio", hang_s=0.5)
    with FaultPlan(tmp_path / "scratch", "write", nth=1, **fault) as plan:
        with pytest.raises(StoreUnusableError, match=r"writes of step 4, deferred .* failed .*Input/output error"):
            if found_by == "progress":
                _progress_until(streamed, lambda: False)
            else:
                loss_fn(model, 4).backward()
                optimizer.step()
    assert plan.fired == 1
    for refused in (optimizer.step, lambda: streamed.save_to(str(tmp_path / "ckpt"))):
        with pytest.raises(StoreUnusableError, match="step 4"):
            refused()
    streamed.progress()  # reported once: forward passes go on, the step and the save refuse
    streamed.close()


def _fail_after_the_walk_then_retry(tmp_path, **config):
    """A run whose step 4 fails after its walk (widening a resident fp32 param's grad,
    e.g. out of memory), is rolled back, and retried."""
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", fp32_param_moments="resident", **config)
    store = streamed.store
    for step in range(STEPS):
        streamed.progress()
        loss_fn(model, step).backward()
        if step == 3:
            real = store._steps.grad_fn

            def failing(entry, real=real):
                if entry is store.entries[store._resident_entries[0]]:
                    raise RuntimeError("out of memory (injected) widening a grad")
                return real(entry)

            store._steps.grad_fn = failing
            with pytest.raises(RuntimeError, match="injected"):
                optimizer.step()
            store._steps.grad_fn = real
            assert not store._pipeline.deferred_writes, "the failed step's deferred writes must not land"
        optimizer.step()
        optimizer.zero_grad()
        between_steps(optimizer, scheduler, step)
    state = state_of(model, streamed)
    streamed.close()
    return state


def _fail_reading_while_writes_land_then_retry(tmp_path, **config):
    """A disk run whose step 5 fails reading (EIO) while step 4's deferred writes are
    still landing (the first of them stalls), is rolled back, and retried."""
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", **config)
    _train(model, optimizer, scheduler, streamed, range(4))
    loss_fn(model, 4).backward()
    scratch = tmp_path / "scratch"
    with FaultPlan(scratch, "write", nth=1, fault="hang", hang_s=0.5), FaultPlan(scratch, "read", nth=2, fault="eio"):
        with pytest.raises(OSError, match="Input/output error"):
            optimizer.step()
    assert not streamed.store._pipeline.deferred_writes, "the last step's deferred writes must have landed"
    optimizer.step()
    optimizer.zero_grad()
    between_steps(optimizer, scheduler, 4)
    _train(model, optimizer, scheduler, streamed, range(5, STEPS))
    state = state_of(model, streamed)
    streamed.close()
    return state


def test_a_step_failing_while_a_deferred_write_fails_reports_the_write(tmp_path):
    """Step 5's read fails while one of step 4's deferred writes is failing too: the
    lost write is what is reported (the store refuses), not rolled back onto. Five
    buckets: the walk's first reads (three in flight) do not reach the deferred two."""
    probe = fresh(tmp_path / "probe", "rank0", bucket_cap_elements=800)[3]
    assert len(probe.store.buckets) == 5
    window = sum(_bucket_bytes(probe)[-2:])  # the last two buckets' writes are deferred
    probe.close()
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", bucket_cap_elements=800, overlap_bytes=window)
    _train(model, optimizer, scheduler, streamed, range(4))
    loss_fn(model, 4).backward()
    scratch = tmp_path / "scratch"
    with (
        FaultPlan(scratch, "write", nth=1, fault="late-eio", hang_s=0.5) as write,
        FaultPlan(scratch, "read", nth=1, fault="eio") as read,
    ):
        with pytest.raises(StoreUnusableError, match=r"writes of step 4, deferred .* failed .*Input/output error"):
            optimizer.step()
    assert write.fired == read.fired == 1
    with pytest.raises(StoreUnusableError, match="step 4"):
        optimizer.step()
    streamed.close()


@pytest.mark.parametrize("first", ["read", "deferred-write"])
def test_a_hung_drive_fails_the_step_within_one_timeout(tmp_path, first):
    """Reads and writes both stall: the step fails once ``io_timeout_s`` has passed,
    whether its own read or the last step's deferred write is found stalled first,
    and never waits a second timeout for the other (it once took twice as long), nor
    does close() afterwards."""
    timeout_s = 0.5
    probe = fresh(tmp_path / "probe", "rank0", bucket_cap_elements=800)[3]
    sizes = _bucket_bytes(probe)
    probe.close()
    # Two buckets deferred: the walk's first reads (three in flight) stall first. Three: the
    # walk reads buckets 0 and 1, then waits for bucket 2's deferred write before reading it.
    window = sum(sizes[-2:]) if first == "read" else sum(sizes[-3:])
    model, optimizer, scheduler, streamed = fresh(
        tmp_path, "rank0", bucket_cap_elements=800, overlap_bytes=window, io_timeout_s=timeout_s
    )
    _train(model, optimizer, scheduler, streamed, range(4))
    loss_fn(model, 4).backward()
    scratch = tmp_path / "scratch"
    expected = StreamIOTimeout if first == "read" else StoreUnusableError
    with (
        FaultPlan(scratch, "write", nth=1, fault="hang", hang_s=1.0, times=None),
        FaultPlan(scratch, "read", nth=1, fault="hang", hang_s=1.0, times=None),
    ):
        start = time.monotonic()
        with pytest.raises(expected, match="did not complete within"):
            optimizer.step()
        waited = time.monotonic() - start
        with pytest.raises(StoreUnusableError):
            optimizer.step()
        start = time.monotonic()
        streamed.close()  # nor does it wait again to delete the state
        closed = time.monotonic() - start
    # The stalled calls finish later, into memory the store never released (abandoned
    # as hung) and files close() deleted.
    assert waited <= 1.5 * timeout_s and closed <= 0.5 * timeout_s


def test_a_step_failing_while_the_last_ones_writes_land_lands_them_and_rolls_back(tmp_path):
    plain = _fail_reading_while_writes_land_then_retry(tmp_path / "plain")
    windowed = _fail_reading_while_writes_land_then_retry(tmp_path / "window", overlap_bytes=1 << 40)
    assert_same_training(plain, windowed)
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), windowed)


def test_a_step_failing_after_its_walk_drops_its_deferred_writes_and_rolls_back(tmp_path):
    plain = _fail_after_the_walk_then_retry(tmp_path / "plain")
    windowed = _fail_after_the_walk_then_retry(tmp_path / "window", overlap_bytes=1 << 40)
    assert_same_training(plain, windowed)


def test_only_the_windows_transfers_are_marked_beside_training(tmp_path, monkeypatch):
    """The engine is told which transfers run during forward and backward
    (``beside_training``: on pinned host memory those go through one window thread
    per direction, a step's own are queued whole on copy streams; the routing itself needs CUDA, the
    GPU tier checks it): the window's deferred writes as they land and its reads
    ahead, never a step's own transfers, a plain ``prefetch()`` just before a step,
    or a read outside a step."""
    from miles_plugins.optimizers.homes.engines import PipelinedEngine

    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", tier="host", bucket_cap_elements=800)
    _train(model, optimizer, scheduler, streamed, range(2))
    streamed.close()
    model, optimizer, scheduler, streamed = fresh(
        tmp_path / "window", "rank0", tier="host", bucket_cap_elements=800, overlap_bytes=_window(streamed, 2)
    )
    store = streamed.store
    seen: list[tuple[str, str, bool]] = []  # (phase, "read" / "write", beside_training)
    phase = {"now": "outside"}
    for kind in ("read", "write"):
        real = getattr(PipelinedEngine, kind)

        def recording(self, handle, transfers, ready=None, beside_training=False, kind=kind, real=real):
            seen.append((phase["now"], kind, beside_training))
            return real(self, handle, transfers, ready, beside_training)

        monkeypatch.setattr(PipelinedEngine, kind, recording)
    for step in range(3):
        phase["now"] = "progress"
        streamed.progress()
        loss_fn(model, step).backward()
        _progress_until(streamed, lambda: not store._pipeline.deferred_writes)  # every deferred write landed
        phase["now"] = "prefetch"
        store.prefetch()  # as the Megatron binding does once the grads are final
        phase["now"] = "step"
        optimizer.step()
        optimizer.zero_grad()
        between_steps(optimizer, scheduler, step)
    phase["now"] = "outside"
    list(streamed.iter_state())
    marked = {(p, kind) for p, kind, beside in seen if beside}
    plain = {(p, kind) for p, kind, beside in seen if not beside}
    assert ("progress", "write") in marked and ("progress", "read") in marked  # the window's
    assert marked <= {("progress", "write"), ("progress", "read"), ("step", "write"), ("outside", "write")}
    assert {("step", "read"), ("step", "write"), ("prefetch", "read"), ("outside", "read")} <= plain
    assert not {(p, kind) for p, kind in plain if p == "progress"}, "a window transfer not marked"
    streamed.close()


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(engine="sync"), "overlap bytes need the pipelined engine"),
        (dict(gpu_budget_bytes="auto"), 'cannot be used with an "auto" GPU budget'),
        (dict(overlap_bytes=-1), "overlap bytes must be a whole number of bytes"),
    ],
    ids=["sync-engine", "auto-gpu-budget", "negative"],
)
def test_a_window_the_store_cannot_keep_is_refused(tmp_path, config, message):
    config = {"overlap_bytes": 1 << 20, **config}
    with pytest.raises(StreamConfigError, match=message):
        StreamConfig(directory=str(tmp_path), **config)


def test_an_interrupt_after_a_deferred_write_is_submitted_does_not_submit_it_twice(tmp_path, monkeypatch):
    """A Ctrl-C between ``advance_deferred_writes()`` recording a deferred write's ticket and clearing what it
    held (raised there, standing in for a signal's arrival): the next ``advance_deferred_writes()`` must not
    submit those bytes again, which would replace the ticket of a write still running,
    so that the bucket's memory could be released (and reused) under it. Each bucket is
    written once, and training stays byte-identical to the run without a window."""
    from miles_plugins.optimizers.homes.engines import PipelinedEngine
    from miles_plugins.optimizers.step.flight import BucketInFlight

    plain = fresh(tmp_path / "plain", "rank0")
    _train(*plain, range(STEPS))
    model, optimizer, scheduler, streamed = fresh(tmp_path / "window", "rank0", overlap_bytes=1 << 40)
    _train(model, optimizer, scheduler, streamed, range(2))
    pipeline = streamed.store._pipeline
    assert pipeline.deferred_writes and all(f.held is not None for f in pipeline.deferred_writes)

    written: list[int] = []
    write = PipelinedEngine.write

    def counting(self, handle, transfers, ready=None, beside_training=False):
        if beside_training:
            written.append(id(handle))  # one handle per bucket in flight
        return write(self, handle, transfers, ready, beside_training)

    interrupted: list[BucketInFlight] = []
    setattr_ = BucketInFlight.__setattr__

    def interrupt_once(self, name, value):
        if name == "held" and value is None and self.writes is not None and not interrupted:
            interrupted.append(self)
            raise KeyboardInterrupt
        setattr_(self, name, value)

    monkeypatch.setattr(PipelinedEngine, "write", counting)
    monkeypatch.setattr(BucketInFlight, "__setattr__", interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        streamed.progress()
    assert interrupted, "the interrupt must come between the ticket and the clearing"
    _progress_until(streamed, lambda: not pipeline.deferred_writes)
    monkeypatch.undo()
    assert len(written) == len(set(written)) == len(streamed.store.buckets), written
    _train(model, optimizer, scheduler, streamed, range(2, STEPS))
    assert_same_training(state_of(*plain[::3]), state_of(model, streamed))
    plain[3].close()
    streamed.close()
