"""Failure scenarios: injected I/O faults, allocation failures, hangs, full disks.

Each test drives a real streamed training run (``test_checkpoint``'s helpers:
the torch front end over real files) into one failure, asserts what the
caller sees, then proves what was kept by finishing the run and comparing it
byte for byte with an independent uninterrupted resident run. The faults come
from ``tests/faults.py`` at the ``os.preadv`` / ``os.pwritev`` /
``os.posix_fallocate`` boundary. Each passing scenario adds a row to the report
``make faults`` prints.
"""

import errno
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamConfigError, StreamedOptimizer, StreamIOError
from miles_plugins.optimizers.checkpoint.manifest import MANIFEST_NAME
from miles_plugins.optimizers.errors import CheckpointMismatchError, StoreUnusableError, StreamIOTimeout
from miles_plugins.optimizers.homes.scratch import LOCK_MARKER
from miles_plugins.optimizers.homes.scratch_purge import purge
from miles_plugins.optimizers.step.rollback import StepRollback
from tests.faults import FaultPlan
from tests.helpers import (
    REPO,
    SAVE_AT,
    STEPS,
    all_three_homes,
    fresh,
    partial_dirs,
    resume,
    save_run,
    state_of,
    three_bf16_layers,
    train,
)
from tests.unit.reference import Net, assert_same_training, between_steps, groups, loss_fn, reference_run


def _contents(directory) -> dict:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


pytestmark = pytest.mark.fault

NONE_LOST = "none beyond the step in progress"
FAILED_STEP = SAVE_AT + 1  # the run saves after SAVE_AT steps, takes one more, then fails


def _reference():
    return reference_run(torch.optim.AdamW, torch.bfloat16, STEPS)


def _one_step_past_the_checkpoint(tmp_path, **config):
    """A run saved after SAVE_AT steps and one step further; grads for the next step ready."""
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = save_run(tmp_path, ckpt, **config)
    train(model, optimizer, scheduler, range(SAVE_AT, FAILED_STEP))
    loss_fn(model, FAILED_STEP).backward()
    return ckpt, model, optimizer, scheduler, streamed


def _retry_and_finish(model, optimizer, scheduler, streamed) -> None:
    """Run the failed step again, then the rest; the result must be the uninterrupted run's."""
    optimizer.step()
    optimizer.zero_grad()
    between_steps(optimizer, scheduler, FAILED_STEP)
    train(model, optimizer, scheduler, range(FAILED_STEP + 1, STEPS))
    assert_same_training(_reference(), state_of(model, streamed))


def _resume_from_checkpoint_matches(tmp_path, ckpt, **config) -> None:
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt, **config)
    try:
        assert streamed.load_from(str(ckpt))
        train(model, optimizer, scheduler, range(SAVE_AT, STEPS))
        assert_same_training(_reference(), state_of(model, streamed))
    finally:
        streamed.close()


def _rolled_back_buckets(caplog) -> int:
    found = re.search(r"the params of the (\d+) buckets it had updated are back at step", caplog.text)
    return int(found.group(1)) if found else 0


@pytest.mark.parametrize(
    "op, fault, message",
    [
        ("write", "eio", r"write of .*bucket_\d+\.slot\d\.bin failed at offset \d+: Input/output error"),
        ("write", "enospc", r"write of .*bucket_\d+\.slot\d\.bin failed at offset \d+: No space left on device"),
        ("write", "eof", r"short write of .*bucket_\d+\.slot\d\.bin at offset \d+: no progress"),
        ("read", "eio", r"read of .*bucket_\d+\.slot\d\.bin failed at offset \d+: Input/output error"),
        ("read", "eof", r"short read of .*bucket_\d+\.slot\d\.bin at offset \d+: end of file .*truncated"),
    ],
)
def test_an_io_error_mid_step_loses_only_that_step(tmp_path, caplog, fault_report, op, fault, message):
    ckpt, model, optimizer, scheduler, streamed = _one_step_past_the_checkpoint(tmp_path)
    before = state_of(model, streamed)
    # Part way through the step: after some buckets were updated and written.
    with FaultPlan(tmp_path / "scratch", op, nth=12, fault=fault) as plan, caplog.at_level(logging.WARNING):
        with pytest.raises(StreamIOError, match=message) as info:
            optimizer.step()
    assert plan.fired == 1 and info.value.path in plan.paths
    updated = _rolled_back_buckets(caplog)
    assert updated >= 1, "the fault must hit after some buckets were updated, or nothing is rolled back"
    # Mains, moments and the params of the updated buckets are as before the step.
    assert_same_training(before, state_of(model, streamed))
    assert streamed.store.steps_taken == FAILED_STEP
    _retry_and_finish(model, optimizer, scheduler, streamed)
    streamed.close()
    _resume_from_checkpoint_matches(tmp_path, ckpt)
    fault_report(
        f"{op} fails mid-step ({fault.upper()})",
        "error naming the bucket file; state and params back at the previous step",
        f"{type(info.value).__name__}: {info.value}; {updated} updated buckets rolled back; the retried run and "
        "a resume from the last checkpoint are byte-identical to an uninterrupted run",
        NONE_LOST,
    )


def test_an_interrupt_during_the_roll_back_leaves_the_store_refusing_to_step(tmp_path, monkeypatch):
    """A second Ctrl-C while a failed step is being undone: the buckets it updated may be
    half restored, so the store must refuse, and the last checkpoint still resumes. (The
    interrupt is raised where the undo starts, standing in for a signal's arrival there.)"""
    ckpt, model, optimizer, scheduler, streamed = _one_step_past_the_checkpoint(tmp_path)

    def interrupted(self, exc):
        raise KeyboardInterrupt

    monkeypatch.setattr(StepRollback, "undo", interrupted)
    with FaultPlan(tmp_path / "scratch", "write", nth=12, fault="eio"), pytest.raises(KeyboardInterrupt):
        optimizer.step()
    with pytest.raises(StoreUnusableError, match=f"step {FAILED_STEP + 1} failed and its roll-back was interrupted"):
        optimizer.step()
    streamed.close()
    _resume_from_checkpoint_matches(tmp_path, ckpt)


def test_an_interrupt_while_a_failed_step_waits_for_its_transfers_leaves_their_memory(tmp_path, monkeypatch):
    """A second Ctrl-C while a failed step waits for the transfers still in flight: they
    may still run, so their memory must stay allocated (the roll-back would otherwise
    read into blocks a late copy still writes), the interrupt reaches the caller and
    the store refuses; the last checkpoint still resumes. (The interrupt is raised in
    the first of those waits, standing in for a signal's arrival there; the abort once
    swallowed it and released the memory.)"""
    from miles_plugins.optimizers.homes.transfer_batch import TransferBatch

    ckpt, model, optimizer, scheduler, streamed = _one_step_past_the_checkpoint(tmp_path)
    wait = TransferBatch.wait
    interrupts = []

    def interrupted_abort_wait(self, timeout_s=None):
        if timeout_s is not None and not interrupts:  # the walk's own waits pass no timeout
            interrupts.append(self)
            raise KeyboardInterrupt
        return wait(self, timeout_s)

    monkeypatch.setattr(TransferBatch, "wait", interrupted_abort_wait)
    with FaultPlan(tmp_path / "scratch", "write", nth=12, fault="eio"), pytest.raises(KeyboardInterrupt):
        optimizer.step()
    assert len(interrupts) == 1
    assert streamed.store._pipeline.hung
    with pytest.raises(StoreUnusableError, match=r"an interrupt \(KeyboardInterrupt\) cut short the wait") as info:
        optimizer.step()
    assert "Input/output error" in str(info.value)  # the failure the interrupt came during
    monkeypatch.undo()
    streamed.close()
    _resume_from_checkpoint_matches(tmp_path, ckpt)


@pytest.mark.parametrize("op", ["read", "write"])
def test_short_transfers_are_completed_not_mistaken_for_data(tmp_path, fault_report, op):
    """The OS may move fewer bytes than asked; the store asks again for the rest."""
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0")
    with FaultPlan(tmp_path / "scratch", op, nth=3, fault="short", times=20) as plan:
        train(model, optimizer, scheduler, range(STEPS))
    assert plan.fired == 20 and plan.shortened >= 5
    assert_same_training(_reference(), state_of(model, streamed))
    streamed.close()
    fault_report(
        f"{op}s return short (20 times)",
        "the rest is transferred; no error, no wrong bytes",
        "training byte-identical to an uninterrupted run",
        "none",
    )


IO_TIMEOUT_S = 0.5


def test_a_hung_drive_fails_the_step_within_its_timeout_and_the_last_checkpoint_resumes(tmp_path, fault_report):
    """Every write from the 4th on stalls: several buckets' writes are in flight
    when the first wait times out. The abort must not wait on each of them again
    (it did: 1.01 s for a 0.5 s timeout, growing with the writes in flight)."""
    ckpt, model, optimizer, scheduler, streamed = _one_step_past_the_checkpoint(
        tmp_path, io_timeout_s=IO_TIMEOUT_S, bucket_cap_elements=500
    )
    with FaultPlan(tmp_path / "scratch", "write", nth=4, fault="hang", times=None, hang_s=3.0) as plan:
        start = time.monotonic()
        with pytest.raises(StreamIOTimeout, match=r"bucket_\d+\.slot\d\.bin did not complete within 0.5 s") as info:
            optimizer.step()
        waited = time.monotonic() - start
        stalled = plan.fired
        with pytest.raises(StoreUnusableError, match="transfers still hang"):
            optimizer.step()
        streamed.close()
        time.sleep(3.0)  # let the stalled writes finish before their files go
    assert stalled >= 2, "several writes must be stalled at once for the abort to matter"
    assert waited <= 1.2 * IO_TIMEOUT_S, f"the step failed after {waited:.2f} s, past 1.2 x io_timeout_s"
    _resume_from_checkpoint_matches(tmp_path, ckpt, bucket_cap_elements=500)
    fault_report(
        "writes hang (stalled drive), several in flight",
        "the step fails within 1.2 x io_timeout_s; the store refuses to go on",
        f"StreamIOTimeout after {waited:.2f} s (io_timeout_s {IO_TIMEOUT_S}, {stalled} writes stalled): "
        f"{info.value}; next step refused; the last checkpoint resumes byte-identical",
        "the steps since the last checkpoint (the drive holding the scratch stopped answering)",
    )


@pytest.mark.parametrize("placement", ["disk", "gpu-host-disk"])
def test_a_device_allocation_failure_mid_step_loses_only_that_step(
    tmp_path, monkeypatch, caplog, fault_report, placement
):
    from miles_plugins.optimizers.step.flight import StateAccounting

    # Small buckets: with 3 in flight, an allocation then fails after some buckets were updated.
    # With budgets, the last three buckets are in memory: the failure comes before any is updated,
    # so the disk buckets' update still rolls back.
    config = all_three_homes() if placement != "disk" else {"bucket_cap_elements": 500}
    ckpt, model, optimizer, scheduler, streamed = _one_step_past_the_checkpoint(tmp_path, **config)
    before = state_of(model, streamed)
    real = StateAccounting.materialize
    calls = {"n": 0}

    def failing_materialize(self, t):
        # Simulated: a real device out-of-memory cannot be provoked safely here.
        calls["n"] += 1
        if calls["n"] == 14:  # bucket 4 of 6: buckets 0 and 1 are updated by then
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, t)

    monkeypatch.setattr(StateAccounting, "materialize", failing_materialize)
    with pytest.raises(torch.OutOfMemoryError, match="out of memory") as info, caplog.at_level(logging.WARNING):
        optimizer.step()
    monkeypatch.setattr(StateAccounting, "materialize", real)
    updated = _rolled_back_buckets(caplog)
    assert updated >= 1, "the failure must come after some buckets were updated"
    assert_same_training(before, state_of(model, streamed))
    _retry_and_finish(model, optimizer, scheduler, streamed)
    streamed.close()
    fault_report(
        f"device allocation fails mid-step ({placement})",
        "the allocator's error; state and params back at the previous step",
        f"{type(info.value).__name__}: {info.value}; {updated} updated buckets rolled back; the retried run is "
        "byte-identical",
        NONE_LOST,
    )


def test_a_staging_allocation_failure_is_refused_with_nothing_written(tmp_path, monkeypatch, fault_report):
    import mmap

    from miles_plugins.optimizers.homes import host_memory as host_memory_module

    def no_memory(*args, **kwargs):
        # Simulated: exhausting the host's memory for real would take the machine down.
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(host_memory_module.mmap, "mmap", no_memory)
    model = Net(torch.bfloat16)
    with pytest.raises(StreamIOError, match="cannot allocate 16777216 bytes of host memory: Cannot allocate") as info:
        StreamedOptimizer(torch.optim.AdamW(groups(model)), StreamConfig(directory=str(tmp_path / "scratch")))
    monkeypatch.setattr(host_memory_module.mmap, "mmap", mmap.mmap)
    assert os.listdir(tmp_path / "scratch") == []
    fault_report(
        "staging allocation fails at startup",
        "clear error, nothing written",
        f"{info.value}; the scratch directory is empty",
        "none",
    )


def test_a_full_disk_at_startup_is_refused_before_or_while_reserving(tmp_path, fault_report):
    model = Net(torch.bfloat16)
    with FaultPlan(tmp_path / "scratch", "fallocate", nth=3, fault="enospc"):
        with pytest.raises(StreamIOError, match=r"cannot reserve \d+ bytes for .*: No space left on device") as info:
            StreamedOptimizer(
                torch.optim.AdamW(groups(model)),
                StreamConfig(directory=str(tmp_path / "scratch"), bucket_cap_elements=1500),
            )
    assert os.listdir(tmp_path / "scratch") == []
    huge = torch.nn.Parameter(torch.empty(1 << 50, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(StreamIOError, match=r"not enough free space .* needs .* free") as preflight:
        StreamedOptimizer(torch.optim.AdamW([huge]), StreamConfig(directory=str(tmp_path / "big")))
    # Measured once the lock is taken and any stale scratch purged: the state directory stays, empty.
    assert os.listdir(tmp_path / "big") == []
    fault_report(
        "full disk at startup",
        "the free-space preflight refuses before writing; a reservation that fails anyway removes everything",
        f"preflight: {str(preflight.value).split(':')[0]}; ENOSPC while reserving: {info.value}; scratch empty",
        "none (nothing had been written)",
    )


def test_a_full_disk_during_a_checkpoint_save_keeps_the_previous_save(tmp_path, fault_report):
    ckpt, model, optimizer, scheduler, streamed = _one_step_past_the_checkpoint(tmp_path)
    optimizer.step()
    optimizer.zero_grad()
    before = {p.name: p.read_bytes() for p in (ckpt / "rank0").iterdir()}
    with FaultPlan(ckpt, "write", nth=4, fault="enospc"):
        with pytest.raises(StreamIOError, match="No space left on device") as info:
            streamed.save_to(str(ckpt))
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"], "no partial save may be left behind"
    assert {p.name: p.read_bytes() for p in (ckpt / "rank0").iterdir()} == before
    streamed.close()
    _resume_from_checkpoint_matches(tmp_path, ckpt)
    fault_report(
        "full disk while saving a checkpoint",
        "the save fails; the previous save stays complete",
        f"{info.value}; previous save byte-for-byte unchanged and resumes byte-identical",
        "none (the run itself is unaffected)",
    )


def test_the_save_preflight_refuses_when_the_checkpoint_disk_is_full(tmp_path, monkeypatch, fault_report):
    import shutil

    from miles_plugins.optimizers.homes import fs as fs_module

    ckpt, model, optimizer, scheduler, streamed = _one_step_past_the_checkpoint(tmp_path)
    before = {p.name: p.read_bytes() for p in (ckpt / "rank0").iterdir()}
    usage = shutil.disk_usage(ckpt)
    # Simulated: filling a real disk to the last few KB is not something a test should do.
    monkeypatch.setattr(fs_module.shutil, "disk_usage", lambda path: usage._replace(free=4096))
    with pytest.raises(
        StreamIOError, match=r"not enough free space for a save of the optimizer state .* nothing was written"
    ) as info:
        streamed.save_to(str(ckpt))
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"]
    assert {p.name: p.read_bytes() for p in (ckpt / "rank0").iterdir()} == before
    streamed.close()
    fault_report(
        "checkpoint disk too full for a save",
        "the save's preflight refuses before writing",
        str(info.value),
        "none",
    )


def test_a_manifest_from_another_save_is_refused(tmp_path, fault_report):
    ckpt, model, optimizer, scheduler, streamed = _one_step_past_the_checkpoint(tmp_path)
    optimizer.step()
    streamed.save_to(str(tmp_path / "later"))
    streamed.close()
    # The later save's manifest beside the earlier save's bucket files.
    (ckpt / "rank0" / MANIFEST_NAME).write_bytes((tmp_path / "later" / "rank0" / MANIFEST_NAME).read_bytes())
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt)
    with pytest.raises(
        CheckpointMismatchError, match=r"CRC-32 .* does not match the manifest's .* the checkpoint is corrupt"
    ) as info:
        streamed.load_from(str(ckpt))
    streamed.close()
    fault_report(
        "manifest from another save",
        "load refuses, saying what is wrong",
        str(info.value).splitlines()[0],
        "none (the load refuses; the files are untouched)",
    )


def test_a_save_or_load_aimed_at_a_live_scratch_is_refused_and_the_run_goes_on(tmp_path, fault_report):
    """``save_to(d)`` writes ``d/<name>``: where that is, holds or lies in the scratch of
    a live store of this process, the save would swap the live state out, and
    closing that store would then delete the save. Refused, before anything is written."""
    ckpt, model, optimizer, scheduler, streamed = _one_step_past_the_checkpoint(tmp_path)
    scratch = tmp_path / "scratch" / "rank0"  # the live scratch: StreamConfig.directory / name
    # Another live store of the process, whose scratch nest/rank0/rank0 a save to nest/ would hold.
    other = fresh(tmp_path, "rank0", directory=str(tmp_path / "nest" / "rank0"))[3]
    (tmp_path / "link").symlink_to(tmp_path / "scratch")
    targets = {
        tmp_path / "scratch": "is the scratch directory",
        tmp_path / "link": "is the scratch directory",  # real paths are compared
        scratch: "lies inside the scratch directory",
        tmp_path / "nest": "holds the scratch directory",
    }
    live = _contents(scratch), _contents(tmp_path / "nest" / "rank0" / "rank0")
    refusals = []
    for target, relation in targets.items():
        for call in (streamed.save_to, streamed.load_from):
            with pytest.raises(StreamConfigError, match=f"{relation} .* of a live optimizer-state store") as info:
                call(str(target))
            refusals.append(str(info.value))
    assert (_contents(scratch), _contents(tmp_path / "nest" / "rank0" / "rank0")) == live
    assert not partial_dirs(tmp_path / "scratch") and not (scratch / "rank0").exists()
    other.close()
    _retry_and_finish(model, optimizer, scheduler, streamed)
    streamed.close()
    fault_report(
        "save_to / load_from aimed at a live scratch (the store's own directory, or any live store's)",
        "refused before writing, naming the scratch; the run goes on",
        refusals[0],
        "none (the live state is untouched; the run finishes byte-identical)",
    )


def test_a_save_found_where_the_scratch_belongs_survives_the_restart_purge(tmp_path, fault_report):
    """What a killed run left when a save could still land on its scratch: the
    checkpoint sits at ``<directory>/<name>``, beside a stale lock. Neither the
    restart's purge nor the purge command deletes it; the restart says where it
    is, and once moved out it loads."""
    ckpt = tmp_path / "ckpt"
    streamed = save_run(tmp_path, ckpt)[3]
    streamed.close()
    found = tmp_path / "scratch" / "rank0"
    os.rename(ckpt / "rank0", found)
    (tmp_path / "scratch" / ".rank0.lock").write_bytes(LOCK_MARKER)  # no process holds it: stale
    saved = _contents(found)
    removed, skipped = purge(str(tmp_path / "scratch"))  # a job epilog's
    assert removed == [] and [f"{found}: holds a save" in line for line in skipped] == [True]
    assert _contents(found) == saved
    with pytest.raises(StreamConfigError, match=f"{found} holds a save .*{MANIFEST_NAME}.* left as it is") as info:
        fresh(tmp_path, "rank0")
    assert _contents(found) == saved
    os.rename(found, ckpt / "rank0")
    _resume_from_checkpoint_matches(tmp_path, ckpt)
    fault_report(
        "a checkpoint found where the scratch belongs (saved there by an older version)",
        "the restart's purge and the purge command leave it, saying so; moved out, it loads",
        str(info.value),
        "none",
    )


def test_a_restart_after_a_kill_has_the_room_its_own_stale_scratch_held(tmp_path, small_drives, fault_report):
    """Drives that hold one run's scratch but not two: the restart purges what the
    killed run of its rank left before it measures free space, both where each
    scratch checks its room and where the buckets are dealt over the directories.
    Three equal buckets over a drive with room for two and one with room for one
    and a half: measured before the purge, the small drive looked the roomier and
    the dealing put two buckets on it."""
    cap = 256 * 256  # one layer a bucket
    size = (
        StreamedOptimizer(
            torch.optim.AdamW(three_bf16_layers().parameters()), StreamConfig(tier="host", bucket_cap_elements=cap)
        )
        .store.buckets[0]
        .file_size
    )
    slack = 256 << 10  # lock files, and the page rounding of a tmpfs
    large, small = small_drives("large", 4 * size + slack), small_drives("small", 3 * size + slack)
    directory = f"{large / 'optimizer_state'},{small / 'optimizer_state'}"
    killed = textwrap.dedent(f"""
        import os, torch
        from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
        from tests.helpers import three_bf16_layers
        model = three_bf16_layers()
        optimizer = torch.optim.AdamW(model.parameters())
        StreamedOptimizer(optimizer, StreamConfig(directory={directory!r}, bucket_cap_elements={cap}))
        model(torch.ones(2, 256, dtype=torch.bfloat16)).float().sum().backward()
        optimizer.step()
        os._exit(0)  # as SIGKILL would: no close, no exit cleanup
    """)
    subprocess.run([sys.executable, "-c", killed], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, check=True)
    stale = {d: sorted(os.listdir(d / "optimizer_state" / "rank0")) for d in (large, small)}
    assert [len(files) for files in stale.values()] == [4, 2], "the killed run left both slots of all three buckets"
    free = [shutil.disk_usage(d).free for d in (large, small)]
    assert max(free) < 2 * size, "with the stale scratch there, no drive has room for a bucket's two slots"

    model = three_bf16_layers()
    optimizer = torch.optim.AdamW(model.parameters())
    streamed = StreamedOptimizer(optimizer, StreamConfig(directory=directory, bucket_cap_elements=cap))
    assert streamed.store.placed.directory_of == [0, 1, 0]
    model(torch.ones(2, 256, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    streamed.close()
    fault_report(
        "restart after a kill, on drives that hold one scratch but not two",
        "the restart purges its rank's stale scratch, then measures free space; it starts",
        f"stale scratch {sum(map(len, stale.values()))} files, free before the purge "
        f"{max(free)} < {2 * size} bytes a bucket needs; restarted with the buckets dealt as before",
        "the steps since the last checkpoint (the stale scratch is not a checkpoint)",
    )


@pytest.mark.parametrize(
    "config, mode, why",
    [
        ({"tier": "host"}, "host tier", "buckets at home in host or device memory are written in place"),
        (
            {"gpu_budget_bytes": 1 << 20},
            "device home (GPU budget)",
            "buckets at home in host or device memory are written in place",
        ),
        ({"main_storage": "remainder"}, "remainder mains", "remainder mains need the params the step overwrote"),
    ],
    ids=["host-tier", "gpu-home", "remainder-mains"],
)
def test_where_no_roll_back_is_possible_the_store_refuses_to_go_on(
    tmp_path, monkeypatch, fault_report, config, mode, why
):
    from miles_plugins.optimizers.step import pipeline as pipeline_module

    config = {**config, "bucket_cap_elements": 500}  # small buckets: the failure comes after some updates
    ckpt, model, optimizer, scheduler, streamed = _one_step_past_the_checkpoint(tmp_path, **config)
    real = pipeline_module.Pipeline.fetch
    calls = {"n": 0}

    def failing_fetch(self, index, *args, **kwargs):
        # Simulated device out-of-memory, after some buckets were updated (the gpu home's
        # fp32 buckets allocate nothing: theirs share the home's bytes).
        calls["n"] += 1
        if calls["n"] == 5:  # the fifth bucket: buckets 0 and 1 are updated by then
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(self, index, *args, **kwargs)

    monkeypatch.setattr(pipeline_module.Pipeline, "fetch", failing_fetch)
    with pytest.raises(torch.OutOfMemoryError):
        optimizer.step()
    assert calls["n"] == 5
    monkeypatch.setattr(pipeline_module.Pipeline, "fetch", real)
    with pytest.raises(StoreUnusableError, match=f"holds no consistent state: .*{why}"):
        optimizer.step()
    streamed.close()
    _resume_from_checkpoint_matches(tmp_path, ckpt, **config)
    fault_report(
        f"a step fails part way ({mode})",
        "no roll-back possible: the store refuses to go on, saying why; the last checkpoint resumes",
        f"the next step refused: ...after updating some buckets, and {why}; the last checkpoint resumes byte-identical",
        "the steps since the last checkpoint (documented trade-off of this mode)",
    )


def test_a_read_that_hangs_outside_a_step_stops_the_store(tmp_path, fault_report):
    """A prefetched read that hangs is abandoned when a save drops it: its memory
    may still be written, so the store must refuse to step (it used to go on and
    free that memory under the late read: a crash)."""
    ckpt, model, optimizer, scheduler, streamed = _one_step_past_the_checkpoint(tmp_path, io_timeout_s=IO_TIMEOUT_S)
    with FaultPlan(tmp_path / "scratch", "read", nth=1, fault="hang", hang_s=2.0):
        streamed.store.prefetch()
        start = time.monotonic()
        with pytest.raises(StoreUnusableError, match="transfers hang") as info:
            streamed.save_to(str(tmp_path / "later"))
        waited = time.monotonic() - start
        with pytest.raises(StoreUnusableError, match="transfers hang"):
            optimizer.step()
        time.sleep(2.0)  # let the stalled read land before the process frees anything
    streamed.close()
    assert waited <= 1.2 * IO_TIMEOUT_S
    assert not (tmp_path / "later" / "rank0").exists()
    _resume_from_checkpoint_matches(tmp_path, ckpt)
    fault_report(
        "a prefetched read hangs, then a save",
        "the save and every later step are refused; the last checkpoint resumes",
        f"refused after {waited:.2f} s: {info.value}",
        "the steps since the last checkpoint",
    )


@pytest.mark.parametrize("fp32_param_moments", ["streamed", "resident"])
def test_a_failure_inside_the_fp32_native_update_leaves_the_store_refusing(tmp_path, monkeypatch, fp32_param_moments):
    """fp32-native params are updated in place, last: a failure there cannot be
    rolled back, and the store must not claim it was."""
    from miles_plugins.optimizers.step.bucket_optimizer import BucketOptimizer

    config = {"fp32_param_moments": fp32_param_moments}
    ckpt, model, optimizer, scheduler, streamed = _one_step_past_the_checkpoint(tmp_path, **config)
    store = streamed.store
    if fp32_param_moments == "resident":
        fp32_update = store._resident_optimizer
    else:  # the bucket of the fp32 param's moments, last in the walk
        assert not store.buckets[-1].streams_main and all(b.streams_main for b in store.buckets[:-1])
        fp32_update = store._bucket_optimizers[-1]
    assert fp32_update is not None, "the reference model has an fp32 param"

    def failing_step(self):
        if self is fp32_update:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated inside the fp32-native update)")
        return real_step(self)

    real_step = BucketOptimizer.step
    monkeypatch.setattr(BucketOptimizer, "step", failing_step)
    with pytest.raises(torch.OutOfMemoryError):
        optimizer.step()
    monkeypatch.undo()
    with pytest.raises(StoreUnusableError, match="fp32-native params(, which)? are updated in place"):
        optimizer.step()
    streamed.close()


def test_a_transfer_hung_for_good_does_not_keep_the_process_alive(tmp_path, fault_report):
    """A drive that never answers: the step fails at its timeout, and the process
    can still exit (and remove its scratch on the way). Worker threads are
    daemons; the standard thread pool would join the stuck one at exit, forever."""
    code = textwrap.dedent(f"""
        import sys
        from tests.faults import FaultPlan
        from tests.helpers import fresh, train
        work = {str(tmp_path)!r}
        model, optimizer, scheduler, streamed = fresh(__import__("pathlib").Path(work), "rank0", io_timeout_s=0.5)
        train(model, optimizer, scheduler, range(1))
        plan = FaultPlan(work + "/scratch", "write", nth=1, fault="hang", hang_s=10**6)
        plan.__enter__()  # never left: the write stays stuck
        try:
            train(model, optimizer, scheduler, range(1, 2))
        except Exception as exc:
            print("step failed:", type(exc).__name__, flush=True)
        sys.exit(0)  # no close(): the exit cleanup must still run
    """)
    start = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=60,
    )
    seconds = time.monotonic() - start
    assert child.returncode == 0, child.stderr[-3000:]
    assert "step failed: StreamIOTimeout" in child.stdout
    assert os.listdir(tmp_path / "scratch") == [], "the exit cleanup removed the scratch"
    fault_report(
        "a write hangs for good, then the process exits",
        "the step fails at io_timeout_s; the process exits and removes its scratch",
        f"StreamIOTimeout; exited 0 after {seconds:.1f} s in all; scratch removed",
        "the steps since the last checkpoint",
    )


def test_an_io_thread_that_cannot_start_fails_its_requests_at_once():
    """A thread whose setup fails (on CUDA: its stream) fails every request it takes with
    that error, instead of leaving them to time out as a hung drive would."""
    from miles_plugins.optimizers.homes.engines import _DaemonPool

    def setup():
        raise RuntimeError("CUDA error: out of memory")

    pool = _DaemonPool(1, "stream-read0", setup)
    try:
        error = pool.submit(lambda: "read").exception(timeout=5)
    finally:
        pool.shutdown(wait=True)
    assert isinstance(error, RuntimeError), error
    assert "stream-read0-0 could not start" in str(error) and "out of memory" in str(error)
