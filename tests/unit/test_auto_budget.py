"""``"auto"`` budgets: the host's measured at setup, the GPU's after the first step.

Training is judged against the independent resident reference
(``reference.reference_run``). This machine has no GPU: the ``gpu`` home is the
CPU's memory, and the CUDA allocator's statistics that size it are stood in for
by :class:`SimulatedDevice` (headroom and peak as the test sets them); the moves
themselves, the stores, the files and the optimizers are the real ones.
"""

import logging
import os
import subprocess
import sys

import pytest
import torch

from miles_plugins.optimizers import StreamConfig
from miles_plugins.optimizers.config import AUTO
from miles_plugins.optimizers.errors import StreamConfigError, StreamIOError
from miles_plugins.optimizers.homes import auto_budget, memory_probes
from miles_plugins.optimizers.homes.auto_budget import host_budget
from miles_plugins.optimizers.homes.device_backing import DeviceBacking
from miles_plugins.optimizers.homes.memory_probes import cgroup_room
from tests.helpers import CAP, REPO, SAVE_AT, STEPS, GiB, SimulatedDevice, fresh, resume, state_of, train
from tests.unit.reference import assert_same_training, reference_run


@pytest.fixture(autouse=True)
def one_budget_per_test():
    """The device's budget (shared by its stores) starts over with each test, even a failed one."""
    yield
    auto_budget._BUDGETS.clear()


MARGIN = 16 << 10  # bytes: the test model's buckets are 8 to 36 KiB; growth below 2 KiB is noise


def _auto(tmp_path, name="rank0", margin=MARGIN, **config):
    """A streamed run with an auto GPU budget, before its first step."""
    model, optimizer, scheduler, streamed = fresh(
        tmp_path, name, bucket_cap_elements=CAP, gpu_budget_bytes="auto", auto_gpu_margin_bytes=margin, **config
    )
    return model, optimizer, scheduler, streamed


def _gpu_run(store) -> list[int]:
    """Indices of the buckets at home on the device (they must be one run at the end)."""
    run = [b.index for b in store.buckets if store.placed.homes[b.index] == "gpu"]
    assert run == list(range(len(store.buckets) - len(run), len(store.buckets))), store.placed.homes
    return run


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_buckets_move_to_the_device_after_the_first_step_and_back_when_the_peak_grows(tmp_path, caplog, tier):
    model, optimizer, scheduler, streamed = _auto(tmp_path, tier=tier)
    store = streamed.store
    sizes = [b.file_size for b in store.buckets]
    device = SimulatedDevice(headroom=MARGIN + sizes[-1] + sizes[-2] + sizes[-3] // 2)
    device.held = lambda: store.home_bytes["gpu"]
    store.auto_gpu.memory = device
    assert store.placement["gpu"] == 0  # nobody knows the forward/backward peak before a step
    caplog.set_level(logging.INFO, logger="miles_plugins.optimizers.homes.auto_budget")
    train(model, optimizer, scheduler, range(0, 1))
    assert _gpu_run(store) == [len(sizes) - 2, len(sizes) - 1]  # what the headroom beyond the margin holds
    assert "2 buckets" in caplog.text and "now stay on the device" in caplog.text
    assert store._pipeline.drain_before <= min(_gpu_run(store))  # disk writes drain before in-place updates
    train(model, optimizer, scheduler, range(1, 5))
    assert len(_gpu_run(store)) == 2  # a steady peak moves nothing
    assert sizes[-2] // 2 > MARGIN // 8, "the growth below must not be noise"
    # A larger batch: what the fill left beyond the margin, and half a bucket more.
    device.grow(sizes[-3] // 2 + sizes[-2] // 2)
    train(model, optimizer, scheduler, range(5, 6))
    assert _gpu_run(store) == [len(sizes) - 1] and "short of the" in caplog.text
    expected_home = "disk" if tier == "disk" else "host"
    assert store.placed.homes[len(sizes) - 2] == expected_home
    train(model, optimizer, scheduler, range(6, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_what_the_build_left_cached_is_not_counted_as_training_s_need(tmp_path):
    """The allocator keeps what the model's build freed reserved (Megatron's DDP build holds
    params, a param buffer and grads at once); the first interval starts with that cache given
    back, or its reserved peak would leave no room for the home (seen at 18B on an H200)."""
    sizer = _auto(tmp_path / "sizes", "s")[3]
    sizes = [b.file_size for b in sizer.store.buckets]
    sizer.close()
    headroom = MARGIN + sizes[-1] + sizes[-2] + sizes[-3] // 2
    device = SimulatedDevice(headroom=headroom)
    device._reserved = device.total  # the build's freed blocks, still cached
    auto_budget.AutoGpuBudget.for_device(torch.device("cpu"), MARGIN).memory = device
    model, optimizer, scheduler, streamed = _auto(tmp_path)
    store = streamed.store
    device.held = lambda: store.home_bytes["gpu"]
    train(model, optimizer, scheduler, range(0, 1))
    assert _gpu_run(store) == [len(sizes) - 2, len(sizes) - 1]
    streamed.close()


def test_every_store_that_joins_before_the_first_step_restarts_the_interval_with_the_cache_given_back():
    """A chain's expert store is built after the dense one: the mains it wrote out stay cached
    (reserved) unless its registration gives them back too; after a step nothing is reset."""

    class Joining:  # a store as the budget sees it at registration
        pass

    device = SimulatedDevice(headroom=MARGIN)
    budget = auto_budget.AutoGpuBudget(MARGIN, device)
    dense, expert, late = Joining(), Joining(), Joining()
    budget.register(dense, torch.device("cpu"))
    device._reserved = device.total  # the expert store's mains, written out and cached
    budget.register(expert, torch.device("cpu"))
    assert device._reserved == 0 and device._peak == 0
    budget._stepped.add(dense)
    device._reserved = device.total
    budget.register(late, torch.device("cpu"))
    assert device._reserved == device.total  # after a step, a joining store leaves the statistics alone


def _auto_over_disk_and_host(tmp_path, headroom_beyond_margin):
    """An auto GPU budget over the disk home and a host budget that takes the last bucket."""
    sizer = _auto(tmp_path / "sizes", "s")[3]
    sizes = [b.file_size for b in sizer.store.buckets]
    sizer.close()
    model, optimizer, scheduler, streamed = _auto(tmp_path, host_budget_bytes=sizes[-1])
    store = streamed.store
    assert store.placement == {"gpu": 0, "host": 1, "disk": len(sizes) - 1}
    device = SimulatedDevice(headroom=MARGIN + headroom_beyond_margin(sizes))
    device.held = lambda: store.home_bytes["gpu"]
    store.auto_gpu.memory = device
    return model, optimizer, scheduler, streamed, device


@pytest.mark.parametrize(
    "room, left",
    [
        # Room for the last two disk buckets, not for the one before, nor for the host bucket after them.
        (lambda sizes: sizes[-2] + sizes[-3] + sizes[-1] // 2, ["gpu", "gpu", "host"]),
        # No room for the last disk bucket, room for the host one: a disk bucket that does not fit stops
        # only the disk buckets.
        (lambda sizes: sizes[-1] + (sizes[-2] - sizes[-1]) // 2, ["disk", "disk", "gpu"]),
    ],
    ids=["disk-first", "host-when-no-disk-bucket-fits"],
)
def test_the_device_takes_disk_buckets_before_host_ones(tmp_path, room, left):
    model, optimizer, scheduler, streamed, _ = _auto_over_disk_and_host(tmp_path, room)
    homes = streamed.store.placed.homes
    train(model, optimizer, scheduler, range(0, 1))
    # The step no longer streams them from the drive; the disk home is still the run the walk starts with.
    assert homes == ["disk"] * (len(homes) - 3) + left, homes
    first_in_memory = homes.index(next(h for h in homes if h != "disk"))
    assert streamed.store._pipeline.drain_before == first_in_memory  # disk writes drain before in-place updates
    train(model, optimizer, scheduler, range(1, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_stores_sharing_a_budget_give_every_disk_bucket_before_any_host_one(tmp_path):
    """Across stores too: the second store's host buckets wait for the first store's disk ones,
    and go back before them."""
    disk_run = _auto(tmp_path / "a", name="a")
    host_run = _auto(tmp_path / "b", name="b", tier="host")
    stores = [run[3].store for run in (disk_run, host_run)]
    sizes = [b.file_size for b in stores[0].buckets]
    device = SimulatedDevice(headroom=MARGIN + sum(sizes) + sizes[-1])  # the disk store's buckets, and one more
    device.held = lambda: sum(s.home_bytes["gpu"] for s in stores)
    stores[0].auto_gpu.memory = device

    def step(i):
        for model, optimizer, scheduler, _ in (disk_run, host_run):
            train(model, optimizer, scheduler, range(i, i + 1))

    step(0)
    assert stores[0].placed.homes == ["gpu"] * len(sizes)
    assert stores[1].placed.homes == ["host"] * (len(sizes) - 1) + ["gpu"]
    step(1)
    device.grow(MARGIN // 4)  # one bucket goes back: the second store's, from host memory
    step(2)
    assert stores[0].placed.homes == ["gpu"] * len(sizes) and stores[1].placed.homes == ["host"] * len(sizes)
    for i in range(3, STEPS):
        step(i)
    for model, _, _, streamed in (disk_run, host_run):
        assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
        streamed.close()


def test_the_device_gives_host_buckets_back_before_disk_ones(tmp_path):
    model, optimizer, scheduler, streamed, device = _auto_over_disk_and_host(tmp_path, sum)
    homes = streamed.store.placed.homes
    train(model, optimizer, scheduler, range(0, 2))
    assert homes == ["gpu"] * len(homes)
    device.grow(MARGIN // 4)  # short of the margin by more than an eighth of it: one bucket goes back
    train(model, optimizer, scheduler, range(2, 3))
    # The one a step streams cheapest (from host memory), not the first visited (from the drive).
    assert homes == ["gpu"] * (len(homes) - 1) + ["host"], homes
    train(model, optimizer, scheduler, range(3, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_growth_beyond_what_the_device_holds_gives_back_everything_and_says_so(tmp_path, caplog):
    model, optimizer, scheduler, streamed = _auto(tmp_path)
    store = streamed.store
    device = SimulatedDevice(headroom=MARGIN + 3 * max(b.file_size for b in store.buckets))
    device.held = lambda: store.home_bytes["gpu"]
    store.auto_gpu.memory = device
    train(model, optimizer, scheduler, range(0, 2))
    assert len(_gpu_run(store)) >= 3
    device.grow(1 << 40)
    train(model, optimizer, scheduler, range(2, STEPS))
    assert store.placement["gpu"] == 0 and "all there were" in caplog.text
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_device_memory_that_cannot_be_had_stops_every_move_and_training_goes_on(tmp_path, caplog, monkeypatch):
    # Two stores sharing the budget, each over disk and host: four passes a fill could make.
    sizer = _auto(tmp_path / "sizes", "s")[3]
    last = sizer.store.buckets[-1].file_size
    sizer.close()
    runs = [_auto(tmp_path / name, name=name, host_budget_bytes=last) for name in ("a", "b")]
    stores = [run[3].store for run in runs]
    stores[0].auto_gpu.memory = SimulatedDevice(headroom=1 << 40)  # room for all: the allocator says otherwise
    add, calls = DeviceBacking.add, []

    def add_twice(self, bucket):
        calls.append(bucket.index)
        if len(calls) > 2:
            raise StreamIOError("out of memory (injected)", "<device>", 0, 12)
        return add(self, bucket)

    monkeypatch.setattr(DeviceBacking, "add", add_twice)
    for i in range(STEPS):
        for model, optimizer, scheduler, _ in runs:
            train(model, optimizer, scheduler, range(i, i + 1))
    # The failed allocation stopped the fill: no other store or home tried again (nor warned again).
    assert len(calls) == 3 and caplog.text.count("stays where it is") == 1, calls
    assert sum(s.placement["gpu"] for s in stores) == 2
    for model, _, _, streamed in runs:
        assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
        streamed.close()


@pytest.mark.parametrize(
    "saving_auto, loading_auto", [(True, False), (False, True)], ids=["auto-to-disk", "disk-to-auto"]
)
def test_a_checkpoint_resumes_byte_identical_across_an_auto_placement(tmp_path, saving_auto, loading_auto):
    ckpt = tmp_path / "ckpt"

    def run(auto: bool, kind: str):
        config = {"bucket_cap_elements": CAP}
        if auto:
            config |= {"gpu_budget_bytes": "auto", "auto_gpu_margin_bytes": 0}
        built = (fresh if kind == "save" else lambda t, n, **c: resume(t, ckpt, **c))(tmp_path, "rank0", **config)
        if auto:
            built[3].store.auto_gpu.memory = SimulatedDevice(
                headroom=4 * max(b.file_size for b in built[3].store.buckets)
            )
        return built

    model, optimizer, scheduler, streamed = run(saving_auto, "save")
    train(model, optimizer, scheduler, range(SAVE_AT))
    assert (streamed.store.placement["gpu"] >= 1) == saving_auto
    ckpt.mkdir()
    streamed.save_to(str(ckpt))
    torch.save({"model": model.state_dict(), "scheduler": scheduler.state_dict()}, ckpt / "rest.pt")
    streamed.close()
    model, optimizer, scheduler, streamed = run(loading_auto, "load")
    assert streamed.load_from(str(ckpt))
    train(model, optimizer, scheduler, range(SAVE_AT, STEPS))
    assert (streamed.store.placement["gpu"] >= 1) == loading_auto
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_small_growth_is_noise_until_it_adds_up(tmp_path, caplog):
    model, optimizer, scheduler, streamed = _auto(tmp_path)
    store = streamed.store
    device = SimulatedDevice(headroom=MARGIN + store.file_bytes_total)
    device.held = lambda: store.home_bytes["gpu"]
    store.auto_gpu.memory = device
    train(model, optimizer, scheduler, range(0, 1))
    everything = len(store.buckets)
    assert store.placement["gpu"] == everything
    noise = MARGIN // 8 * 3 // 4
    device.grow(noise)  # allocator rounding: nothing moves
    train(model, optimizer, scheduler, range(1, 2))
    assert store.placement["gpu"] == everything and "short of the" not in caplog.text
    device.grow(noise)  # twice that is growth: the first device bucket goes back
    train(model, optimizer, scheduler, range(2, 3))
    assert store.placement["gpu"] == everything - 1 and "short of the" in caplog.text
    train(model, optimizer, scheduler, range(3, STEPS))
    assert store.placement["gpu"] == everything - 1  # covered: nothing more goes back
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_where_the_step_sets_the_peak_a_bucket_given_back_frees_less_and_more_follow(tmp_path):
    """A bucket of the gpu home takes no memory in a step (its fp32 state shares the
    home's bytes); given back while fewer buckets stream than fit in flight, it is
    materialized in flight instead. Where the step sets the peak, the cover (which
    counts a bucket by its bytes in the home) then gives more back at the next steps,
    each within the margin, until the peak fits; then nothing moves."""
    model, optimizer, scheduler, streamed = _auto(tmp_path, tier="host")
    store = streamed.store
    max_in_flight = store.config.max_in_flight
    streamed_first = sum(sorted((b.materialized_bytes for b in store.buckets), reverse=True)[:max_in_flight])
    device = SimulatedDevice(headroom=MARGIN + store.file_bytes_total + streamed_first)  # room for all
    device.held = lambda: store.home_bytes["gpu"]
    store.auto_gpu.memory = device
    device.steps_set_the_peak(store)
    train(model, optimizer, scheduler, range(0, 1))
    assert store.placement["gpu"] == len(store.buckets)
    # Growth beyond the room the steps no longer take (nothing streams now), by a quarter margin.
    device.grow(streamed_first + MARGIN // 4)
    placements = []
    for step in range(1, STEPS):
        train(model, optimizer, scheduler, range(step, step + 1))
        placements.append(store.placement["gpu"])
        assert device.limit() - device.peak() >= 0, step  # no step went past the device
    settled = placements[-1]
    assert len(store.buckets) - settled > 1  # more than one bucket went back
    assert placements.index(settled) <= max_in_flight  # within as many steps as buckets fit in flight
    assert all(p == settled for p in placements[placements.index(settled) :])  # then nothing moves
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def _rl(tmp_path, headroom_of_state: float = 0.5):
    model, optimizer, scheduler, streamed = _auto(tmp_path)
    store = streamed.store
    device = SimulatedDevice(headroom=MARGIN + int(store.file_bytes_total * headroom_of_state))
    device.held = lambda: store.home_bytes["gpu"]
    store.auto_gpu.memory = device
    return model, optimizer, scheduler, streamed, store, device


def test_an_offload_gives_buckets_back_pinning_nothing_and_the_restore_refills(tmp_path, monkeypatch):
    model, optimizer, scheduler, streamed, store, device = _rl(tmp_path, 1.0)
    train(model, optimizer, scheduler, range(0, 2))
    moved = store.placement["gpu"]
    assert moved == len(store.buckets)
    # No host memory left at all: nothing is pinned, so nothing is refused.
    monkeypatch.setattr(memory_probes, "_meminfo_bytes", lambda field: 0)
    store.offload_device_home()  # an RL rollout wants the GPU
    assert store.placement["gpu"] == 0 and not store._backing.by_key["gpu"].offloaded
    store.restore_device_home()
    assert store.placement["gpu"] == moved  # filled again at the restore: the next steps run with it
    train(model, optimizer, scheduler, range(2, STEPS))
    assert store.placement["gpu"] == moved
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_one_step_per_rollout_leaves_the_home_empty_and_says_so_two_steps_fill_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="miles_plugins.optimizers.homes.auto_budget")
    model, optimizer, scheduler, streamed, store, device = _rl(tmp_path)
    held_by_steps = []
    step = 0
    for steps_per_rollout in (1, 1, 1, 2, 2, 2):
        for _ in range(steps_per_rollout):
            held_by_steps.append(store.home_bytes["gpu"])
            train(model, optimizer, scheduler, range(step, step + 1))
            step += 1
        store.offload_device_home()
        store.restore_device_home()
    # One step between offloads: moving the home out and in would cost what the step saves.
    assert held_by_steps[:3] == [0, 0, 0] and "one training step between offloads" in caplog.text
    # Two: filled at each restore after such a rollout, the same each time (never taking the
    # fill's own bytes as free): the first two-step rollout still ran without it.
    assert held_by_steps[3:5] == [0, 0] and held_by_steps[5] > 0, held_by_steps
    assert set(held_by_steps[5:]) == {held_by_steps[5]}, held_by_steps
    train(model, optimizer, scheduler, range(step, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_what_a_rollout_or_a_weight_update_needs_comes_out_of_the_refill(tmp_path):
    model, optimizer, scheduler, streamed, store, device = _rl(tmp_path)
    train(model, optimizer, scheduler, range(0, 2))
    moved = store.home_bytes["gpu"]
    update = min(b.file_size for b in store.buckets)
    device.grow(update)  # the weight update's transient, with the home held
    device.record()
    device.grow(-update)
    store.offload_device_home()
    device.grow(update)  # in-process inference's cache during the rollout, with the home given back
    device.record()
    device.grow(-update)
    store.restore_device_home()
    assert 0 < store.home_bytes["gpu"] <= moved - update, (store.home_bytes["gpu"], moved, update)
    streamed.close()


def test_a_restore_before_the_first_step_fills_nothing(tmp_path):
    """An RL loop may offload and restore (a rollout) before the first training step:
    no forward/backward peak is known yet."""
    model, optimizer, scheduler, streamed, store, device = _rl(tmp_path)
    store.offload_device_home()
    store.restore_device_home()
    assert store.placement["gpu"] == 0
    train(model, optimizer, scheduler, range(0, 1))
    assert store.placement["gpu"] > 0  # after the first step, as always
    streamed.close()


def test_activations_that_vary_between_rollouts_never_push_a_step_past_the_device(tmp_path):
    """The need is the largest seen, not the last: a smaller batch does not make room that
    the next larger one would need."""
    model, optimizer, scheduler, streamed, store, device = _rl(tmp_path)
    step, worst = 0, 0
    swing = max(b.file_size for b in store.buckets) + MARGIN  # enough for another bucket to fit
    for change in (0, -swing, swing, -swing, swing):
        device.grow(change)
        for _ in range(2):
            # What this step's forward/backward runs with, against the device less the margin.
            worst = max(worst, device.activity + store.home_bytes["gpu"] - (device.total - MARGIN))
            train(model, optimizer, scheduler, range(step, step + 1))
            step += 1
        store.offload_device_home()
        store.restore_device_home()
    assert worst <= MARGIN // 8, worst  # the margin stays free at every step, up to the noise threshold
    streamed.close()


def test_room_beyond_the_margin_absorbs_growth_and_a_joining_store_does_not_stop_the_cover(tmp_path):
    model, optimizer, scheduler, streamed = _auto(tmp_path / "a", name="a")
    store = streamed.store
    device = SimulatedDevice(headroom=MARGIN + 3 * store.file_bytes_total)
    device.held = lambda: store.home_bytes["gpu"]
    store.auto_gpu.memory = device
    train(model, optimizer, scheduler, range(0, 1))
    everything = len(store.buckets)
    assert store.placement["gpu"] == everything  # all moved, twice the state still free beyond the margin
    device.grow(2 * store.file_bytes_total)
    train(model, optimizer, scheduler, range(1, 2))
    assert store.placement["gpu"] == everything  # still the margin free: nothing goes back
    joined = _auto(tmp_path / "b", name="b")[3]  # a second optimizer, not stepped yet
    device.grow(store.file_bytes_total)  # now the margin is short: covered although b never stepped
    train(model, optimizer, scheduler, range(2, 3))
    assert store.placement["gpu"] < everything
    joined.close()
    train(model, optimizer, scheduler, range(3, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_a_device_s_stores_share_one_budget_until_the_last_closes(tmp_path):
    first = _auto(tmp_path / "a", name="a")[3]
    second = _auto(tmp_path / "b", name="b", margin=2 * MARGIN)[3]
    assert first.store.auto_gpu is second.store.auto_gpu
    assert first.store.auto_gpu.stores == [first.store, second.store]
    assert first.store.auto_gpu.margin == 2 * MARGIN  # the largest asked for
    first.close()
    assert second.store.auto_gpu.stores == [second.store]
    budget = second.store.auto_gpu
    second.close()
    third = _auto(tmp_path / "c", name="c")[3]
    assert third.store.auto_gpu is not budget  # the last close started it over
    third.close()


def test_on_a_cpu_device_without_allocator_statistics_nothing_moves_and_the_log_says_why(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="miles_plugins.optimizers.homes.auto_budget")
    model, optimizer, scheduler, streamed = _auto(tmp_path)
    train(model, optimizer, scheduler, range(3))
    assert streamed.store.placement["gpu"] == 0 and "device is the CPU" in caplog.text
    streamed.close()


def test_the_host_budget_is_what_memory_and_the_cgroup_leave_less_the_margin_per_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    budget, why = host_budget(8 * GiB, available=100 * GiB, room=None)
    assert budget == (100 - 8) * GiB // 4 and "4 ranks" in why and "no cgroup" in why and "LOCAL_WORLD_SIZE" in why
    budget, why = host_budget(8 * GiB, available=100 * GiB, room=40 * GiB)
    assert budget == (40 - 8) * GiB // 4 and "cgroup's limit" in why
    assert host_budget(8 * GiB, available=4 * GiB, room=None)[0] == 0  # less than the margin: nothing
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    measured, _ = host_budget(0)  # this machine's own numbers
    assert 0 < measured <= memory_probes._meminfo_bytes("MemAvailable") * 2  # it moves while we read


def test_cgroup_room_is_the_tightest_limit_on_the_path_to_the_root(tmp_path):
    root = tmp_path / "cgroup"
    leaf = root / "job" / "rank"
    leaf.mkdir(parents=True)
    for directory, limit, current in ((root / "job", "1000", "300"), (leaf, "max", "200")):
        (directory / "memory.max").write_text(limit)
        (directory / "memory.current").write_text(current)
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/job/rank\n")
    assert cgroup_room(str(proc), str(root)) == 700
    (leaf / "memory.max").write_text("500")
    assert cgroup_room(str(proc), str(root)) == 300
    proc.write_text("12:cpu,cpuacct:/x\n")  # no memory controller anywhere
    assert cgroup_room(str(proc), str(root)) is None
    # cgroup v1's memory controller (Slurm's --mem on many clusters); its "no limit" is a huge number.
    v1 = root / "memory" / "slurm" / "job"
    v1.mkdir(parents=True)
    for directory, limit, usage in ((root / "memory" / "slurm", str(2**63 - 4096), "10"), (v1, "900", "100")):
        (directory / "memory.limit_in_bytes").write_text(limit)
        (directory / "memory.usage_in_bytes").write_text(usage)
    proc.write_text("4:memory:/slurm/job\n0::/\n")
    assert cgroup_room(str(proc), str(root)) == 800


LAUNCHER_VARIABLES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


@pytest.mark.parametrize(
    "env, ranks",
    [
        ({"LOCAL_WORLD_SIZE": "8"}, 8),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "6"}, 6),
        ({"SLURM_NTASKS_PER_NODE": "4(x2)"}, 4),
        ({}, 1),
    ],
)
def test_the_ranks_on_a_node_come_from_the_launcher(monkeypatch, env, ranks):
    for variable in LAUNCHER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    assert memory_probes.local_ranks()[0] == ranks
    assert memory_probes.local_ranks()[1].startswith(next(iter(env), "one process"))


def _local_ranks_in_a_process_group(tmp_path, world: int, env: dict) -> list[list[str]]:
    """[exact count, count and what decided it without the collective] in each rank of a
    real gloo process group of ``world`` processes on this host, launched with ``env``."""
    script = tmp_path / "count.py"
    script.write_text(
        "import sys, torch.distributed as dist\n"
        "from miles_plugins.optimizers.homes import memory_probes\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/init', rank=int(sys.argv[1]), "
        f"world_size={world})\n"
        "exact, quiet = memory_probes.local_ranks(group=True), memory_probes.local_ranks()\n"
        "print(exact[0], quiet[0], quiet[1], sep='|')\n"
        "dist.destroy_process_group()\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env = {**clean, **env, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r)], stdout=subprocess.PIPE, text=True, env=env)
        for r in range(world)
    ]
    outs = [p.communicate(timeout=120)[0].strip().split("|") for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return outs


def test_with_a_process_group_the_ranks_on_this_host_are_counted_not_taken_from_slurm(tmp_path):
    """Ray on Slurm (one ``ray start`` per node) leaves SLURM_NTASKS_PER_NODE=1 in every worker."""
    outs = _local_ranks_in_a_process_group(tmp_path, 3, {"SLURM_NTASKS_PER_NODE": "1"})
    # Exact: the three ranks share this host. Without the collective, not Slurm's 1 either: a rank per GPU
    # (none here: at least 1), never more than the world.
    assert [o[0] for o in outs] == ["3", "3", "3"] and all(o[2].startswith("one rank per GPU") for o in outs)


@pytest.mark.parametrize("variable", ["SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"])
def test_ranks_that_see_one_gpu_each_count_the_launcher_s_ranks_per_node(tmp_path, variable):
    """srun or mpirun, one GPU visible per rank (or none, here) and no LOCAL_WORLD_SIZE:
    without the collective, counting the GPUs this process sees would make every rank
    of the node think it alone, and take the whole node's budget. The launcher's count
    of its ranks on the node decides, as the collective's count says it should."""
    outs = _local_ranks_in_a_process_group(tmp_path, 2, {variable: "2"})
    assert [(exact, quiet) for exact, quiet, _ in outs] == [("2", "2"), ("2", "2")]
    assert all(why == variable for _, _, why in outs), outs


def test_an_auto_host_budget_places_what_it_measured(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="miles_plugins.optimizers.homes.auto_budget")
    monkeypatch.setattr(memory_probes, "cgroup_room", lambda: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    sizer = fresh(tmp_path / "sizes", "s", bucket_cap_elements=CAP, tier="host")[3]
    sizes = [b.file_size for b in sizer.store.buckets]
    sizer.close()
    # Stand-in for /proc/meminfo: room for the last two buckets beyond the margin.
    monkeypatch.setattr(memory_probes, "_meminfo_bytes", lambda field: GiB + sizes[-1] + sizes[-2])
    model, optimizer, scheduler, streamed = fresh(
        tmp_path, "rank0", bucket_cap_elements=CAP, host_budget_bytes="auto", auto_host_margin_bytes=GiB
    )
    assert streamed.store.placement == {"gpu": 0, "host": 2, "disk": len(sizes) - 2}
    assert "auto host budget" in caplog.text
    train(model, optimizer, scheduler, range(STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


@pytest.mark.parametrize(
    "field, value",
    [
        ("gpu_budget_bytes", "Auto"),
        ("host_budget_bytes", "automatic"),
        ("auto_gpu_margin_bytes", "auto"),
        ("auto_host_margin_bytes", -1),
    ],
)
def test_budgets_take_auto_and_margins_take_bytes(field, value):
    with pytest.raises(StreamConfigError, match=field.replace("_", " ")):
        StreamConfig(directory="/unused", **{field: value})
    config = StreamConfig(directory="/unused", gpu_budget_bytes="auto", host_budget_bytes="auto")
    assert config.gpu_budget_bytes is AUTO and config.host_budget_bytes is AUTO  # the word becomes the type
    assert StreamConfig(directory="/unused", gpu_budget_bytes=AUTO).gpu_budget_bytes is AUTO
