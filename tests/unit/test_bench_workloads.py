"""The suite's tables (``bench.workloads``): every mode's flags pass the launcher's own
checks, the workloads hold the modes the issue names, the sizes follow from the shapes
(the MoE GPT's against Qwen3-30B-A3B's published counts), and the calls are planned
with each mode's baseline and peers."""

import argparse

import pytest
import torch

from bench import workloads
from bench.workloads import DENSE_1B, MOE, SCALE_1GPU, WORKLOADS
from miles_plugins.optimizers.megatron import args as megatron_args

H200_BYTES = 139.8 * 2**30
ALL_MODES = [(w.name, m.name) for w in WORKLOADS.values() for m in w.modes]


@pytest.mark.parametrize("workload, mode", ALL_MODES, ids=[f"{w}:{m}" for w, m in ALL_MODES])
def test_every_mode_passes_the_launcher_s_own_checks(workload, mode, tmp_path):
    spec = WORKLOADS[workload].mode(mode)
    parser = megatron_args.add_arguments(argparse.ArgumentParser())
    ours = workloads.mode_flags(spec, str(tmp_path)) if spec.ours else []
    parsed, unknown = parser.parse_known_args(ours)
    assert unknown == []
    assert parsed.stream_optimizer_state_to_disk == (spec.kind == "ours")
    parsed.use_distributed_optimizer, parsed.bf16, parsed.optimizer = True, True, "adam"  # as the GPT sets them
    megatron_args.validate_args(parsed)  # raises what the launcher would refuse


@pytest.mark.parametrize("workload", WORKLOADS.values(), ids=list(WORKLOADS))
def test_each_mode_s_baseline_runs_before_it_and_its_peers_exist(workload):
    order = [m.name for m in workload.modes]
    assert len(set(order)) == len(order)
    for mode in workload.modes:
        if mode.baseline:
            assert order.index(mode.baseline) < order.index(mode.name)
            assert workload.mode(mode.baseline).kind == "resident"
        assert all(workload.mode(peer).kind == "megatron-dev" for peer in mode.peers)
        assert mode.expect in (None, "oom", "identical")


def test_dense_1b_holds_the_issue_s_modes():
    kinds = {m.name: (m.kind, m.ours, m.dev_fraction) for m in DENSE_1B.modes}
    assert sorted(f for kind, _, f in kinds.values() if kind == "megatron-dev") == [0.25, 0.5, 0.75, 1]
    ours = {name: p for name, (kind, p, _) in kinds.items() if kind == "ours"}
    assert ours["host"] == workloads.Placement(tier="host")
    assert ours["host+window-3g"].window_gb == 3 and DENSE_1B.mode("host+window-3g").peers == ("dev@1",)
    assert ours["gpu-budget-at-dev@0.5"].gpu_budget_gb > 0 and DENSE_1B.mode("gpu-budget-at-dev@0.5").peers == (
        "dev@0.5",
    )
    assert ours["disk"].tier == "disk" and ours["disk"].exact
    eight = ours["disk-remainder-8bit"]
    assert (eight.tier, eight.main_storage, eight.moment_dtype, eight.exact) == ("disk", "remainder", "8bit", False)
    assert ours["auto"].gpu_budget_gb == ours["auto"].host_budget_gb == "auto"
    # The disk modes keep the state out of the page cache: their host limit is below it.
    assert all(DENSE_1B.mode(n).memory_max_gib * 2**30 < 13.75e9 for n in ("disk", "disk-remainder-8bit"))
    flags = workloads.model_flags(DENSE_1B, DENSE_1B.mode("host"), 1)
    assert flags[flags.index("--num-layers") + 1] == "20" and flags[flags.index("--hidden-size") + 1] == "2048"


def _layers(flags):
    return int(flags[len(flags) - 1 - flags[::-1].index("--num-layers") + 1])


def test_scale_1gpu_sizes_follow_from_the_layers_and_its_expectations_are_set():
    for mode in SCALE_1GPU.modes:
        size = float(mode.name.split("b-")[0])  # "7.6b-auto": 7.6B params
        layers = _layers(workloads.model_flags(SCALE_1GPU, mode, 1))
        assert round(workloads.gpt_params(layers) / 1e9, 1) == size, mode.name
        if mode.ours:
            assert mode.ours.gpu_budget_gb == mode.ours.host_budget_gb == "auto"
    identity = SCALE_1GPU.mode("5.1b-auto")
    assert identity.expect == "identical" and "--deterministic-mode" in identity.model
    assert "--deterministic-mode" in SCALE_1GPU.mode(identity.baseline).model
    assert SCALE_1GPU.mode("7.6b-resident").expect == "oom"
    assert {SCALE_1GPU.mode(n).baseline for n in ("7.6b-auto", "7.6b-auto-remainder-8bit")} == {"7.6b-resident"}
    assert SCALE_1GPU.mode("15.8b-auto-remainder").ours.exact
    assert not SCALE_1GPU.mode("18.0b-auto-remainder-8bit").ours.exact


def test_the_moe_gpt_is_qwen3_30b_a3b_s_size():
    # Qwen3-30B-A3B's model card: 30.5B parameters in all, 3.3B activated, 48 layers.
    assert workloads.moe_params(48) / 1e9 == pytest.approx(30.5, abs=0.05)
    assert workloads.moe_params(48, active=True) / 1e9 == pytest.approx(3.3, abs=0.06)
    layer = workloads.moe_layer_params()
    assert layer["expert"] == 3 * 2048 * 768  # SwiGLU: gate and up projections, then down


@pytest.mark.parametrize("gpus, layers", [(8, 48), (4, 24), (2, 12), (1, 6)])
def test_the_moe_layers_and_expert_parallelism_follow_the_gpus(gpus, layers):
    flags = workloads.model_flags(MOE, MOE.mode("host+auto-gpu"), gpus)

    def value(flag):
        return flags[flags.index(flag) + 1]

    assert workloads.moe_layers(gpus) == layers == int(value("--num-layers"))
    assert int(value("--expert-model-parallel-size")) == gpus
    shape = (value("--num-experts"), value("--moe-router-topk"), value("--moe-ffn-hidden-size"))
    assert shape == ("128", "8", "768")
    assert (value("--num-attention-heads"), value("--num-query-groups"), value("--kv-channels")) == ("32", "4", "128")
    assert "--overlap-grad-reduce" in flags and "--overlap-param-gather" in flags
    # Each GPU holds the full model's per-GPU experts: resident fits an H200 with room left.
    resident = workloads.moe_resident_bytes_per_gpu(gpus)
    assert 0.45 * H200_BYTES < resident < 0.6 * H200_BYTES
    quick = workloads.model_flags(MOE, MOE.mode("resident"), gpus, quick=True)
    assert _layers(quick) == gpus


def test_gpu_counts_outside_a_workload_s_are_refused():
    for gpus in (3, 16):
        with pytest.raises(ValueError, match="runs at"):
            workloads.model_flags(MOE, MOE.mode("resident"), gpus)
        with pytest.raises(ValueError, match="expert-parallel"):
            workloads.moe_layers(gpus)


def test_calls_hold_each_mode_with_its_company_within_the_budget():
    names = [m.name for m in DENSE_1B.modes]
    calls = workloads.plan_calls(DENSE_1B, names, 560)
    assert sorted({n for call in calls for n in call}) == sorted(names)
    for call in calls:
        assert sum(workloads.run_estimate_s(DENSE_1B, DENSE_1B.mode(n)) for n in call) <= 560
        for name in call:
            mode = DENSE_1B.mode(name)
            assert (mode.baseline is None or mode.baseline in call) and set(mode.peers) <= set(call)
            if mode.baseline:
                assert call.index(mode.baseline) < call.index(name)
    # A mode longer than a call still gets a call of its own, with its baseline.
    assert workloads.plan_calls(DENSE_1B, ["disk"], 100) == [["resident", "disk"]]
    with pytest.raises(KeyError):
        workloads.plan_calls(DENSE_1B, ["nope"], 560)


@pytest.fixture
def one_rank_groups(tmp_path):
    """megatron-core's model-parallel groups on one gloo rank (MoE layers need them)."""
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def test_megatron_core_builds_the_moe_flags_into_a_gpt_of_the_counted_size(one_rank_groups):
    """The workload's flags, as megatron-core's GPTModel (local spec, on the meta device:
    no memory), hold as many params as ``moe_params`` counts, at one and two layers."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    flags = workloads.model_flags(MOE, MOE.mode("resident"), 1)

    def value(flag):
        return int(flags[flags.index(flag) + 1])

    assert {"--swiglu", "--disable-bias-linear", "--qk-layernorm", "--untie-embeddings-and-output-weights"} <= set(
        flags
    )
    for layers in (1, 2):
        config = TransformerConfig(
            num_layers=layers,
            hidden_size=value("--hidden-size"),
            num_attention_heads=value("--num-attention-heads"),
            num_query_groups=value("--num-query-groups"),
            kv_channels=value("--kv-channels"),
            ffn_hidden_size=value("--ffn-hidden-size"),
            num_moe_experts=value("--num-experts"),
            moe_router_topk=value("--moe-router-topk"),
            moe_ffn_hidden_size=value("--moe-ffn-hidden-size"),
            gated_linear_unit=True,
            add_bias_linear=False,
            normalization="RMSNorm",
            qk_layernorm=True,
            use_cpu_initialization=True,
            perform_initialization=False,
        )
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=True, normalization="RMSNorm")
        with torch.device("meta"):
            model = GPTModel(
                config,
                spec,
                vocab_size=value("--vocab-size"),
                max_sequence_length=value("--seq-length"),
                share_embeddings_and_output_weights=False,
                position_embedding_type="rope",
            )
        assert sum(p.numel() for p in model.parameters()) == workloads.moe_params(layers)
