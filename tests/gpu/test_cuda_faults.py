"""GPU tier for a failed step: a disk write that fails during a step on CUDA
(the pipelined engine's copies on their own streams; buckets at home in host or
device memory updated in place, after every disk write has drained) leaves the
mains, moments and params as they were before the step. The step then runs
again, and the run ends byte-identical to an uninterrupted resident CUDA run
(the CPU tier's ``test_faults.py`` and ``test_placement.py`` do this on the CPU)."""

import logging
import re

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer, StreamIOError
from tests.faults import FaultPlan
from tests.helpers import all_three_homes
from tests.unit.reference import Net, assert_same_training, between_steps, groups, loss_fn, reference_run, schedule

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("deterministic_cuda")]

DEVICE = "cuda"
STEPS, FAILED_STEP = 8, 5


def _state(model, streamed):
    by_param = {id(p): (main, m, v) for p, main, m, v in streamed.iter_state()}
    return [p.detach().cpu().clone() for p in model.parameters()], [by_param[id(p)] for p in model.parameters()]


def _step(model, optimizer, scheduler, step) -> None:
    loss_fn(model, step).backward()
    optimizer.step()
    optimizer.zero_grad()
    between_steps(optimizer, scheduler, step)


@pytest.mark.parametrize("engine", ["pipelined", "sync"])
@pytest.mark.parametrize("homes", ["disk", "gpu_host_disk"])
def test_a_disk_write_failing_during_a_step_on_cuda_loses_only_that_step(tmp_path, caplog, homes, engine):
    scratch = tmp_path / "scratch"
    config = {"bucket_cap_elements": 1500}
    if homes == "gpu_host_disk":
        # More buckets in flight than there are disk buckets: only the drain before the
        # first in-memory update keeps their writes ahead of it (with 3, reading ahead does).
        config = {**all_three_homes(), "buckets_in_flight": 8}
    model = Net(torch.bfloat16).to(DEVICE)
    optimizer = torch.optim.AdamW(groups(model))
    streamed = StreamedOptimizer(optimizer, StreamConfig(directory=str(scratch), engine=engine, **config))
    scheduler = schedule(optimizer)  # after wrapping, so it wraps the streamed step
    if homes == "gpu_host_disk":
        assert all(streamed.store.placement.values()), streamed.store.placement
    for step in range(FAILED_STEP):
        if step == FAILED_STEP - 1:
            with FaultPlan(scratch, "write", nth=10**9, fault="eio") as counting:  # counts a step's disk writes
                _step(model, optimizer, scheduler, step)
        else:
            _step(model, optimizer, scheduler, step)

    loss_fn(model, FAILED_STEP).backward()
    before = _state(model, streamed)
    # With in-memory homes, the step's last disk write: every disk bucket was updated, the
    # in-memory ones not yet. All on disk, one half way (the last bucket holds the fp32-native
    # params, updated in place: a failure after it cannot be rolled back, test_faults.py).
    nth = counting.calls if homes == "gpu_host_disk" else counting.calls // 2
    with FaultPlan(scratch, "write", nth=nth, fault="eio") as plan, caplog.at_level(logging.WARNING):
        with pytest.raises(StreamIOError, match="Input/output error"):
            optimizer.step()
    assert plan.fired == 1
    rolled_back = re.search(r"the params of the (\d+) buckets it had updated are back at step", caplog.text)
    assert rolled_back, "the step must have updated buckets and rolled them back"
    if homes == "gpu_host_disk":
        assert int(rolled_back.group(1)) == streamed.store.placement["disk"]
    assert_same_training(before, _state(model, streamed))

    optimizer.step()  # the failed step again
    optimizer.zero_grad()
    between_steps(optimizer, scheduler, FAILED_STEP)
    for step in range(FAILED_STEP + 1, STEPS):
        _step(model, optimizer, scheduler, step)
    assert_same_training(
        reference_run(torch.optim.AdamW, torch.bfloat16, STEPS, device=DEVICE), _state(model, streamed)
    )
    streamed.close()
