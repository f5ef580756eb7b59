"""Host memory is bounded by the staging buffer and one bucket, not by the state size."""

import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer

CAP = 1 << 20  # elements per bucket: 12 MiB materialized


def _peak_rss_growth_during_steps(tmp_path, layers: int) -> tuple[int, int]:
    """Peak RSS growth (bytes) over two streamed steps, and the state size."""
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers))).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())
    config = StreamConfig(directory=str(tmp_path / f"l{layers}"), bucket_cap_elements=CAP, staging_chunk_mb=4)
    with StreamedOptimizer(optimizer, config) as streamed:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()  # first step: allocator warm-up, moments created
        baseline = _rss()
        _reset_peak_rss()
        optimizer.step()
        optimizer.step()
        return _peak_rss() - baseline, streamed.store.state_bytes_total


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rss() -> int:
    return _status("VmRSS")


def _peak_rss() -> int:
    return _status("VmHWM")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def test_host_memory_does_not_grow_with_state_size(tmp_path):
    small_growth, small_state = _peak_rss_growth_during_steps(tmp_path, layers=4)
    large_growth, large_state = _peak_rss_growth_during_steps(tmp_path, layers=32)
    assert large_state == 8 * small_state
    bucket_bytes = CAP * 12
    # One bucket, its fp32 grads, the staging buffer, allocator slack: a few buckets' worth.
    bound = 3 * bucket_bytes + 4 * 2**20
    assert large_growth <= bound, f"peak grew {large_growth} bytes for a {large_state}-byte state"
    assert large_growth <= small_growth + bucket_bytes, (small_growth, large_growth)
