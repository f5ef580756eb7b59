"""``"auto"`` budgets: the host's measured at setup, the GPU's after the first step.

Training is judged against the independent resident reference
(``reference.reference_run``). This machine has no GPU: the ``gpu`` home is the
CPU's memory, and the CUDA allocator's statistics that size it are stood in for
by :class:`SimulatedDevice` (headroom and peak as the test sets them); the moves
themselves, the stores, the files and the optimizers are the real ones.
"""

import logging

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, auto_budget
from miles_plugins.optimizers.auto_budget import cgroup_room, host_budget
from miles_plugins.optimizers.errors import StreamConfigError, StreamIOError
from miles_plugins.optimizers.io import DeviceBacking
from tests.unit.reference import assert_same_training, reference_run
from tests.unit.test_checkpoint import SAVE_AT, STEPS, fresh, resume, state_of, train

CAP = 500  # elements per bucket: six buckets of the test model
GiB = 1 << 30


class SimulatedDevice:
    """What ``CudaMemory`` reads from the CUDA allocator: a device whose largest use so
    far (monotonic, as ``max_memory_reserved``) is the forward/backward activity plus
    what ``held()`` says the gpu home keeps there."""

    def __init__(self, headroom: int, activity: int = 10 * GiB) -> None:
        self.total, self.activity = activity + headroom, activity
        self.held = lambda: 0
        self._peak = activity

    def peak(self) -> int:
        self._peak = max(self._peak, self.activity + self.held())
        return self._peak

    def headroom(self) -> int:
        return self.total - self.peak()

    def grow(self, nbytes: int) -> None:
        """The forward/backward peak grew (a larger batch)."""
        self.activity += nbytes


def _auto(tmp_path, name="rank0", margin=GiB, **config):
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
    device = SimulatedDevice(headroom=GiB + sizes[-1] + sizes[-2] + sizes[-3] // 2)
    device.held = lambda: store.home_bytes["gpu"]
    store.auto_gpu.memory = device
    assert store.placement["gpu"] == 0  # nobody knows the forward/backward peak before a step
    caplog.set_level(logging.INFO, logger="miles_plugins.optimizers.auto_budget")
    train(model, optimizer, scheduler, range(0, 1))
    assert _gpu_run(store) == [len(sizes) - 2, len(sizes) - 1]  # what the headroom beyond the margin holds
    assert "2 buckets" in caplog.text and "now stay on the device" in caplog.text
    assert store._pipeline.drain_before <= min(_gpu_run(store))  # disk writes drain before in-place updates
    train(model, optimizer, scheduler, range(1, 5))
    assert len(_gpu_run(store)) == 2  # a steady peak moves nothing
    device.grow(sizes[-2] // 2)  # a larger batch: half a bucket more at the peak
    train(model, optimizer, scheduler, range(5, 6))
    assert _gpu_run(store) == [len(sizes) - 1] and "grew by" in caplog.text
    expected_home = "disk" if tier == "disk" else "host"
    assert store.placed.homes[len(sizes) - 2] == expected_home
    train(model, optimizer, scheduler, range(6, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_growth_beyond_what_the_device_holds_gives_back_everything_and_says_so(tmp_path, caplog):
    model, optimizer, scheduler, streamed = _auto(tmp_path)
    store = streamed.store
    device = SimulatedDevice(headroom=GiB + 3 * max(b.file_size for b in store.buckets))
    device.held = lambda: store.home_bytes["gpu"]
    store.auto_gpu.memory = device
    train(model, optimizer, scheduler, range(0, 2))
    assert len(_gpu_run(store)) >= 3
    device.grow(1 << 40)
    train(model, optimizer, scheduler, range(2, STEPS))
    assert store.placement["gpu"] == 0 and "all there were" in caplog.text
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_device_memory_that_cannot_be_had_stops_the_moves_and_training_goes_on(tmp_path, caplog, monkeypatch):
    model, optimizer, scheduler, streamed = _auto(tmp_path)
    store = streamed.store
    store.auto_gpu.memory = SimulatedDevice(headroom=1 << 40)  # room for all: the allocator says otherwise
    add, calls = DeviceBacking.add, []

    def add_twice(self, bucket):
        calls.append(bucket.index)
        if len(calls) > 2:
            raise StreamIOError("out of memory (injected)", "<device>", 0, 12)
        return add(self, bucket)

    monkeypatch.setattr(DeviceBacking, "add", add_twice)
    train(model, optimizer, scheduler, range(STEPS))
    assert len(_gpu_run(store)) == 2 and "stays where it is" in caplog.text
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


def test_on_a_cpu_device_without_allocator_statistics_nothing_moves_and_the_log_says_why(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="miles_plugins.optimizers.auto_budget")
    model, optimizer, scheduler, streamed = _auto(tmp_path)
    train(model, optimizer, scheduler, range(3))
    assert streamed.store.placement["gpu"] == 0 and "device is the CPU" in caplog.text
    streamed.close()


def test_the_host_budget_is_what_memory_and_the_cgroup_leave_less_the_margin_per_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    budget, why = host_budget(8 * GiB, available=100 * GiB, room=None)
    assert budget == (100 - 8) * GiB // 4 and "4 ranks" in why and "no cgroup" in why
    budget, why = host_budget(8 * GiB, available=100 * GiB, room=40 * GiB)
    assert budget == (40 - 8) * GiB // 4 and "memory.max" in why
    assert host_budget(8 * GiB, available=4 * GiB, room=None)[0] == 0  # less than the margin: nothing
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    measured, _ = host_budget(0)  # this machine's own numbers
    assert 0 < measured <= auto_budget._meminfo_bytes("MemAvailable") * 2  # it moves while we read


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
    proc.write_text("12:memory:/v1-only\n")
    assert cgroup_room(str(proc), str(root)) is None


def test_an_auto_host_budget_places_what_it_measured(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="miles_plugins.optimizers.auto_budget")
    monkeypatch.setattr(auto_budget, "cgroup_room", lambda: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    sizer = fresh(tmp_path / "sizes", "s", bucket_cap_elements=CAP, tier="host")[3]
    sizes = [b.file_size for b in sizer.store.buckets]
    sizer.close()
    # Stand-in for /proc/meminfo: room for the last two buckets beyond the margin.
    monkeypatch.setattr(auto_budget, "_meminfo_bytes", lambda field: GiB + sizes[-1] + sizes[-2])
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
    assert StreamConfig(directory="/unused", gpu_budget_bytes="auto", host_budget_bytes="auto")
