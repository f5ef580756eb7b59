"""Streamed (fp32 storage) vs an independent resident run: byte-equal after 20+ steps."""

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
from tests.helpers import STEPS, streamed_run
from tests.unit.reference import (
    Net,
    assert_same_training,
    groups,
    loss_fn,
    reference_run,
    same_bytes,
)


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW], ids=["Adam", "AdamW"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_streamed_state_is_byte_identical_to_resident(tmp_path, opt_cls, dtype):
    ref_params, ref_state = reference_run(opt_cls, dtype, STEPS)
    params, state, streamed = streamed_run(opt_cls, dtype, STEPS, tmp_path)
    if dtype != torch.float32:
        assert len(streamed.store.buckets) >= 3, "the test must exercise several buckets"
    assert_same_training((ref_params, ref_state), (params, state))
    streamed.close()


# Every way of storing and moving the state: (tier, engine, main storage).
MODES = [
    ("disk", "pipelined", "fp32"),
    ("disk", "pipelined", "remainder"),
    ("disk", "sync", "fp32"),
    ("disk", "sync", "remainder"),
    ("host", "pipelined", "fp32"),
    ("host", "pipelined", "remainder"),
    ("host", "sync", "fp32"),
]


@pytest.mark.parametrize("tier, engine, main_storage", MODES, ids=["-".join(m) for m in MODES])
def test_every_tier_engine_and_main_storage_is_byte_identical_to_resident(tmp_path, tier, engine, main_storage):
    ref_params, ref_state = reference_run(torch.optim.AdamW, torch.bfloat16, STEPS)
    params, state, streamed = streamed_run(
        torch.optim.AdamW, torch.bfloat16, STEPS, tmp_path, tier=tier, engine=engine, main_storage=main_storage
    )
    assert_same_training((ref_params, ref_state), (params, state))
    main_bytes = {"fp32": 4, "remainder": 2}[main_storage]
    elements = sum(b.numel for b in streamed.store.buckets if b.streams_main)
    fp32_param_elements = sum(b.numel for b in streamed.store.buckets if not b.streams_main)  # moments only
    assert fp32_param_elements == 16  # the Net's fp32 scale: its moments stream too
    first_step_reads = main_bytes * elements  # mains only: the moments do not exist yet
    later_reads = (main_bytes + 8) * elements + 8 * fp32_param_elements
    assert streamed.store.total.bytes_read == first_step_reads + (STEPS - 1) * later_reads
    streamed.close()


def test_lr_schedule_and_weight_decay_changes_reach_every_bucket(tmp_path):
    """Without the mid-run changes (LR drop, weight-decay change) every bucket ends
    elsewhere: the options reach each bucket's optimizer. (The byte-identity
    tests above prove they arrive with the right values.)"""
    _, _, scheduled = streamed_run(torch.optim.AdamW, torch.bfloat16, STEPS, tmp_path / "scheduled")
    scheduled_mains = {i: main for i, main, _, _ in scheduled.store.iter_state()}
    model = Net(torch.bfloat16)
    optimizer = torch.optim.AdamW(groups(model))
    config = StreamConfig(directory=str(tmp_path / "frozen"), bucket_cap_elements=1500)
    with StreamedOptimizer(optimizer, config) as frozen:
        for step in range(STEPS):
            loss_fn(model, step).backward()
            optimizer.step()
            optimizer.zero_grad()
        frozen_mains = {i: main for i, main, _, _ in frozen.store.iter_state()}
        assert [b.entry_indices for b in frozen.store.buckets] == [b.entry_indices for b in scheduled.store.buckets]
        for bucket in frozen.store.buckets:
            differs = [not torch.equal(scheduled_mains[i], frozen_mains[i]) for i in bucket.entry_indices]
            assert all(differs), f"bucket {bucket.index}: an entry the schedule changes did not move"
    scheduled.close()


def test_params_without_grad_are_skipped_like_torch(tmp_path):
    """A param with no grad in a step is not updated and its step count does not advance."""
    torch.manual_seed(0)
    frozen_every_other = torch.nn.Linear(8, 8).to(torch.bfloat16)
    always = torch.nn.Linear(8, 8).to(torch.bfloat16)
    ref_a = torch.nn.Linear(8, 8).to(torch.bfloat16)
    ref_b = torch.nn.Linear(8, 8).to(torch.bfloat16)
    ref_a.load_state_dict(frozen_every_other.state_dict())
    ref_b.load_state_dict(always.state_dict())
    params = [*frozen_every_other.parameters(), *always.parameters()]
    ref_params = [*ref_a.parameters(), *ref_b.parameters()]
    mains = [p.detach().float().clone() for p in ref_params]
    ref_opt = torch.optim.AdamW(mains, lr=1e-2)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    with StreamedOptimizer(optimizer, StreamConfig(directory=str(tmp_path), bucket_cap_elements=100)):
        for step in range(6):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            for net_a, net_b, ps, opt, ms in (
                (frozen_every_other, always, params, optimizer, None),
                (ref_a, ref_b, ref_params, ref_opt, mains),
            ):
                out = net_b(x) if step % 2 else net_b(net_a(x))
                out.float().sum().backward()
                if ms is not None:
                    for p, m in zip(ps, ms, strict=True):
                        m.grad = None if p.grad is None else p.grad.float()
                opt.step()
                if ms is not None:
                    with torch.no_grad():
                        for p, m in zip(ps, ms, strict=True):
                            p.copy_(m)
                for p in ps:
                    p.grad = None
        for a, b in zip(params, ref_params, strict=True):
            assert same_bytes(a.detach(), b.detach())
