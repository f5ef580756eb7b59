"""Compact moment storage: bf16 stays close to the fp32 run; the unscaled narrow
formats earlier versions offered are refused, in a setting and in a checkpoint."""

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamConfigError
from tests.unit.test_bit_identity import streamed_run

STEPS = 20
# The stated tolerance for bf16 moments: bf16 keeps 8 mantissa bits, so each
# stored moment rounds at ~0.4% relative; after 20 steps at lr 1e-2 the fp32
# mains stay within 5e-3 (absolute) of the run with fp32 moments.
BF16_MAIN_TOLERANCE = 5e-3


def test_bf16_moments_stay_within_tolerance_of_fp32_moments(tmp_path):
    _, state, streamed = streamed_run(
        torch.optim.AdamW, torch.bfloat16, STEPS, tmp_path / "bf16", fp32_extra=False, moment_dtype="bf16"
    )
    _, exact_state, exact = streamed_run(torch.optim.AdamW, torch.bfloat16, STEPS, tmp_path / "fp32", fp32_extra=False)
    errors = [
        (main - exact_main).abs().max().item()
        for (main, _, _), (exact_main, _, _) in zip(state, exact_state, strict=True)
    ]
    assert max(errors) <= BF16_MAIN_TOLERANCE, f"bf16 moments drifted {max(errors)} from the fp32-moment run"
    assert max(errors) > 0, "bf16 moments changed nothing: were they really stored as bf16?"
    streamed.close()
    exact.close()


@pytest.mark.parametrize("moment_dtype", ["fp16", "fp8e4m3", "fp8e5m2"])
def test_unscaled_narrow_moment_dtypes_are_refused_saying_why(tmp_path, moment_dtype):
    with pytest.raises(StreamConfigError, match=f"{moment_dtype!r} is no longer offered: unscaled, .* diverges"):
        StreamConfig(directory=str(tmp_path), moment_dtype=moment_dtype)
