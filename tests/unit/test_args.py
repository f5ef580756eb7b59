"""The argument layer: real-world flag combinations accepted, the refused ones refused with reasons."""

import argparse
import re
import warnings

import pytest

from miles_plugins.optimizers import StreamConfigError
from miles_plugins.optimizers.config import AUTO, DEFAULT_STAGING_BUDGET_MB
from miles_plugins.optimizers.megatron.args import (
    STATE_SUBDIR,
    add_arguments,
    config_from_args,
    default_directory,
    validate_args,
)

# The miles/Megatron fields these checks read, at their launcher defaults.
BASE = dict(
    use_distributed_optimizer=True,
    optimizer="adam",
    lora_rank=0,
    lora_adapter_path=None,
    multi_lora=False,
    optimizer_cpu_offload=False,
    offload_optimizer_states=False,
    use_precision_aware_optimizer=False,
    reset_optimizer_states=False,
    save_local_weight_checksum=False,
    enable_witness=False,
    indep_dp=False,
    offload_train=False,
    offload_train_target=None,
    no_load_optim=False,
    log_params_norm=False,
    non_persistent_ckpt_type="global",
    stream_optimizer_state_to_disk=True,
    stream_optimizer_state_moment_dtype="fp32",
    offload_train_disk_dir="/nvme/state",
    offload_train_disk_chunk_mb=64,
)

ACCEPTED = {
    "streaming with defaults": {},
    "streaming with disk training offload": dict(offload_train=True, offload_train_target="disk"),
    "streaming with bf16 moments": dict(stream_optimizer_state_moment_dtype="bf16"),
    "streaming with 8bit moments": dict(stream_optimizer_state_moment_dtype="8bit"),
    "streaming with no_load_optim": dict(no_load_optim=True),
    "streaming over two drives": dict(offload_train_disk_dir="/nvme0/s,/nvme1/s"),
    "streaming with colocate and no weights backuper": dict(colocate=True, disable_weights_backuper=True),
    # Off: nothing is checked, whatever else is set (LoRA suites pass these legitimately).
    "off: LoRA with colocate and no weights backuper": dict(
        stream_optimizer_state_to_disk=False, lora_rank=16, colocate=True, disable_weights_backuper=True
    ),
    "off: CPU optimizer offload": dict(stream_optimizer_state_to_disk=False, optimizer_cpu_offload=True),
    "off: sgd without distributed optimizer": dict(
        stream_optimizer_state_to_disk=False, optimizer="sgd", use_distributed_optimizer=False
    ),
    "off: cpu training offload": dict(
        stream_optimizer_state_to_disk=False, offload_train=True, offload_train_target="cpu"
    ),
}

REFUSED = {
    "no distributed optimizer": (dict(use_distributed_optimizer=False), "--use-distributed-optimizer is off"),
    "sgd": (dict(optimizer="sgd"), "--optimizer is 'sgd'"),
    "lora rank": (dict(lora_rank=8), "LoRA"),
    "lora adapter": (dict(lora_adapter_path="/ckpt/adapter"), "LoRA"),
    "multi-lora": (dict(multi_lora=True), "multi-LoRA"),
    "cpu optimizer offload": (dict(optimizer_cpu_offload=True), "--optimizer-cpu-offload"),
    "optimizer state offload": (dict(offload_optimizer_states=True), "--offload-optimizer-states"),
    "precision-aware optimizer": (dict(use_precision_aware_optimizer=True), "--use-precision-aware-optimizer"),
    "reset optimizer states": (dict(reset_optimizer_states=True), "silently do nothing"),
    "local weight checksum": (dict(save_local_weight_checksum=True), "evicted"),
    "witness": (dict(enable_witness=True), "--enable-witness"),
    "indep dp": (dict(indep_dp=True), "collide"),
    "params norm logging": (dict(log_params_norm=True), "param.main_param"),
    "local non-persistent checkpoints": (dict(non_persistent_ckpt_type="local"), "--non-persistent-ckpt-type"),
    "cpu training offload": (dict(offload_train=True, offload_train_target="cpu"), "targets 'cpu'"),
    "training offload without target": (dict(offload_train=True), "targets None"),
    "two drives with miles' training offload": (
        dict(offload_train=True, offload_train_target="disk", offload_train_disk_dir="/nvme0/s,/nvme1/s"),
        "--offload-train-disk-dir names several directories with --offload-train on",
    ),
    "a drive listed twice": (dict(offload_train_disk_dir="/nvme0/s,/nvme0/s/"), "--offload-train-disk-dir: directory"),
    "bad chunk": (dict(offload_train_disk_chunk_mb=0), "positive number of MiB"),
    "an empty directory (an unset variable)": (dict(offload_train_disk_dir=""), "--offload-train-disk-dir is empty"),
    "remainder mains without bf16": (
        dict(stream_optimizer_state_main_storage="remainder", bf16=False),
        "'remainder' without --bf16",
    ),
}


def _ns(**overrides):
    return argparse.Namespace(**{**BASE, **overrides})


@pytest.mark.parametrize("overrides", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_real_world_combinations_are_accepted(overrides):
    args = _ns(**overrides)
    before = vars(args).copy()
    validate_args(args)
    assert vars(args) == before, "validation must not change a complete namespace"


@pytest.mark.parametrize("overrides, reason", REFUSED.values(), ids=REFUSED.keys())
def test_incompatible_settings_are_refused_with_their_reason(overrides, reason):
    with pytest.raises(StreamConfigError, match="--stream-optimizer-state-to-disk cannot be used with") as info:
        validate_args(_ns(**overrides))
    assert reason in str(info.value)


def test_every_violation_is_reported_at_once():
    with pytest.raises(StreamConfigError) as info:
        validate_args(_ns(indep_dp=True, enable_witness=True))
    assert "--indep-dp" in str(info.value) and "--enable-witness" in str(info.value)


def test_fields_a_launcher_lacks_read_as_defaults():
    validate_args(argparse.Namespace(stream_optimizer_state_to_disk=True, use_distributed_optimizer=True))


def test_streaming_settings_without_the_switch_are_warned_about():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--stream-optimizer-state-tier", "host", "--stream-optimizer-state-host-budget-gb", "8"])
    with pytest.warns(
        UserWarning,
        match="tier, --stream-optimizer-state-host-budget-gb given, but --stream-optimizer-state-to-disk is off",
    ):
        validate_args(args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_args(parser.parse_args([]))  # defaults: nothing to say


def test_streaming_off_changes_nothing_even_without_a_directory():
    args = argparse.Namespace(stream_optimizer_state_to_disk=False, offload_train_disk_dir=None)
    validate_args(args)
    assert args.offload_train_disk_dir is None


@pytest.mark.parametrize("scratch, root", [("/lustre/me", "/lustre/me"), (None, "/scratch")])
def test_missing_directory_defaults_under_scratch(monkeypatch, scratch, root):
    if scratch is None:
        monkeypatch.delenv("SCRATCH", raising=False)
    else:
        monkeypatch.setenv("SCRATCH", scratch)
    args = _ns(offload_train_disk_dir=None)
    validate_args(args)
    assert args.offload_train_disk_dir == default_directory()
    assert args.offload_train_disk_dir.startswith(root + "/miles_train_offload_"), "miles' default, not a second one"


def test_parser_gets_the_flags_and_keeps_shared_ones_it_already_has():
    parser = argparse.ArgumentParser()
    parser.add_argument("--offload-train-disk-dir", default="/launcher/default")
    add_arguments(parser)
    args = parser.parse_args(["--stream-optimizer-state-to-disk", "--stream-optimizer-state-moment-dtype", "bf16"])
    assert args.stream_optimizer_state_to_disk is True
    assert args.stream_optimizer_state_moment_dtype == "bf16"
    assert args.offload_train_disk_dir == "/launcher/default"
    assert args.offload_train_disk_chunk_mb == DEFAULT_STAGING_BUDGET_MB
    with pytest.raises(SystemExit):
        parser.parse_args(["--stream-optimizer-state-moment-dtype", "fp64"])


def _miles_parser() -> argparse.ArgumentParser:
    """The streaming-related flags exactly as radixark/miles 31f1ca961 defines them
    (miles/utils/arguments.py; help texts shortened), on a parser of their own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream-optimizer-state-to-disk", action="store_true", help="miles: stream")
    parser.add_argument(
        "--stream-optimizer-state-moment-dtype",
        type=str,
        default="fp32",
        choices=["fp32", "bf16", "fp16", "fp8e4m3", "fp8e5m2"],
        help="miles: on-disk dtype",
    )
    parser.add_argument("--offload-train-disk-dir", type=str, default=None, help="miles: directory")
    parser.add_argument("--offload-train-disk-chunk-mb", type=int, default=256, help="miles: staging buffer")
    return parser


def _definitions(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    return {a.dest: (a, tuple(a.option_strings), a.default, a.choices, a.type, a.help) for a in parser._actions}


def test_on_miles_parser_only_missing_flags_are_added_and_miles_definitions_stay():
    parser = _miles_parser()
    before = _definitions(parser)
    add_arguments(parser)
    add_arguments(parser)  # a second call adds nothing either
    after = _definitions(parser)
    assert {dest: after[dest] for dest in before} == before, "a miles definition changed"
    assert set(after) - set(before) == {
        "stream_optimizer_state_tier",
        "stream_optimizer_state_gpu_budget_gb",
        "stream_optimizer_state_host_budget_gb",
        "stream_optimizer_state_auto_gpu_margin_gb",
        "stream_optimizer_state_auto_host_margin_gb",
        "stream_optimizer_state_overlap_gb",
        "stream_optimizer_state_engine",
        "stream_optimizer_state_main_storage",
        "stream_optimizer_state_fp32_param_moments",
        "stream_optimizer_state_buckets_in_flight",
        "stream_optimizer_state_io_threads",
        "stream_optimizer_state_bucket_cap",
        "stream_optimizer_state_io_timeout",
        "stream_optimizer_state_direct_io",
    }
    args = parser.parse_args(["--stream-optimizer-state-to-disk", "--stream-optimizer-state-tier", "host"])
    assert args.stream_optimizer_state_tier == "host" and args.offload_train_disk_chunk_mb == 256


@pytest.mark.parametrize("miles_filled_the_directory", [True, False])
def test_under_miles_the_store_lives_in_a_subdirectory_of_miles_directory(monkeypatch, miles_filled_the_directory):
    """miles' validation fills --offload-train-disk-dir with $SCRATCH/miles_train_offload_<uid>
    when streaming is on; ours fills the same default when it did not. The streamed
    state goes in its own subdirectory, beside miles' per-rank training-offload ones,
    and miles' --offload-train-disk-chunk-mb is the whole staging budget."""
    monkeypatch.setenv("SCRATCH", "/nvme")
    parser = _miles_parser()
    add_arguments(parser)
    args = parser.parse_args(["--stream-optimizer-state-to-disk"])
    if miles_filled_the_directory:
        import os

        args.offload_train_disk_dir = os.path.join("/nvme", f"miles_train_offload_{os.getuid()}")
    args.use_distributed_optimizer, args.optimizer = True, "adam"
    validate_args(args)
    config = config_from_args(args, name="rank0")
    assert config.directory == f"{default_directory()}/{STATE_SUBDIR}"
    assert config.staging_bytes_total == 256 << 20


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--offload-train-disk-chunk-mb", "3"], "--offload-train-disk-chunk-mb: staging budget 3 MiB is too small"),
        (["--offload-train-disk-chunk-mb", "0"], "--offload-train-disk-chunk-mb: staging budget must be a positive"),
        (["--stream-optimizer-state-io-threads", "0"], "--stream-optimizer-state-io-threads: io threads must be"),
        (
            ["--stream-optimizer-state-moment-dtype", "fp16"],
            "(this launcher's --stream-optimizer-state-moment-dtype offers fp32, bf16, fp16, fp8e4m3, fp8e5m2: "
            "of those, bf16)",  # miles' parser does not offer 8bit: the advice does not either
        ),
    ],
)
def test_a_refused_setting_names_the_flag_that_set_it(flags, message):
    """Under miles too: the store's checks name settings, the refusal names the flag."""
    parser = _miles_parser()
    add_arguments(parser)
    args = parser.parse_args(["--stream-optimizer-state-to-disk", *flags])
    args.use_distributed_optimizer, args.optimizer = True, "adam"
    with pytest.raises(StreamConfigError, match=re.escape(message)):
        validate_args(args)


def test_several_disk_directories_each_get_the_state_subdirectory():
    args = _ns(offload_train_disk_dir="/nvme0/s, /nvme1/s")
    validate_args(args)
    assert config_from_args(args, name="rank0").directories == (
        f"/nvme0/s/{STATE_SUBDIR}",
        f"/nvme1/s/{STATE_SUBDIR}",
    )


def test_budget_flags_take_gib_and_set_the_budgets_in_bytes(capsys):
    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--stream-optimizer-state-gpu-budget-gb", "1.5", "--stream-optimizer-state-host-budget-gb", "64"]
    )
    config = config_from_args(args, name="rank0")
    assert (config.gpu_budget_bytes, config.host_budget_bytes) == (3 << 29, 64 << 30)
    assert config_from_args(parser.parse_args([]), name="rank0").gpu_budget_bytes == 0
    for bad in ("-1", "nan", "inf", "2G", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["--stream-optimizer-state-host-budget-gb", bad])
        assert (
            f"--stream-optimizer-state-host-budget-gb takes a number of GiB, 0 or more (e.g. 2.5) or auto, got {bad!r}"
            in (capsys.readouterr().err)
        )


def test_budget_flags_take_auto_and_its_margins_take_gib(capsys):
    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--stream-optimizer-state-gpu-budget-gb", "auto", "--stream-optimizer-state-host-budget-gb", "auto"]
        + ["--stream-optimizer-state-auto-gpu-margin-gb", "6", "--stream-optimizer-state-auto-host-margin-gb", "0.5"]
    )
    config = config_from_args(args, name="rank0")
    assert config.gpu_budget_bytes is AUTO and config.host_budget_bytes is AUTO
    assert (config.auto_gpu_margin_bytes, config.auto_host_margin_bytes) == (6 << 30, 1 << 29)
    defaults = config_from_args(parser.parse_args([]), name="rank0")
    assert (defaults.auto_gpu_margin_bytes, defaults.auto_host_margin_bytes) == (4 << 30, 16 << 30)
    for bad in ("auto", "-1", "AUTO"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--stream-optimizer-state-auto-gpu-margin-gb", bad])
        assert (
            f"--stream-optimizer-state-auto-gpu-margin-gb takes a number of GiB, 0 or more (e.g. 2.5), got {bad!r}"
            in (capsys.readouterr().err)
        )


def test_the_overlap_flag_takes_gib_and_is_refused_beside_an_auto_gpu_budget(capsys):
    parser = add_arguments(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args([]), name="rank0").overlap_bytes == 0
    args = parser.parse_args(["--stream-optimizer-state-overlap-gb", "2.5"])
    assert config_from_args(args, name="rank0").overlap_bytes == 5 << 29
    with pytest.raises(SystemExit):
        parser.parse_args(["--stream-optimizer-state-overlap-gb", "auto"])
    assert "--stream-optimizer-state-overlap-gb takes a number of GiB, 0 or more (e.g. 2.5), got 'auto'" in (
        capsys.readouterr().err
    )
    args = _ns(stream_optimizer_state_overlap_gb=1.0, stream_optimizer_state_gpu_budget_gb="auto")
    with pytest.raises(StreamConfigError, match="--stream-optimizer-state-overlap-gb: overlap bytes cannot be used"):
        validate_args(args)


def test_a_budget_set_without_the_parser_is_refused_naming_its_flag():
    args = _ns(stream_optimizer_state_gpu_budget_gb=-2.0)
    with pytest.raises(StreamConfigError, match="--stream-optimizer-state-gpu-budget-gb: gpu budget bytes must be"):
        validate_args(args)


def test_a_refused_setting_is_reported_beside_the_other_refusals():
    """All at once: a bad staging budget does not hide behind another refusal, nor it behind it."""
    parser = _miles_parser()
    add_arguments(parser)
    args = parser.parse_args(["--stream-optimizer-state-to-disk", "--offload-train-disk-chunk-mb", "0"])
    args.use_distributed_optimizer, args.optimizer, args.log_params_norm = True, "adam", True
    with pytest.raises(StreamConfigError) as info:
        validate_args(args)
    assert "--log-params-norm" in str(info.value) and "--offload-train-disk-chunk-mb: staging budget" in str(info.value)
