"""Placement: each bucket's home (gpu, host, disk) by budget, mixed in one store.

Judged against the independent resident reference (``reference.reference_run``);
on this CPU-only machine the ``gpu`` home is the compute device's memory, the CPU's.
"""

import errno
import os
import re
from collections import deque

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
from miles_plugins.optimizers.errors import StoreUnusableError, StreamConfigError, StreamIOError
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes import auto_budget, backings, memory_probes
from miles_plugins.optimizers.homes.device_backing import DeviceBacking
from miles_plugins.optimizers.homes.file_io import BlockCrc
from miles_plugins.optimizers.homes.fs import parse_size
from miles_plugins.optimizers.homes.host_memory import HostMemory
from miles_plugins.optimizers.homes.placement import assign_homes, plan_disk, spread_over_directories
from tests.faults import FaultPlan
from tests.helpers import (
    CAP,
    SAVE_AT,
    STEPS,
    all_three_homes,
    bucket_sizes,
    fresh,
    resume,
    save_run,
    state_of,
    streamed_run,
    train,
)
from tests.unit.reference import (
    Net,
    assert_same_training,
    between_steps,
    groups,
    loss_fn,
    reference_run,
    schedule,
)


def _bucket(index: int, size: int) -> BucketLayout:
    return BucketLayout(index=index, entry_indices=(), numels=(), segments={}, file_name="", file_size=size)


@pytest.mark.parametrize(
    "sizes, gpu, host, tier, homes, left",
    [
        ([10, 10, 10, 10], 0, 0, "disk", ["disk"] * 4, (0, 0)),
        ([10, 10, 10, 10], 10, 25, "disk", ["disk", "host", "host", "gpu"], (0, 5)),
        # A home fills up to the first bucket that does not fit, even where a smaller one before it
        # would: each home is one run of buckets, the disk ones before every in-memory one.
        ([5, 30, 10], 15, 0, "host", ["host", "host", "gpu"], (5, 0)),
        ([10, 30, 10], 15, 40, "disk", ["host", "host", "gpu"], (5, 0)),
        ([10, 30, 10], 15, 35, "disk", ["disk", "host", "gpu"], (5, 5)),
        ([10, 10], 100, 100, "disk", ["gpu", "gpu"], (80, 100)),
        # The tier's buckets take nothing from the host budget.
        ([10, 10, 10], 0, 15, "host", ["host", "host", "host"], (0, 5)),
    ],
)
def test_budgets_fill_gpu_then_host_from_the_last_bucket_backwards(sizes, gpu, host, tier, homes, left):
    buckets = [_bucket(i, s) for i, s in enumerate(sizes)]
    config = StreamConfig(directory="/unused", tier=tier, gpu_budget_bytes=gpu, host_budget_bytes=host)
    assert assign_homes(buckets, config) == (homes, {"gpu": left[0], "host": left[1]})


MODES = [("pipelined", "fp32"), ("pipelined", "remainder"), ("sync", "fp32"), ("sync", "remainder")]


@pytest.mark.parametrize("engine, main_storage", MODES, ids=["-".join(m) for m in MODES])
def test_a_mixed_placement_is_byte_identical_to_resident(tmp_path, engine, main_storage):
    budgets = all_three_homes(main_storage=main_storage)
    ref = reference_run(torch.optim.AdamW, torch.bfloat16, STEPS)
    params, state, streamed = streamed_run(
        torch.optim.AdamW, torch.bfloat16, STEPS, tmp_path, engine=engine, main_storage=main_storage, **budgets
    )
    store = streamed.store
    assert store.placement == {"gpu": 1, "host": 2, "disk": len(store.buckets) - 3}
    assert store.home_bytes["gpu"] == store.buckets[-1].file_size
    assert_same_training(ref, (params, state))
    # Only the disk buckets have files, two slots each.
    disk = [b for b in store.buckets if store.placed.homes[b.index] == "disk"]
    slots = {os.path.basename(store._backing.file_backing(b).path(b, slot)) for b in disk for slot in (0, 1)}
    assert len(store.placed.scratches) == 1 and set(os.listdir(store.placed.scratches[0].path)) == slots
    streamed.close()


def test_with_every_bucket_in_memory_the_scratch_is_still_locked_and_purged(tmp_path):
    """The disk tier's directory keeps its scratch (empty): its lock keeps another
    process of the name out, and what a killed run left there is purged."""
    stale = tmp_path / "rank0"
    stale.mkdir()
    (stale / "bucket_00000.slot0.bin").write_bytes(b"left by a killed run")
    sizes = bucket_sizes()
    params, state, streamed = streamed_run(
        torch.optim.AdamW,
        torch.bfloat16,
        3,
        tmp_path,
        bucket_cap_elements=CAP,
        gpu_budget_bytes=sum(sizes[:2]),
        host_budget_bytes=sum(sizes),
    )
    assert streamed.store.placement["disk"] == 0 and len(streamed.store.placed.scratches) == 1
    assert os.listdir(streamed.store.placed.scratches[0].path) == []
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, 3), (params, state))
    streamed.close()
    assert os.listdir(tmp_path) == []


def _placement(name: str, tmp_path) -> dict:
    """Settings of a named placement of the test model's buckets."""
    if name == "mixed":
        return all_three_homes()
    if name == "two-dirs":
        return {"bucket_cap_elements": CAP, "directory": f"{tmp_path / 'nvme0'},{tmp_path / 'nvme1'}"}
    return {"bucket_cap_elements": CAP, "tier": name}


PLACEMENTS = [("mixed", "disk"), ("mixed", "host"), ("disk", "mixed"), ("host", "mixed"), ("two-dirs", "disk")]


@pytest.mark.parametrize("saving, loading", PLACEMENTS, ids=[f"{s}-to-{lo}" for s, lo in PLACEMENTS])
def test_a_checkpoint_resumes_byte_identical_under_another_placement(tmp_path, saving, loading):
    ckpt = tmp_path / "ckpt"
    save_run(tmp_path, ckpt, **_placement(saving, tmp_path))[3].close()
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt, **_placement(loading, tmp_path))
    assert streamed.load_from(str(ckpt))
    train(model, optimizer, scheduler, range(SAVE_AT, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


@pytest.mark.parametrize(
    "field, value",
    [("gpu_budget_bytes", -1), ("host_budget_bytes", 1.5), ("gpu_budget_bytes", True), ("host_budget_bytes", "2G")],
)
def test_bad_budgets_are_refused(tmp_path, field, value):
    with pytest.raises(StreamConfigError, match=f"{field.replace('_', ' ')} must be a whole number of bytes"):
        StreamConfig(directory=str(tmp_path), **{field: value})


@pytest.mark.parametrize("moment_dtype", ["bf16", "8bit"])
def test_placement_does_not_change_compact_moments(tmp_path, moment_dtype):
    """A bucket at home in memory rounds its moments to the stored format each step, as on disk."""
    mixed = all_three_homes(moment_dtype=moment_dtype)
    on_disk = streamed_run(
        torch.optim.AdamW, torch.bfloat16, STEPS, tmp_path / "disk", moment_dtype=moment_dtype, bucket_cap_elements=CAP
    )
    placed = streamed_run(
        torch.optim.AdamW, torch.bfloat16, STEPS, tmp_path / "mixed", moment_dtype=moment_dtype, **mixed
    )
    assert placed[2].store.placement["gpu"] == 1
    assert_same_training(on_disk[:2], placed[:2])
    on_disk[2].close()
    placed[2].close()


def test_the_device_home_saves_and_loads_through_a_staging_buffer_smaller_than_a_bucket(tmp_path):
    sizes = 10_000
    bucket = _bucket(0, sizes)
    source = DeviceBacking([bucket], torch.device("cpu"))
    source.open(bucket).buffer.copy_(torch.randint(0, 256, (sizes,), dtype=torch.uint8))
    staging = HostMemory(4096, pin=False)
    path = tmp_path / "bucket.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    saved, loaded = BlockCrc(4096 * 3), BlockCrc(4096 * 3)
    source.export(bucket, fd, str(path), staging, saved)
    target = DeviceBacking([bucket], torch.device("cpu"))
    target.restore(bucket, fd, str(path), staging, loaded)
    os.close(fd)
    assert torch.equal(target.buffers[0], source.buffers[0])
    assert path.read_bytes() == source.buffers[0].numpy().tobytes()
    assert saved.blocks == loaded.blocks and len(saved.blocks) == 1


# ---- several state directories ------------------------------------------------------


def test_disk_buckets_are_dealt_round_robin_over_the_directories_with_room():
    buckets = [_bucket(i, 10) for i in range(5)]
    homes = ["disk", "disk", "disk", "gpu", "disk"]
    assert spread_over_directories(buckets, homes, [100, 100]) == [0, 1, 0, None, 1]
    assert spread_over_directories(buckets, homes, [1000, 10]) == [0, 0, 0, None, 0]
    # Round robin while both have room for the two slots (20): not by the most free.
    assert spread_over_directories(buckets, ["disk"] * 5, [1000, 45]) == [0, 1, 0, 1, 0]
    assert spread_over_directories(buckets, ["disk"] * 5, [45, 20]) == [0, 1, 0, 0, 1]  # then no room: the most left


@pytest.mark.parametrize("engine", ["pipelined", "sync"])
def test_buckets_spread_over_several_directories_are_byte_identical_to_resident(tmp_path, engine):
    directories = [tmp_path / "nvme0", tmp_path / "nvme1"]
    params, state, streamed = streamed_run(
        torch.optim.AdamW,
        torch.bfloat16,
        STEPS,
        ",".join(map(str, directories)),
        engine=engine,
        bucket_cap_elements=CAP,
    )
    store = streamed.store
    assert [s.directory for s in store.placed.scratches] == [str(d) for d in directories]
    used = [store.placed.directory_of[b.index] for b in store.buckets]
    assert set(used) == {0, 1}, used
    for i, scratch in enumerate(store.placed.scratches):
        mine = [b for b in store.buckets if store.placed.directory_of[b.index] == i]
        assert len(os.listdir(scratch.path)) == 2 * len(mine)  # two slots per bucket, nothing else
    if engine == "pipelined":
        assert store.config.io_queues == 2 and {store._backing.open(b).io_queue for b in store.buckets} == {0, 1}
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), (params, state))
    streamed.close()
    assert all(os.listdir(d) == [] for d in directories), "close removes every directory's scratch"


@pytest.mark.parametrize(
    "directory, message",
    [
        ("/a,,/b", "directory must be a non-empty path (or several, comma-separated)"),
        ("/a,/b/../a", "directory names the same directory twice"),
        (["/a", 3], "directory must be a non-empty path"),
    ],
)
def test_bad_directory_lists_are_refused(directory, message):
    with pytest.raises(StreamConfigError, match=re.escape(message)):
        StreamConfig(directory=directory)


def test_each_directory_needs_its_share_of_the_staging_budget():
    with pytest.raises(StreamConfigError, match=r"per direction for each of 3 directories \(12 MiB in all\)"):
        StreamConfig(directory="/a,/b,/c", staging_budget_mb=8)
    config = StreamConfig(directory="/a,/b", staging_budget_mb=128)
    assert config.staging_bytes_total <= 128 << 20 and config.staging_bytes == 8 << 20


def test_the_gpu_home_moves_to_host_memory_and_back_for_an_rl_phase(tmp_path, monkeypatch):
    """offload_to_cpu / restore_from_cpu (Megatron's RL phase switches) move the gpu
    home's buckets out of device memory and back; a step in between still works."""
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", **all_three_homes())
    device_home = streamed.store._backing.by_key["gpu"]
    train(model, optimizer, scheduler, range(8))
    streamed.store.offload_device_home()
    last = streamed.store.buckets[-1].index
    assert list(device_home._offloaded) == [last] and device_home.buffers[last] is device_home._offloaded[last].tensor
    # Offloaded, its bytes are copied in and out as from any host memory, never lent (the
    # CPU is the tensors' device here too: the path a GPU takes, covered on the CPU).
    asked, view_of = [], backings.BufferHandle.view_of

    def recorded(self, offset, tensor):
        view = view_of(self, offset, tensor)
        if self.buffer is device_home.buffers[last]:
            asked.append(view)
        return view

    monkeypatch.setattr(backings.BufferHandle, "view_of", recorded)
    train(model, optimizer, scheduler, range(8, 12))
    assert asked and all(view is None for view in asked)
    monkeypatch.undo()
    streamed.store.restore_device_home()
    assert device_home._offloaded == {}
    train(model, optimizer, scheduler, range(12, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_an_offload_the_host_has_no_room_for_is_refused_before_anything_moves(tmp_path, monkeypatch):
    """Pinned host memory the node does not have would end in the kernel's OOM killer
    mid-rollout: the offload measures the host first and refuses, leaving the gpu home
    where it is; training goes on as if it had not been asked."""
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0", **all_three_homes())
    store = streamed.store
    device_home = store._backing.by_key["gpu"]
    train(model, optimizer, scheduler, range(4))
    home = device_home.bytes_on_device()
    assert home > 0
    # Stand-ins for /proc/meminfo and the cgroup: one byte short of the home.
    monkeypatch.setattr(memory_probes, "cgroup_room", lambda: None)
    monkeypatch.setattr(memory_probes, "_meminfo_bytes", lambda field: home - 1)
    with pytest.raises(StreamIOError, match=r"the offload would put .* GB in \(pinned\) host memory") as refused:
        store.offload_device_home()
    assert refused.value.errno == errno.ENOMEM
    assert device_home._offloaded == {} and device_home.bytes_on_device() == home
    train(model, optimizer, scheduler, range(4, 8))
    monkeypatch.setattr(memory_probes, "_meminfo_bytes", lambda field: 2 * home)
    monkeypatch.setattr(memory_probes, "cgroup_room", lambda: home - 1)  # the cgroup's limit counts too
    with pytest.raises(StreamIOError, match="left under the cgroup's limit"):
        store.offload_device_home()
    monkeypatch.setattr(memory_probes, "cgroup_room", lambda: home)  # just enough
    store.offload_device_home()
    assert device_home.bytes_on_device() == 0
    store.restore_device_home()
    train(model, optimizer, scheduler, range(8, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_an_auto_offload_counts_only_what_it_would_pin_and_refuses_before_moving_any(
    tmp_path, small_drives, monkeypatch
):
    """Under an auto GPU budget the buckets moved up from the disk go back to it, pinning
    nothing; only those placed on the device at setup would be pinned. The check counts
    those alone, and runs before any bucket moves."""
    sizes = bucket_sizes()
    drive = small_drives("drive", sum(sizes[:-2]) + SLACK)
    monkeypatch.setattr(auto_budget, "setup_gpu_room", lambda device, margin, releasable: sizes[-1] + sizes[-2])
    monkeypatch.setattr(memory_probes, "cgroup_room", lambda: None)
    model = Net(torch.bfloat16)
    optimizer = torch.optim.AdamW(groups(model))
    config = StreamConfig(directory=str(drive / "state"), bucket_cap_elements=CAP, gpu_budget_bytes="auto")
    streamed = StreamedOptimizer(optimizer, config)
    scheduler = schedule(optimizer)
    for step in range(2):
        loss_fn(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
        between_steps(optimizer, scheduler, step)
    store = streamed.store
    moved, _ = store.move_to_gpu_home(10**9, "disk")  # as the budget does after a step with room
    assert moved > 0 and store._backing.below
    before = dict(store.placement)
    monkeypatch.setattr(memory_probes, "_meminfo_bytes", lambda field: sum(sizes[-2:]) - 1)
    with pytest.raises(StreamIOError, match="the offload would put"):
        store.offload_device_home()
    assert store.placement == before  # nothing went back below either
    monkeypatch.setattr(memory_probes, "_meminfo_bytes", lambda field: sum(sizes[-2:]))  # the setup's buckets fit
    store.offload_device_home()
    assert store.placement["gpu"] == 2 and store._backing.by_key["gpu"].bytes_on_device() == 0
    store.restore_device_home()
    streamed.close()


def test_the_gpu_home_saves_zeros_where_nothing_was_written(tmp_path):
    """Alignment padding and unwritten moments come out as zeros, as from files: a
    checkpoint's bytes do not depend on placement or on what the allocator held before."""
    garbage = [torch.full((1 << 16,), 0xAB, dtype=torch.uint8) for _ in range(8)]
    del garbage  # freed blocks full of 0xAB for the allocator to hand out again
    saved = {}
    for name, config in (
        ("disk", {"bucket_cap_elements": CAP}),
        ("gpu", {**all_three_homes(), "host_budget_bytes": 0}),
    ):
        config = {**config, "gpu_budget_bytes": 1 << 30} if name == "gpu" else config
        save_run(tmp_path / name, tmp_path / name / "ckpt", **config)[3].close()
        directory = tmp_path / name / "ckpt" / "rank0"
        saved[name] = {p.name: p.read_bytes() for p in sorted(directory.glob("bucket_*.bin"))}
    assert saved["disk"] and saved["disk"] == saved["gpu"]


@pytest.mark.parametrize(
    "text, size", [("3M", 3 << 20), ("2G", 2 << 30), ("1.5T", 3 << 39), ("4096", 4096), ("2GiB", 2 << 30), ("7B", 7)]
)
def test_sizes_read_with_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1G", "G", "5iB", "1X", "2 gigs"])
def test_what_is_not_a_size_is_refused_saying_what_one_looks_like(text):
    with pytest.raises(ValueError, match="is not a size: give a number of bytes with an optional K, M, G or T"):
        parse_size(text)


# ---- failures with in-memory buckets -------------------------------------------------


def _a_step_whose_last_disk_write_fails(tmp_path, engine: str, gpu_budget: int):
    """A store with its last bucket on the GPU whose next step fails on its last disk write."""
    model = Net(torch.bfloat16)
    optimizer = torch.optim.AdamW(groups(model))
    scratch = tmp_path / "scratch"
    config = StreamConfig(directory=str(scratch), engine=engine, bucket_cap_elements=CAP, gpu_budget_bytes=gpu_budget)
    streamed = StreamedOptimizer(optimizer, config)
    for step in range(2):
        loss_fn(model, step).backward()
        if step == 1:
            with FaultPlan(scratch, "write", nth=10**9, fault="eio") as counting:  # counts a step's writes
                optimizer.step()
        else:
            optimizer.step()
        optimizer.zero_grad()
    loss_fn(model, 2).backward()
    with FaultPlan(scratch, "write", nth=counting.calls, fault="eio"), pytest.raises(OSError):
        optimizer.step()
    return streamed, optimizer


@pytest.mark.parametrize("engine", ["pipelined", "sync"])
def test_a_failed_disk_write_before_the_first_in_memory_update_rolls_back(tmp_path, engine):
    """The walk waits for every disk write before it updates the first in-memory bucket:
    a write error of the last disk buckets still finds the step undoable."""
    streamed, optimizer = _a_step_whose_last_disk_write_fails(tmp_path, engine, bucket_sizes()[-1])
    assert streamed.store.placement["gpu"] == 1 and streamed.store.placed.homes[-1] == "gpu"
    optimizer.step()  # the failed step again: the store rolled back instead of refusing
    optimizer.zero_grad()
    streamed.close()


def test_staging_allocated_is_what_the_config_reports_with_an_unused_directory(tmp_path):
    sizes = bucket_sizes()
    config = StreamConfig(
        directory=[str(tmp_path / "a"), str(tmp_path / "b")],
        bucket_cap_elements=CAP,
        gpu_budget_bytes=sum(sizes[1:]),  # one bucket on disk: directory b stays unused
        staging_budget_mb=16,
    )
    streamed = StreamedOptimizer(torch.optim.AdamW(groups(Net(torch.bfloat16))), config)
    assert streamed.store.placement["disk"] == 1
    assert sum(m.nbytes for m in streamed.store._engine._stagings) == config.staging_bytes_total
    streamed.close()


def test_directories_that_are_one_or_nest_are_refused(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "d")
    with pytest.raises(StreamConfigError, match="the same directory twice"):
        StreamConfig(directory=f"{tmp_path}/d,{tmp_path}/link")
    with pytest.raises(StreamConfigError, match=f"directory names {tmp_path}/d/sub inside {tmp_path}/d"):
        StreamConfig(directory=f"{tmp_path}/d,{tmp_path}/d/sub")


# ---- a disk short of two slots per bucket -------------------------------------------

SLACK = 4096  # a small drive's room beyond the bucket files: the scratch's lock file (one page)


@pytest.mark.parametrize(
    "free, one_slot, short",
    [
        ([80], set(), 0),  # two slots each fit
        ([60], {2, 3}, 0),  # the last two disk buckets give up a slot: 20 + 20 + 10 + 10
        ([40], {0, 1, 2, 3}, 0),  # one slot each, exactly
        ([30], {0, 1, 2, 3}, 10),  # even one slot each lacks 10
        (
            [25, 35],
            {1, 2, 3},
            0,
        ),  # over two directories the lack is per directory: 60 free, {2, 3} fit 50 but not there
    ],
)
def test_the_last_disk_buckets_keep_one_slot_as_many_as_the_directories_need(free, one_slot, short):
    buckets = [_bucket(i, 10) for i in range(5)]
    homes = ["disk"] * 4 + ["host"]
    where, kept, lacking = plan_disk(buckets, homes, free)
    assert (set(kept), lacking) == (one_slot, short)
    assert where[4] is None and all(where[i] is not None for i in range(4))


@pytest.mark.parametrize("value", [0, -2, True, 1.5])
def test_drive_ranks_must_be_a_positive_integer(value):
    with pytest.raises(StreamConfigError, match="drive ranks must be a positive integer"):
        StreamConfig(directory="/unused", drive_ranks=value)


def test_a_drive_short_of_two_slots_trains_byte_identical_with_one_slot_buckets(tmp_path, small_drives, caplog):
    sizes = bucket_sizes()
    drive = small_drives("drive", sum(sizes) + sum(sizes[:2]) + SLACK)  # two slots for the first two only
    ref_params, ref_state = reference_run(torch.optim.AdamW, torch.bfloat16, STEPS)
    with caplog.at_level("WARNING"):
        params, state, streamed = streamed_run(
            torch.optim.AdamW, torch.bfloat16, STEPS, drive / "state", bucket_cap_elements=CAP
        )
    one_slot = streamed.store.placed.one_slot
    assert one_slot and 0 not in one_slot and max(one_slot) == len(sizes) - 1, one_slot
    assert "keep one slot, written in place" in caplog.text
    files = sorted(os.listdir(streamed.store.placed.scratches[0].path))
    assert len(files) == 2 * len(sizes) - len(one_slot)  # a one-slot bucket has a single file
    assert_same_training((ref_params, ref_state), (params, state))
    streamed.close()


@pytest.mark.fault
@pytest.mark.parametrize("last_write", [False, True], ids=["before-the-one-slot-bucket", "its-write"])
def test_a_failed_step_rolls_back_only_until_it_updated_a_one_slot_bucket(
    tmp_path, small_drives, last_write, fault_report
):
    """The one-slot buckets come last in the walk, after every disk write the walk drains:
    a write failing before them rolls the step back; failing on the one-slot bucket's own
    write (it was updated in place), the store refuses to go on."""
    sizes = bucket_sizes(fp32_extra=False)
    drive = small_drives("drive", sum(sizes) + sum(sizes[:-1]) + SLACK)  # the last bucket keeps one slot
    model = Net(torch.bfloat16, fp32_extra=False)
    optimizer = torch.optim.AdamW(groups(model))
    config = StreamConfig(directory=str(drive / "state"), bucket_cap_elements=CAP)
    streamed = StreamedOptimizer(optimizer, config)
    assert streamed.store.placed.one_slot == {len(sizes) - 1}
    loss_fn(model, 0).backward()
    with FaultPlan(drive / "state", "write", nth=10**9, fault="eio") as count:
        optimizer.step()  # a whole step's writes, counted
    loss_fn(model, 1).backward()
    last = streamed.store.buckets[-1]
    last_bucket_writes = len(last.entry_indices) * len(last.segments)  # one request per entry and segment here
    nth = count.calls if last_write else count.calls - last_bucket_writes
    with FaultPlan(drive / "state", "write", nth=nth, fault="eio"), pytest.raises(StreamIOError):
        optimizer.step()
    if last_write:
        with pytest.raises(StoreUnusableError, match="one slot") as refused:
            optimizer.step()
        observed = "the next step refused: ..." + str(refused.value).split("and ", 1)[-1][:90]
    else:
        optimizer.step()  # rolled back: the step runs again
        assert streamed.store.steps_taken == 2
        observed = "rolled back; the step ran again"
    streamed.close()
    where = "on the one-slot bucket's own write" if last_write else "before the one-slot bucket"
    fault_report(
        f"a write fails {where} (a drive short of two slots: the last disk bucket keeps one)",
        "refused from then on, as for host buckets" if last_write else "rolled back, as with two slots",
        observed,
        "the steps since the last checkpoint" if last_write else "none beyond the step in progress",
    )


def test_a_drive_short_even_of_one_slot_each_is_refused_saying_how_much_is_missing(tmp_path, small_drives):
    sizes = bucket_sizes()
    drive = small_drives("drive", sum(sizes) // 2)
    model = Net(torch.bfloat16)
    with pytest.raises(
        StreamIOError, match=r"not enough free space .* needs .* one slot each, .* free; nothing was written"
    ):
        StreamedOptimizer(
            torch.optim.AdamW(groups(model)), StreamConfig(directory=str(drive / "state"), bucket_cap_elements=CAP)
        )
    assert os.listdir(drive / "state") == [f".{'rank0'}.lock"] or os.listdir(drive / "state") == []


def test_an_auto_gpu_budget_takes_at_setup_what_host_and_disk_cannot_hold(tmp_path, small_drives, monkeypatch):
    """The room a CUDA device would report is given here (a CPU has no device memory to
    measure; ``setup_gpu_room`` reads the CUDA allocator): the last buckets go to the gpu
    home at setup, the disk holds the rest in one slot, training is byte-identical, and an
    offload (these buckets have no place below) and a restore keep it so."""
    sizes = bucket_sizes()
    drive = small_drives("drive", sum(sizes[:-2]) + SLACK)
    monkeypatch.setattr(auto_budget, "setup_gpu_room", lambda device, margin, releasable: sizes[-1] + sizes[-2])
    monkeypatch.setattr(memory_probes, "cgroup_room", lambda: None)
    ref_params, ref_state = reference_run(torch.optim.AdamW, torch.bfloat16, STEPS)
    model = Net(torch.bfloat16)
    optimizer = torch.optim.AdamW(groups(model))
    config = StreamConfig(directory=str(drive / "state"), bucket_cap_elements=CAP, gpu_budget_bytes="auto")
    streamed = StreamedOptimizer(optimizer, config)
    assert streamed.store.placement == {"gpu": 2, "host": 0, "disk": len(sizes) - 2}
    assert streamed.store.placed.setup_gpu_bytes == sizes[-1] + sizes[-2]
    scheduler = schedule(optimizer)
    for step in range(STEPS):
        loss_fn(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
        between_steps(optimizer, scheduler, step)
        if step == 1:
            # Only the setup's buckets would be pinned (the others have places below): one
            # byte short of them, the offload is refused before any bucket moves.
            monkeypatch.setattr(memory_probes, "_meminfo_bytes", lambda field: sum(sizes[-2:]) - 1)
            before = dict(streamed.store.placement)
            with pytest.raises(StreamIOError, match="the offload would put"):
                streamed.store.offload_device_home()
            assert streamed.store.placement == before
            monkeypatch.setattr(memory_probes, "_meminfo_bytes", lambda field: sum(sizes[-2:]))
            streamed.store.offload_device_home()
            streamed.store.restore_device_home()
    by_param = {id(p): (main, m, v) for p, main, m, v in streamed.iter_state()}
    state = [by_param[id(p)] for p in model.parameters()]
    assert_same_training((ref_params, ref_state), ([p.detach().clone() for p in model.parameters()], state))
    streamed.close()


def test_the_gpu_homes_fp32_state_is_updated_in_its_own_bytes_with_no_copy(tmp_path, monkeypatch):
    """fp32 mains and moments in the gpu home share the home's bytes for their bucket's
    update (``BufferHandle.view_of``): the setup writes the mains into the home through
    them (no copy), the first step copies in only the moments it creates (two per
    entry), later steps copy nothing, the training is the resident reference's byte
    for byte, and between steps no main or moment holds memory of its own nor the
    home's (each got its own empty storage back), the home's buffers unchanged in size."""
    from miles_plugins.optimizers.homes.backings import BufferHandle

    copies = {"read": 0, "write": 0}
    for name in copies:
        original = getattr(BufferHandle, name)

        def counted(self, offset, tensor, staging, _original=original, _name=name):
            if self.shared:
                copies[_name] += 1
            return _original(self, offset, tensor, staging)

        monkeypatch.setattr(BufferHandle, name, counted)
    ref = reference_run(torch.optim.AdamW, torch.bfloat16, STEPS)
    model = Net(torch.bfloat16, True)
    optimizer = torch.optim.AdamW(groups(model))
    config = StreamConfig(directory=str(tmp_path), tier="host", bucket_cap_elements=CAP, gpu_budget_bytes=1 << 30)
    streamed = StreamedOptimizer(optimizer, config)
    store = streamed.store
    assert store.placement["gpu"] == len(store.buckets) >= 4
    assert copies == {"read": 0, "write": 0}  # the setup's mains went into the home through shared views
    buffers = store._backing.by_key["gpu"].buffers
    sizes = {i: b.untyped_storage().nbytes() for i, b in buffers.items()}
    entries = [
        (store.entries[i], b, store._pipeline.optimizers[b.index]) for b in store.buckets for i in b.entry_indices
    ]
    scheduler = schedule(optimizer)
    per_step = []
    for step in range(STEPS):
        loss_fn(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
        between_steps(optimizer, scheduler, step)
        per_step.append(dict(copies))
        # Mains but an fp32 param's (its own main, in the model), and every moment.
        mains = [entry.main for entry, bucket, _ in entries if bucket.streams_main]
        moments = [t for entry, _, opt in entries for t in opt.moments(entry.main)]
        assert len(moments) == 2 * len(entries) and len(mains) < len(entries)
        assert all(t.untyped_storage().nbytes() == 0 for t in mains + moments), step  # not their own, not the home's
        assert {i: b.untyped_storage().nbytes() for i, b in buffers.items()} == sizes
    assert per_step[0] == {"read": 0, "write": 2 * len(entries)}  # the new moments, copied in once
    assert all(counts == per_step[0] for counts in per_step[1:]), per_step  # then nothing at all
    by_param = {id(p): (main, m, v) for p, main, m, v in streamed.iter_state()}
    state = [by_param[id(p)] for p in model.parameters()]
    assert_same_training(ref, ([p.detach().clone() for p in model.parameters()], state))
    streamed.close()


@pytest.mark.parametrize(
    "formats",
    [{"moment_dtype": "8bit"}, {"main_storage": "remainder"}, {"moment_dtype": "bf16"}],
    ids=["8bit-moments", "remainder-mains", "bf16-moments"],
)
def test_compact_forms_beside_shared_fp32_tensors_in_the_gpu_home_train_as_in_host_memory(tmp_path, formats):
    """A gpu-home bucket whose main or moments are stored compact (copied and converted)
    beside fp32 ones (shared): byte for byte the training of the same formats in host
    memory, where nothing is shared."""
    runs = []
    for name, budget in (("host", 0), ("gpu", 1 << 30)):
        config = {"tier": "host", "bucket_cap_elements": CAP, "gpu_budget_bytes": budget, **formats}
        runs.append(streamed_run(torch.optim.AdamW, torch.bfloat16, STEPS, tmp_path / name, **config))
    (host_params, host_state, host), (gpu_params, gpu_state, gpu) = runs
    assert gpu.store.placement["host"] == 0 and host.store.placement["gpu"] == 0
    assert_same_training((host_params, host_state), (gpu_params, gpu_state))
    host.close()
    gpu.close()


def test_a_tensor_that_still_shares_a_home_is_never_resized_through():
    """``StateAccounting.materialize`` refuses a view into a larger storage (a home's
    bytes): resizing its storage would resize the home."""
    from miles_plugins.optimizers.step.flight import StateAccounting

    home = torch.arange(64, dtype=torch.uint8)
    tensor = torch.empty(4)
    tensor.data = home[16:32].view(torch.float32)
    with pytest.raises(RuntimeError, match="shares a larger storage"):
        StateAccounting().materialize(tensor)
    assert home.untyped_storage().nbytes() == 64 and torch.equal(home, torch.arange(64, dtype=torch.uint8))


def test_a_home_lends_its_bytes_only_when_shared_and_on_the_tensors_device():
    from miles_plugins.optimizers.homes.backings import BufferHandle

    buffer = torch.zeros(8192, dtype=torch.uint8)
    tensor = torch.empty(16)
    view = BufferHandle(buffer, "home", shared=True).view_of(4096, tensor)
    assert view.data_ptr() == buffer.data_ptr() + 4096 and view.shape == tensor.shape and view.dtype == torch.float32
    assert BufferHandle(buffer, "host memory").view_of(4096, tensor) is None  # not lent
    assert BufferHandle(buffer, "home", shared=True).view_of(4096, torch.empty(16, device="meta")) is None


@pytest.mark.parametrize(
    "config, lent_from_step",
    [
        ({"gpu_budget_bytes": 1 << 30}, 1),  # fp32 in the gpu home: lent once the moments exist
        ({"gpu_budget_bytes": 1 << 30, "moment_dtype": "8bit"}, None),  # 8-bit moments are decoded
        ({"gpu_budget_bytes": 1 << 30, "main_storage": "remainder"}, None),  # so are remainder mains
        ({}, None),  # host memory lends nothing
    ],
    ids=["gpu-fp32", "gpu-8bit", "gpu-remainder", "host"],
)
def test_what_lends_all_foresees_is_what_each_fetch_materializes(tmp_path, monkeypatch, config, lent_from_step):
    """``Pipeline.lends_all`` decides, before a fetch, whether the bucket takes room among
    those in flight: it must say no exactly where the fetch and the update add no
    materialized byte (the store's own accounting), step after step."""
    from miles_plugins.optimizers.step.pipeline import Pipeline

    seen = []  # (step, bucket, foreseen, accounted bytes the fetch and the update added)
    fetch, update = Pipeline.fetch, None

    def watched_fetch(self, index, stats, *args, **kwargs):
        foreseen = self.lends_all(index)
        before = self.accounting.current
        flight = fetch(self, index, stats, *args, **kwargs)
        seen.append([len(steps), index, foreseen, self.accounting.current - before])
        return flight

    monkeypatch.setattr(Pipeline, "fetch", watched_fetch)
    steps = []
    model = Net(torch.bfloat16, True)
    optimizer = torch.optim.AdamW(groups(model))
    streamed = StreamedOptimizer(
        optimizer, StreamConfig(directory=str(tmp_path), tier="host", bucket_cap_elements=CAP, **config)
    )
    store = streamed.store
    update = store._steps.update

    def watched_update(flight):
        before = store._pipeline.accounting.current
        update(flight)
        seen[-1 - next(i for i, s in enumerate(reversed(seen)) if s[1] == flight.bucket.index)][3] += (
            store._pipeline.accounting.current - before
        )

    monkeypatch.setattr(store._steps, "update", watched_update)
    seen.clear()  # the setup's writes of the mains
    for step in range(3):
        loss_fn(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.append(step)
    assert {(s, b) for s, b, *_ in seen} == {(s, b.index) for s in range(3) for b in store.buckets}
    for step, index, foreseen, added in seen:
        assert foreseen == (added == 0), (step, index, foreseen, added)
        expected = lent_from_step is not None and step >= lent_from_step and store.buckets[index].streams_main
        assert foreseen == expected or not store.buckets[index].streams_main, (step, index, foreseen)
    streamed.close()


def test_buckets_that_share_their_homes_bytes_are_not_held_up_behind_earlier_writes(tmp_path, monkeypatch):
    """The gpu home's buckets (the walk's last) take no room among the buckets in flight
    (depth 2): they are fetched, and updated, while the host buckets' writes before them
    are still running; the training is the reference's."""
    from miles_plugins.optimizers.step.pipeline import Pipeline

    events = []
    fetch, retire = Pipeline.fetch, Pipeline._retire_oldest

    def watched_fetch(self, index, *args, **kwargs):
        events.append(("fetch", index))
        return fetch(self, index, *args, **kwargs)

    def watched_retire(self, writing):
        events.append(("retire", writing[0].bucket.index))
        return retire(self, writing)

    monkeypatch.setattr(Pipeline, "fetch", watched_fetch)
    monkeypatch.setattr(Pipeline, "_retire_oldest", watched_retire)
    sizer = StreamedOptimizer(
        torch.optim.AdamW(groups(Net(torch.bfloat16, True))),
        StreamConfig(directory=str(tmp_path / "sizes"), tier="host", bucket_cap_elements=CAP),
    )
    last_two = sum(b.file_size for b in sizer.store.buckets[-2:])
    sizer.close()
    config = {"tier": "host", "bucket_cap_elements": CAP, "gpu_budget_bytes": last_two, "buckets_in_flight": 2}
    events.clear()
    params, state, streamed = streamed_run(torch.optim.AdamW, torch.bfloat16, STEPS, tmp_path / "run", **config)
    homes = streamed.store.placed.homes
    first_gpu = homes.index("gpu")
    assert homes[first_gpu:] == ["gpu"] * 2 and first_gpu >= 2
    walks = [i for i, e in enumerate(events) if e == ("fetch", 0)]
    last = events[walks[-2] : walks[-1]]  # the last step's walk (then iter_state's reads), every moment made
    # Both are fetched before the host writes ahead of them are waited for: two materialized
    # buckets would have had to wait for the one before the last host bucket's.
    assert last.index(("fetch", len(homes) - 1)) < last.index(("retire", first_gpu - 2)), last
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), (params, state))
    streamed.close()


def test_a_home_lends_a_bucket_only_on_the_device_and_not_while_offloaded(tmp_path):
    """``lends`` says where a fetch may share a bucket's bytes: the gpu home, on the
    tensors' device, not while its buffers are offloaded to host memory; host memory
    and files never (their bytes are not where the update runs)."""
    from miles_plugins.optimizers.homes.backings import FileBacking, HostBacking

    bucket = _bucket(0, 4096)
    home = DeviceBacking([bucket], torch.device("cpu"))
    assert home.lends(bucket, torch.device("cpu")) and not home.lends(bucket, torch.device("meta"))
    home.open(bucket)  # allocates the buffer
    home.to_host(pin=False)
    assert not home.lends(bucket, torch.device("cpu"))
    home.to_device()
    assert home.lends(bucket, torch.device("cpu"))
    home.release()
    host = HostBacking([bucket], pin=False)
    files = FileBacking(str(tmp_path), [bucket], direct=False)
    assert not host.lends(bucket, torch.device("cpu")) and not files.lends(bucket, torch.device("cpu"))
    host.release()
    files.release()


def test_a_main_that_holds_values_of_its_own_is_not_foreseen_as_lent(tmp_path):
    """A main with storage of its own (one Megatron built) is copied into its bucket, not
    shared (``Pipeline._share``): ``lends_all`` must say the bucket materializes."""
    model = Net(torch.bfloat16, True)
    optimizer = torch.optim.AdamW(groups(model))
    config = StreamConfig(directory=str(tmp_path), tier="host", bucket_cap_elements=CAP, gpu_budget_bytes=1 << 30)
    streamed = StreamedOptimizer(optimizer, config)
    store = streamed.store
    loss_fn(model, 0).backward()
    optimizer.step()  # the moments exist from here on
    bucket = next(b for b in store.buckets if b.streams_main)
    assert store._pipeline.lends_all(bucket.index)
    main = store.entries[bucket.entry_indices[0]].main
    main.untyped_storage().resize_(main.numel() * main.element_size())
    assert not store._pipeline.lends_all(bucket.index)
    main.untyped_storage().resize_(0)
    assert store._pipeline.lends_all(bucket.index)
    streamed.close()


def test_buckets_in_flight_that_hold_no_memory_leave_room_for_one_that_does():
    """``Pipeline._make_room`` counts the flights holding memory: with ``max_in_flight`` of them
    in flight it retires the oldest write, with fewer (the rest sharing their home's
    bytes) it lets the next bucket in at once."""
    from types import SimpleNamespace

    from miles_plugins.optimizers.step.pipeline import Pipeline

    retired = []
    walker = SimpleNamespace(max_in_flight=2, _retire_oldest=lambda writing: retired.append(writing.popleft()))
    flight = lambda holds: SimpleNamespace(holds_memory=holds, writes=None)  # noqa: E731
    shared_writes = deque([flight(False), flight(False), flight(True)])
    assert Pipeline._make_room(walker, deque(), shared_writes) and not retired  # one holds memory: room
    full = deque([flight(True), flight(False), flight(True)])
    assert Pipeline._make_room(walker, deque(), full)
    assert [f.holds_memory for f in retired] == [True] and len(full) == 2  # the oldest, then room
