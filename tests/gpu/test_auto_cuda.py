"""GPU tier for the auto GPU budget: the CUDA allocator's own statistics size the ``gpu``
home after the first step, and a forward/backward peak that grows gives buckets back.

The growing peak is a ballast tensor allocated and freed between steps, as activations
are; the process is capped with ``set_per_process_memory_fraction`` so the device is
"full" at a known point. Training is judged against the independent resident reference.
"""

import os

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
from tests.unit.reference import (
    Net,
    assert_same_training,
    between_steps,
    groups,
    loss_fn,
    reference_run,
    schedule,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS, GROW_AT = 12, 6
MiB = 1 << 20


@pytest.fixture(autouse=True)
def deterministic_and_uncapped():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)
    torch.cuda.set_per_process_memory_fraction(1.0)


def test_the_allocator_sizes_the_gpu_home_and_a_growing_peak_gets_buckets_back_without_oom(tmp_path):
    ref = reference_run(torch.optim.AdamW, torch.bfloat16, STEPS, device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = Net(torch.bfloat16).cuda()
    optimizer = torch.optim.AdamW(groups(model))
    margin = 64 * MiB
    config = StreamConfig(
        directory=str(tmp_path), bucket_cap_elements=500, gpu_budget_bytes="auto", auto_gpu_margin_bytes=margin
    )
    streamed = StreamedOptimizer(optimizer, config)
    scheduler = schedule(optimizer)
    store = streamed.store
    # Cap the process where its peak (with a 256 MiB "activation" ballast), the margin and room
    # for the whole stored state meet: the first step's headroom then holds every bucket.
    ballast = 256 * MiB
    total = torch.cuda.mem_get_info()[1]
    cap = torch.cuda.max_memory_reserved() + ballast + margin + 2 * store.file_bytes_total + 64 * MiB
    torch.cuda.set_per_process_memory_fraction(cap / total)
    placements = []
    for step in range(STEPS):
        if step == GROW_AT:
            ballast += margin // 2  # a larger batch: the peak grows by half the margin
        activations = torch.empty(ballast, dtype=torch.uint8, device="cuda")
        loss_fn(model, step).backward()
        del activations
        optimizer.step()
        optimizer.zero_grad()
        between_steps(optimizer, scheduler, step)
        placements.append(store.placement["gpu"])
    assert placements[0] == len(store.buckets), placements  # after the first step: all fit
    assert placements[GROW_AT] < placements[GROW_AT - 1], placements  # given back after the growth
    assert placements[-1] == placements[GROW_AT], placements  # a steady peak moves nothing more
    by_param = {id(p): (main, m, v) for p, main, m, v in streamed.iter_state()}
    state = [by_param[id(p)] for p in model.parameters()]
    assert_same_training(ref, ([p.detach().cpu().clone() for p in model.parameters()], state))
    streamed.close()
