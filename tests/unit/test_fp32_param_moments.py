"""fp32 params are their own mains: their moments stream, in buckets of their own.

The reference is independent: the same fp32 model stepped by a plain ``torch.optim.AdamW``.
"""

import pytest
import torch

from miles_plugins.optimizers import CheckpointMismatchError, StreamConfig, StreamedOptimizer
from tests.unit.reference import same_bytes

STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))


def _train(model, optimizer, steps) -> None:
    g = torch.Generator().manual_seed(11)
    for _ in steps:
        x = torch.randn(16, 64, generator=g)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _reference(steps: int):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, optimizer, range(steps))
    return model, optimizer


def _streamed(tmp_path, **config):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    config = {"directory": str(tmp_path / "scratch"), "bucket_cap_elements": 1000, **config}
    return model, optimizer, StreamedOptimizer(optimizer, StreamConfig(**config))


def _assert_matches_reference(model, streamed, steps: int) -> None:
    ref_model, ref_optimizer = _reference(steps)
    state = {id(p): (main, m, v) for p, main, m, v in streamed.iter_state()}
    for param, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
        main, exp_avg, exp_avg_sq = state[id(param)]
        ref_state = ref_optimizer.state[ref]
        assert same_bytes(param.detach(), ref.detach()) and same_bytes(main, ref.detach())
        assert same_bytes(exp_avg, ref_state["exp_avg"]) and same_bytes(exp_avg_sq, ref_state["exp_avg_sq"])


def test_an_fp32_model_streams_its_moments_and_trains_as_plain_adamw(tmp_path):
    model, optimizer, streamed = _streamed(tmp_path)
    store = streamed.store
    elements = sum(p.numel() for p in model.parameters())
    assert store.buckets and not any(b.streams_main for b in store.buckets)
    assert sum(b.numel for b in store.buckets) == elements and store._resident_entries == []
    _train(model, optimizer, range(STEPS))
    # 8 of the 12 bytes per param stream (the moments); the params stay in the model.
    assert store.last_step.bytes_read == store.last_step.bytes_written == 8 * elements
    assert all(p.untyped_storage().nbytes() == 4 * p.numel() for p in model.parameters())
    _assert_matches_reference(model, streamed, STEPS)
    streamed.close()


def test_resident_keeps_them_beside_the_params_as_before(tmp_path):
    model, optimizer, streamed = _streamed(tmp_path, fp32_param_moments="resident")
    assert streamed.store.buckets == [] and len(streamed.store._resident_entries) == 4
    _train(model, optimizer, range(STEPS))
    _assert_matches_reference(model, streamed, STEPS)
    streamed.close()


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_a_checkpoint_of_streamed_fp32_moments_resumes_byte_identical(tmp_path, tier):
    model, optimizer, streamed = _streamed(tmp_path, tier=tier)
    _train(model, optimizer, range(3))
    streamed.save_to(str(tmp_path / "ckpt"))
    saved_params = [p.detach().clone() for p in model.parameters()]
    streamed.close()
    model, optimizer, streamed = _streamed(tmp_path, tier=tier)
    with torch.no_grad():
        for param, saved in zip(model.parameters(), saved_params, strict=True):
            param.copy_(saved)  # the model's own checkpoint brings the params back
    assert streamed.load_from(str(tmp_path / "ckpt"))
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        torch.randn(16, 64, generator=g)  # the batches the first three steps used
    for _ in range(3, STEPS):
        model(torch.randn(16, 64, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    _assert_matches_reference(model, streamed, STEPS)
    streamed.close()


def test_a_save_with_the_other_setting_is_refused_saying_which(tmp_path):
    model, optimizer, streamed = _streamed(tmp_path, fp32_param_moments="resident")
    _train(model, optimizer, range(2))
    streamed.save_to(str(tmp_path / "ckpt"))
    streamed.close()
    _, _, streamed = _streamed(tmp_path)
    with pytest.raises(CheckpointMismatchError, match="moments were saved resident, this run keeps them streamed"):
        streamed.load_from(str(tmp_path / "ckpt"))
    streamed.close()


def test_a_bad_setting_is_refused(tmp_path):
    from miles_plugins.optimizers.errors import StreamConfigError

    with pytest.raises(StreamConfigError, match="unknown fp32 param moments 'offloaded'; choose one of streamed"):
        StreamConfig(directory=str(tmp_path), fp32_param_moments="offloaded")


def test_a_step_leaves_the_fp32_params_grads_to_the_caller(tmp_path):
    """Plain AdamW leaves grads as they are until zero_grad; so does the streamed step
    for fp32 params, whose main (and so whose grad) is the model's param."""
    model, optimizer, streamed = _streamed(tmp_path)
    model(torch.randn(4, 64)).square().mean().backward()
    grads = [p.grad for p in model.parameters()]
    optimizer.step()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    streamed.close()
