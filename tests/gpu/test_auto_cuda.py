"""GPU tier for the auto GPU budget: the CUDA allocator's own numbers size the ``gpu``
home after the first step, and a peak that grows later gets buckets back.

A bf16 MLP of six 2048x2048 layers, one bucket each (50 MB stored). The process is
capped with ``set_per_process_memory_fraction`` where about three buckets fit beyond
the margin; from step GROW_AT on, the process keeps three buckets more allocated (a
larger batch's buffers, a cache), so the margin at the peak falls short and buckets go
back. A bucket in the home shares its bytes with the step, so where the step sets
the peak (it does here: the activations are small) one given back is materialized
in flight at the next step instead, and more follow over the next steps. Judged
against an independent resident run of the same model and batches.
"""

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
from tests.unit.reference import same_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("deterministic_cuda"),
]

WIDTH, LAYERS, STEPS, GROW_AT = 2048, 6, 12, 5
DEPTH = 3  # buckets in flight (the default)
MARGIN = 256 << 20


@pytest.fixture(autouse=True)
def uncapped():
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]
    return torch.nn.Sequential(*layers).to(device="cuda", dtype=torch.bfloat16)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randn(64, WIDTH, device="cuda", dtype=torch.bfloat16, generator=g)
    return model(x).float().pow(2).mean()


def _resident() -> list[torch.Tensor]:
    """The reference: fp32 mains and AdamW resident, params copied back after each step."""
    model = _model()
    mains = [p.detach().float().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(mains, lr=1e-3)
    for step in range(STEPS):
        _loss(model, step).backward()
        for p, main in zip(model.parameters(), mains, strict=True):
            main.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for p, main in zip(model.parameters(), mains, strict=True):
                p.copy_(main)
        model.zero_grad(set_to_none=True)
    return [p.detach().cpu().clone() for p in model.parameters()]


def test_the_allocator_sizes_the_gpu_home_and_a_larger_batch_gets_buckets_back(tmp_path):
    want = _resident()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = StreamConfig(
        directory=str(tmp_path),
        bucket_cap_elements=WIDTH * WIDTH,
        gpu_budget_bytes="auto",
        auto_gpu_margin_bytes=MARGIN,
        buckets_in_flight=DEPTH,
    )
    streamed = StreamedOptimizer(optimizer, config)
    store = streamed.store
    bucket = store.buckets[0].file_size
    assert len(store.buckets) == LAYERS and all(b.file_size == bucket for b in store.buckets)
    # Cap the process where about three buckets fit beyond the margin: what a forward/backward
    # peaks at (measured: one untimed pass, grads dropped), plus what a step adds, plus 3.5 buckets.
    _loss(model, 0).backward()
    model.zero_grad(set_to_none=True)
    expected_use = torch.cuda.max_memory_reserved() + store.step_device_bytes_bound
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction((expected_use + MARGIN + 3.5 * bucket) / total)
    placements, grown = [], None
    for step in range(STEPS):
        if step == GROW_AT:
            grown = torch.empty(3 * bucket, dtype=torch.uint8, device="cuda")  # kept to the end
        _loss(model, step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        placements.append(store.placement["gpu"])
        if step == 0:
            # What the fill saw free at the peak (the cap less the allocator's peak) gives the
            # count: less the margin, in whole buckets.
            free_at_fill = store.auto_gpu.free_at_last_fill
            fits = min(LAYERS, max(0, free_at_fill - MARGIN) // bucket)
    assert placements[0] == fits and 1 <= fits < LAYERS, (placements, fits, free_at_fill)
    # Three buckets of growth less what the step no longer has in flight (one bucket: the home's
    # share their bytes) less what the fill left beyond the margin (under a bucket) is more than an
    # eighth of the margin: buckets go back, two or more in all (each given back streams through
    # the device at the next step), within as many steps as buckets fit in flight; then nothing
    # moves, and no allocation failed.
    settled = placements[-1]
    assert placements[GROW_AT] < fits and settled <= fits - 2, placements
    assert all(p == settled for p in placements[GROW_AT + DEPTH :]), placements
    del grown
    got = [p.detach().cpu() for p in model.parameters()]
    assert all(same_bytes(a, b) for a, b in zip(want, got, strict=True))
    streamed.close()
