"""GPU tier for the FusedAdam backends (Transformer Engine, apex): streamed vs resident, bit for bit.

``megatron.core.optimizer.Adam`` is one of these when installed. Each case runs
the same mixed-precision training as ``tests/unit/test_bit_identity.py`` with
the fused class as the master optimizer (per-group step counter, ``adam_w_mode``
as a constructor argument) and compares params, mains and moments byte for byte
against a resident run of the same class. Skips for a class that is not importable.
"""

import functools
import importlib

import pytest

from tests.helpers import STEPS, streamed_run
from tests.unit.reference import assert_same_training, reference_run, same_bytes

pytestmark = pytest.mark.gpu

FUSED = {"apex": "apex.optimizers", "te": "transformer_engine.pytorch.optimizers"}


def fused_adam(source: str):
    try:
        return importlib.import_module(FUSED[source]).FusedAdam
    except ImportError as e:
        pytest.skip(f"{FUSED[source]}.FusedAdam is not importable here: {e}")


@pytest.mark.parametrize("source", list(FUSED))
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam"])
def test_fused_adam_streamed_state_is_byte_identical_to_resident(tmp_path, source, adam_w_mode):
    import torch

    opt_cls = functools.partial(fused_adam(source), adam_w_mode=adam_w_mode)
    control_params, _ = reference_run(opt_cls, torch.bfloat16, STEPS, device="cuda")
    ref_params, ref_state = reference_run(opt_cls, torch.bfloat16, STEPS, device="cuda")
    assert all(same_bytes(a, b) for a, b in zip(control_params, ref_params, strict=True)), "control run differs"
    params, state, streamed = streamed_run(opt_cls, torch.bfloat16, STEPS, tmp_path, device="cuda")
    assert type(streamed.store._bucket_optimizers[0].optimizer).__name__ == "FusedAdam"
    assert streamed.store._bucket_optimizers[0].optimizer.adam_w_mode == int(adam_w_mode)
    assert_same_training((ref_params, ref_state), (params, state))
    streamed.close()
