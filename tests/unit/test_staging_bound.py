"""Host memory is bounded by the staging chunks and the buckets in flight, not by the state size."""

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer

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
    config = StreamConfig(directory=str(tmp_path), bucket_cap_elements=CAP, staging_chunk_mb=4, engine=engine)
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
    bound = (config.depth + 2) * CAP * 12 + config.staging_bytes_total + 8 * 2**20
    assert state >= 3 * bound
    assert growth <= bound, f"peak RSS grew {growth} bytes for a {state}-byte state (bound {bound})"
