"""The Megatron binding's construction guards and entry point, on the CPU.

A real ``DistributedOptimizer`` cannot be constructed here: its ``__init__``
needs CUDA tensors and process groups (the GPU tier builds real ones, see
``tests/gpu/harness/megatron_tier.py``). These tests use the real megatron-core classes
and configs, building optimizer objects with ``__new__`` and setting only the
attributes the guards read; that is enough to prove what is refused, what is
accepted, and that a refusal leaves every optimizer untouched.
"""

import argparse
import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig  # noqa: E402
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params  # noqa: E402

from megatron_hooks.contract import STORE_ATTR  # noqa: E402
from miles_plugins.optimizers import StreamConfig, StreamConfigError  # noqa: E402
from miles_plugins.optimizers.megatron.args import add_arguments, config_from_args  # noqa: E402
from miles_plugins.optimizers.megatron.binding import attach  # noqa: E402
from miles_plugins.optimizers.megatron.chain import chained_distributed_optimizers, check_supported  # noqa: E402
from miles_plugins.optimizers.nvme_stream import setup_optimizer_state_streaming  # noqa: E402


def distributed_optimizer(config=None, ddp_config=None, master=None, stub=False):
    """A real DistributedOptimizer object without its CUDA-only __init__ (see module docstring)."""
    opt = DistributedOptimizer.__new__(DistributedOptimizer)
    opt.config = config or OptimizerConfig(optimizer="adam", bf16=True, use_distributed_optimizer=True)
    opt.ddp_config = ddp_config or DistributedDataParallelConfig(use_distributed_optimizer=True)
    opt.optimizer = master if master is not None else torch.optim.AdamW([torch.zeros(4)], lr=1e-3)
    opt.is_stub_optimizer = stub
    return opt


def with_field(obj, **fields):
    """A copy of a config dataclass with fields set after __post_init__ (some exist only on
    some Megatron commits; getattr-based guards must see them when they are there)."""
    copy = dataclasses.replace(obj)
    for name, value in fields.items():
        object.__setattr__(copy, name, value)
    return copy


BASE_CONFIG = OptimizerConfig(optimizer="adam", bf16=True, use_distributed_optimizer=True)
BASE_DDP = DistributedDataParallelConfig(use_distributed_optimizer=True)

REFUSED = {
    "precision-aware optimizer": (
        dict(config=with_field(BASE_CONFIG, use_precision_aware_optimizer=True)),
        "use_precision_aware_optimizer",
    ),
    "cpu optimizer offload": (
        dict(config=with_field(BASE_CONFIG, optimizer_cpu_offload=True)),
        "optimizer_cpu_offload",
    ),
    "optimizer state offload (newer commits)": (
        dict(config=with_field(BASE_CONFIG, offload_optimizer_states=True)),
        "offload_optimizer_states",
    ),
    "chunked state offload (newer commits)": (
        dict(ddp_config=with_field(BASE_DDP, chunked_optimizer_state_offload=True)),
        "chunked_optimizer_state_offload",
    ),
    "megatron fsdp": (dict(ddp_config=with_field(BASE_DDP, use_megatron_fsdp=True)), "Megatron FSDP"),
    "fp8 params": (dict(ddp_config=with_field(BASE_DDP, fp8_param_gather=True)), "fp8/fp4 params"),
    "mxfp8 param all-gather reuse": (
        dict(config=with_field(BASE_CONFIG, reuse_grad_buf_for_mxfp8_param_ag=True)),
        "reuse_grad_buf_for_mxfp8_param_ag",
    ),
    "sgd": (dict(config=with_field(BASE_CONFIG, optimizer="sgd")), "'sgd'"),
    "single-moment optimizer with init_state_fn": (dict(config=with_field(BASE_CONFIG, optimizer="lion")), "'lion'"),
    "non-Adam inner optimizer": (dict(master=torch.optim.SGD([torch.zeros(4)], lr=0.1)), "torch.optim.sgd.SGD"),
    "amsgrad": (dict(master=torch.optim.AdamW([torch.zeros(4)], amsgrad=True)), "amsgrad"),
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_unsupported_optimizer_is_refused_with_its_reason(case):
    kwargs, reason = REFUSED[case]
    with pytest.raises(StreamConfigError, match="cannot stream") as info:
        check_supported(distributed_optimizer(**kwargs))
    assert reason in str(info.value)


def test_all_reasons_are_reported_at_once():
    opt = distributed_optimizer(
        config=with_field(BASE_CONFIG, use_precision_aware_optimizer=True, optimizer_cpu_offload=True),
        ddp_config=with_field(BASE_DDP, use_megatron_fsdp=True),
    )
    with pytest.raises(StreamConfigError) as info:
        check_supported(opt)
    for reason in ("use_precision_aware_optimizer", "optimizer_cpu_offload", "Megatron FSDP"):
        assert reason in str(info.value)


def test_optimizer_that_already_stepped_is_refused():
    param = torch.nn.Parameter(torch.ones(4))
    master = torch.optim.AdamW([param], lr=1e-3)
    param.grad = torch.ones(4)
    master.step()
    with pytest.raises(StreamConfigError, match="already holds state"):
        check_supported(distributed_optimizer(master=master))


@pytest.mark.parametrize("master_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_plain_adam_distributed_optimizer_is_accepted(master_cls):
    check_supported(distributed_optimizer(master=master_cls([torch.zeros(4)], lr=1e-3)))


def test_chain_walk_skips_stubs_and_refuses_other_optimizer_types():
    dense, stub = distributed_optimizer(), distributed_optimizer(stub=True)
    assert chained_distributed_optimizers(ChainedOptimizer([dense, stub])) == [(0, dense)]
    float16 = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
    float16.config, float16.is_stub_optimizer = BASE_CONFIG, False
    with pytest.raises(StreamConfigError, match="Float16OptimizerWithFloat16Params") as info:
        chained_distributed_optimizers(ChainedOptimizer([dense, float16]))
    assert "use_distributed_optimizer=True" in str(info.value)


def test_refusal_of_one_chained_optimizer_leaves_every_optimizer_unbound(tmp_path):
    good = distributed_optimizer()
    bad = distributed_optimizer(master=torch.optim.SGD([torch.zeros(4)], lr=0.1))
    chain = ChainedOptimizer([good, bad])
    with pytest.raises(StreamConfigError, match="SGD"):
        attach(chain, StreamConfig(directory=str(tmp_path)))
    for member in (good, bad):
        assert not hasattr(member, STORE_ATTR)
        assert "step_with_ready_grads" not in vars(member) and "state_dict" not in vars(member)
    assert list(tmp_path.iterdir()) == []


def test_an_unpatched_megatron_is_refused_before_anything_is_bound(tmp_path):
    """megatron-core 0.16.1 (this venv) has no megatron/training: no checkpoint hooks."""
    from megatron_hooks.checkpoint import HooksNotInstalledError

    opt = distributed_optimizer()
    with pytest.raises(HooksNotInstalledError, match="apply the patch series"):
        attach(opt, StreamConfig(directory=str(tmp_path)))
    assert not hasattr(opt, STORE_ATTR) and "step_with_ready_grads" not in vars(opt)
    assert list(tmp_path.iterdir()) == []


def parse(*flags: str) -> argparse.Namespace:
    args = add_arguments(argparse.ArgumentParser()).parse_args(list(flags))
    args.use_distributed_optimizer, args.optimizer = True, "adam"
    return args


def test_streaming_off_leaves_the_optimizer_alone():
    opt = distributed_optimizer(master=torch.optim.SGD([torch.zeros(4)], lr=0.1))  # would be refused if checked
    assert setup_optimizer_state_streaming(parse(), opt) == []
    assert not hasattr(opt, STORE_ATTR) and "step_with_ready_grads" not in vars(opt)


def test_bad_flags_are_refused_before_the_optimizer_is_touched(tmp_path):
    args = parse("--stream-optimizer-state-to-disk", "--offload-train-disk-dir", str(tmp_path))
    args.optimizer_cpu_offload = True
    opt = distributed_optimizer()
    with pytest.raises(StreamConfigError, match="--optimizer-cpu-offload"):
        setup_optimizer_state_streaming(args, opt)
    assert not hasattr(opt, STORE_ATTR) and list(tmp_path.iterdir()) == []


def test_flags_reach_the_stream_config(tmp_path):
    args = parse(
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-dir",
        str(tmp_path),
        "--stream-optimizer-state-moment-dtype",
        "bf16",
        "--offload-train-disk-chunk-mb",
        "8",
    )
    config = config_from_args(args, name="rank3")
    assert config == StreamConfig(
        directory=str(tmp_path / "optimizer_state"), moment_dtype="bf16", staging_budget_mb=8, name="rank3"
    )


def test_tier_engine_and_format_flags_reach_the_stream_config(tmp_path):
    args = parse(
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-dir",
        str(tmp_path),
        "--stream-optimizer-state-tier",
        "host",
        "--stream-optimizer-state-engine",
        "sync",
        "--stream-optimizer-state-main-storage",
        "remainder",
        "--stream-optimizer-state-buckets-in-flight",
        "5",
        "--stream-optimizer-state-io-threads",
        "2",
        "--stream-optimizer-state-bucket-cap",
        "1000",
        "--no-stream-optimizer-state-direct-io",
        "--stream-optimizer-state-io-timeout",
        "30",
    )
    config = config_from_args(args, name="rank0")
    assert (config.tier, config.engine, config.main_storage) == ("host", "sync", "remainder")
    assert (config.buckets_in_flight, config.io_threads, config.bucket_cap_elements) == (5, 2, 1000)
    assert config.direct_io is False and config.io_timeout_s == 30.0


@pytest.mark.parametrize(
    "flag, value", [("--stream-optimizer-state-buckets-in-flight", "0"), ("--stream-optimizer-state-io-threads", "-1")]
)
def test_non_positive_pipeline_settings_are_refused(tmp_path, flag, value):
    args = parse("--stream-optimizer-state-to-disk", "--offload-train-disk-dir", str(tmp_path), flag, value)
    with pytest.raises(StreamConfigError, match="must be a positive integer"):
        config_from_args(args, name="rank0")


# The same thing asked two ways: as a launcher flag, and as a field of the built optimizer.
SAME_RULE = {
    "precision-aware optimizer": {"use_precision_aware_optimizer": True},
    "cpu optimizer offload": {"optimizer_cpu_offload": True},
    "optimizer state offload (newer commits)": {"offload_optimizer_states": True},
    "chunked state offload (newer commits)": {"chunked_optimizer_state_offload": True},
    "megatron fsdp": {"use_megatron_fsdp": True},
    "fp8 params": {"fp8_param_gather": True},
    "mxfp8 param all-gather reuse": {"reuse_grad_buf_for_mxfp8_param_ag": True},
    "sgd": {"optimizer": "sgd"},
}


@pytest.mark.parametrize("case", list(SAME_RULE), ids=list(SAME_RULE))
def test_flags_and_the_built_optimizer_are_refused_by_one_rule(case):
    """One table (refusals.REFUSALS) serves validate_args and check_supported: the
    reason a flag is refused for is the reason its optimizer field is refused for."""
    from miles_plugins.optimizers.megatron.refusals import refusals_of_args, refusals_of_optimizer

    kwargs, _ = REFUSED[case]
    (on_optimizer,) = refusals_of_optimizer(distributed_optimizer(**kwargs))
    args = argparse.Namespace(**{"use_distributed_optimizer": True, "optimizer": "adam", **SAME_RULE[case]})
    (on_flags,) = refusals_of_args(args)
    assert on_optimizer.split(": ", 1)[1] == on_flags.split(": ", 1)[1]
