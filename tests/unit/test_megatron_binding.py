"""The Megatron binding's paths that need no GPU, on the CPU, with real megatron-core.

A real ``DistributedOptimizer`` cannot be constructed here (its buffers are
CUDA tensors). This builds one the way ``test_megatron_guards.py`` does
(``__new__``), at data-parallel size 1, with the attributes the binding reads
filled by Megatron's own code: the range maps come from
``DistributedOptimizer._build_model_gbuf_param_range_map`` over a bf16 param
buffer whose views are the params, and the process groups from
``parallel_state.initialize_model_parallel`` over gloo. The binding itself,
the store, the state-dict family (``ShardedObject`` included) and the load
arming then run unchanged. The GPU tier runs the same paths under a real DDP
model and ``get_megatron_optimizer``.
"""

import contextlib
import json
import logging
import os
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig  # noqa: E402
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range  # noqa: E402

from megatron_hooks.checkpoint import HooksNotInstalledError  # noqa: E402
from megatron_hooks.contract import STORE_ATTR  # noqa: E402
from miles_plugins.optimizers import (  # noqa: E402
    CheckpointMismatchError,
    StoreUnusableError,
    StreamConfig,
    StreamConfigError,
)
from miles_plugins.optimizers.homes.auto_budget import AutoGpuBudget  # noqa: E402
from miles_plugins.optimizers.homes.device_backing import DeviceBacking  # noqa: E402
from miles_plugins.optimizers.megatron.binding import MegatronBinding  # noqa: E402
from miles_plugins.optimizers.megatron.deferred_mains import MainsWithoutStorage, deferred_mains  # noqa: E402
from miles_plugins.optimizers.megatron.state_dict import MARKER_VERSION, STREAMED_STATE_KEY  # noqa: E402
from miles_plugins.optimizers.store import plan as store_module  # noqa: E402
from tests.helpers import SimulatedDevice  # noqa: E402
from tests.unit.reference import same_bytes  # noqa: E402

SHAPES = [(64, 32), (32,), (48, 64), (48,), (16, 48)]
LR, STEPS = 1e-2, 4


@pytest.fixture(scope="module", autouse=True)
def process_groups(tmp_path_factory):
    init = tmp_path_factory.mktemp("dist") / "init"
    torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def dp1_distributed_optimizer(seed: int = 0, deferred: bool = False):
    """A real DistributedOptimizer over bf16 params that are views of one param buffer;
    ``deferred``: its mains made under the mode ``deferred_mains`` builds them with."""
    torch.manual_seed(seed)
    total = sum(torch.Size(s).numel() for s in SHAPES)
    buffer = torch.randn(total).to(torch.bfloat16)
    params, world_index, start = [], {}, 0
    for shape in SHAPES:
        end = start + torch.Size(shape).numel()
        param = torch.nn.Parameter(buffer[start:end].view(shape))
        params.append(param)
        world_index[param] = (start, end, 0)
        start = end
    key = (torch.bfloat16, torch.float32)
    opt = DistributedOptimizer.__new__(DistributedOptimizer)
    opt.gbuf_ranges = [
        {key: [{"param_map": DistributedOptimizer._build_model_gbuf_param_range_map(world_index, Range(0, total), 0)}]}
    ]
    opt.model_param_gbuf_map = {p: (0, key, 0) for p in params}
    opt.model_chunks = [torch.nn.ParameterList(params)]  # the model, as Megatron names its params
    bucket = types.SimpleNamespace(param_data=buffer, offset=0)
    opt.buffers = [types.SimpleNamespace(buckets=[bucket], param_index_map=world_index)]
    with MainsWithoutStorage() if deferred else contextlib.nullcontext():
        mains = [p.detach().view(-1).clone().float() for p in params]  # as Megatron builds them at DP=1
    opt.model_float16_groups, opt.shard_fp32_from_float16_groups = [params], [mains]
    opt.shard_float16_groups = [[p.detach().view(-1) for p in params]]
    opt.model_fp32_groups, opt.shard_fp32_groups = [[]], [[]]
    opt.optimizer = torch.optim.AdamW([{"params": mains}], lr=LR, weight_decay=0.1)
    opt.config = OptimizerConfig(optimizer="adam", bf16=True, use_distributed_optimizer=True)
    opt.ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    opt.grad_scaler, opt.is_stub_optimizer = None, False
    opt.data_parallel_group = parallel_state.get_data_parallel_group()
    opt.data_parallel_group_idx, opt.distributed_optimizer_instance_id = 0, 0
    return opt, params


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(torch.Size(s).numel(), generator=g) for s in SHAPES]


def bind(tmp_path, seed: int = 0, name: str = "rank0", deferred: bool = False, **config):
    opt, params = dp1_distributed_optimizer(seed, deferred)
    binding = MegatronBinding(
        opt, StreamConfig(directory=str(tmp_path / "scratch"), name=name, bucket_cap_elements=3000, **config)
    )
    return opt, params, binding


def bucket_sizes(tmp_path) -> list[int]:
    """The stored size of each of the test optimizer's buckets."""
    _, _, binding = bind(tmp_path / "sizes", tier="host")
    sizes = [b.file_size for b in binding.store.buckets]
    binding.store.close()
    return sizes


def train(opt, binding, steps):
    for step in steps:
        for entry, grad in zip(binding.entries, grads(step), strict=True):
            entry.main.grad = grad  # what prepare_grads leaves: the fp32 grad shard
        opt.optimizer.step()  # the master's step is the streamed step


@pytest.mark.parametrize(
    "placement, deferred",
    [("disk", False), ("gpu-host-disk", False), ("gpu-host-disk", True)],
    ids=["disk", "gpu-host-disk", "gpu-host-disk-deferred-mains"],
)
def test_steps_through_the_binding_match_plain_adam_on_the_mains(tmp_path, placement, deferred):
    """Deferred: the mains had no storage when bound (``deferred_mains``); the binding
    filled them from the bf16 params, to the values Megatron's build gives them."""
    budgets = {}
    if placement != "disk":
        sizes = bucket_sizes(tmp_path)
        budgets = {"gpu_budget_bytes": sizes[-1], "host_budget_bytes": sizes[-2]}
    opt, params, binding = bind(tmp_path, deferred=deferred, **budgets)
    assert getattr(opt, STORE_ATTR) is binding and len(binding.store.buckets) >= 3
    if budgets:
        assert binding.store.placement == {"gpu": 1, "host": 1, "disk": len(binding.store.buckets) - 2}
    mains = [p.detach().view(-1).float().clone() for p in params]
    reference = torch.optim.AdamW([{"params": mains}], lr=LR, weight_decay=0.1)
    train(opt, binding, range(STEPS))
    for step in range(STEPS):
        for main, grad in zip(mains, grads(step), strict=True):
            main.grad = grad
        reference.step()
    for param, main in zip(params, mains, strict=True):
        assert same_bytes(param.detach().view(-1), main.to(torch.bfloat16)), "the param buffer holds the updated mains"
    for (_, main, exp_avg, exp_avg_sq), ref in zip(binding.iter_state(), mains, strict=True):
        state = reference.state[ref]
        assert (
            same_bytes(main, ref)
            and same_bytes(exp_avg, state["exp_avg"])
            and same_bytes(exp_avg_sq, state["exp_avg_sq"])
        )
    binding.store.close()


def test_the_gpu_home_is_allocated_only_after_the_mains_before_it_gave_their_memory_back(tmp_path, monkeypatch):
    """Megatron's build left every main on the device: a gpu home allocated at setup on top
    of them ran out of memory at 13B. Each gpu bucket's buffer is allocated as the store
    writes it, once the buckets before it have released their mains."""
    sizes = bucket_sizes(tmp_path)
    opt, _ = dp1_distributed_optimizer()
    mains = opt.shard_fp32_from_float16_groups[0]  # the binding's entries, in order
    layout = []
    held_at_allocation = []
    add, make_layout = DeviceBacking.add, store_module._layout

    def observed_add(self, bucket):  # the real allocation, observed
        before = [i for b in layout if b.index < bucket.index for i in b.entry_indices]
        held_at_allocation.append(sum(mains[i].untyped_storage().nbytes() for i in before))
        return add(self, bucket)

    def observed_layout(*args, **kwargs):
        layout.extend(make_layout(*args, **kwargs))
        return layout

    monkeypatch.setattr(DeviceBacking, "add", observed_add)
    monkeypatch.setattr(store_module, "_layout", observed_layout)
    binding = MegatronBinding(
        opt,
        StreamConfig(
            directory=str(tmp_path / "scratch"),
            bucket_cap_elements=3000,
            gpu_budget_bytes=sizes[-1] + sizes[-2],
            buckets_in_flight=1,  # with more, the buckets just before it may still be writing (in flight)
        ),
    )
    assert binding.store.placement["gpu"] == 2
    assert held_at_allocation == [0, 0], "a gpu bucket was allocated while earlier buckets' mains held memory"
    binding.store.close()


def test_deferred_mains_checks_upstream_first_and_leaves_the_class_as_it_was():
    original = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
    with pytest.raises(HooksNotInstalledError):  # this venv's megatron-core has no patched training tree
        with deferred_mains():
            pass
    assert DistributedOptimizer.__dict__["_build_model_and_main_param_groups"] is original


def test_deferred_mains_defers_only_builds_on_threads_inside_a_block_and_restores_the_class(monkeypatch):
    """The wrap itself, around a stand-in for Megatron's classmethod that makes one main
    as it does (``clone().float()`` of a bf16 shard) and says how many bytes it got; the
    tripwire is stubbed (this venv's megatron-core has no patched training tree)."""
    import threading

    from miles_plugins.optimizers.megatron import deferred_mains as deferring

    def stand_in(cls):
        return torch.ones(4, dtype=torch.bfloat16).clone().float().untyped_storage().nbytes()

    monkeypatch.setattr(DistributedOptimizer, "_build_model_and_main_param_groups", classmethod(stand_in))
    monkeypatch.setattr(deferring, "check_upstream", lambda: None)
    upstream = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
    elsewhere = []
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def block_b():  # opens inside A's block and closes after it: the blocks overlap, not nest
        a_in.wait()
        with deferred_mains():
            b_in.set()
            a_out.wait()
            elsewhere.append(DistributedOptimizer._build_model_and_main_param_groups())

    other = threading.Thread(target=block_b)
    other.start()
    with deferred_mains():
        a_in.set()
        b_in.wait()
        inside = DistributedOptimizer._build_model_and_main_param_groups()
        outsider = threading.Thread(
            target=lambda: elsewhere.append(DistributedOptimizer._build_model_and_main_param_groups())
        )
        outsider.start()
        outsider.join()
    a_out.set()
    other.join()
    assert inside == 0  # the main was made storage-less
    assert elsewhere == [16, 0]  # a thread outside any block built as upstream does; B's build deferred
    assert DistributedOptimizer.__dict__["_build_model_and_main_param_groups"] is upstream
    assert DistributedOptimizer._build_model_and_main_param_groups() == 16


def test_mains_partly_without_storage_are_refused(tmp_path):
    opt, _ = dp1_distributed_optimizer()
    opt.shard_fp32_from_float16_groups[0][1].untyped_storage().resize_(0)
    with pytest.raises(StreamConfigError, match="1 of the 5 fp32 mains"):
        MegatronBinding(opt, StreamConfig(directory=str(tmp_path / "scratch"), bucket_cap_elements=3000))


def test_a_checkpoint_records_which_elements_of_which_param_each_entry_holds(tmp_path):
    opt, params, binding = bind(tmp_path)
    binding.save_to(str(tmp_path / "ckpt"))
    saved = json.loads((tmp_path / "ckpt" / "rank0" / "manifest.json").read_text())
    # [name, start, master group]: the name is the param's model chunk and its name in the model;
    # at DP=1 each entry is a whole param.
    assert [piece for bucket in saved["pieces"] for piece in bucket] == [[f"0/{i}", 0, 0] for i in range(len(SHAPES))]
    # Its peers (the saves a load at another DP size may read): the same TP and PP coordinates.
    assert saved["topology"]["shard_peers"] == {
        "tp_size": 1,
        "tp_rank": 0,
        "ep_size": 1,
        "pp_size": 1,
        "pp_rank": 0,
        "optimizer_instance": 0,
    }
    assert [n for bucket in saved["layout"] for n in bucket["numels"]] == [p.numel() for p in params]
    # Where every param sits in its DDP bucket (here one bucket, params back to back): ckpt reshard's input.
    numels = [torch.Size(shape).numel() for shape in SHAPES]
    starts = [sum(numels[:i]) for i in range(len(numels))]
    assert saved["param_layout"] == {
        "buckets": [
            {"key": [0, 0], "params": [[f"0/{i}", starts[i], n] for i, n in enumerate(numels)], "size": sum(numels)}
        ],
        "pad_for_high_nccl_busbw": False,
        "ddp_bucket_size": None,
    }
    binding.store.close()


def test_the_state_dict_family_carries_options_and_a_marker_never_the_state(tmp_path):
    opt, _, binding = bind(tmp_path)
    train(opt, binding, range(2))
    state = opt.state_dict()
    assert set(state) == {"optimizer"}
    assert state["optimizer"][STREAMED_STATE_KEY] == {"hook_abi_version": MARKER_VERSION, "steps_taken": 2}
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [LR]
    assert "state" not in state["optimizer"] and "params" not in state["optimizer"]["param_groups"][0]
    sharded = opt.sharded_state_dict({}, is_loading=False)
    assert isinstance(sharded["optimizer"], ShardedObject)
    assert sharded["optimizer"].key == "optimizer.distributed.dp_group_idx_0.optimizer"
    assert sharded["optimizer"].data == state["optimizer"]
    with pytest.raises(StreamConfigError, match="checkpoint it with Megatron's save_checkpoint"):
        opt.optimizer.state_dict()
    binding.store.close()


def test_a_loaded_state_dict_arms_the_load_until_the_store_is_restored(tmp_path):
    opt, _, binding = bind(tmp_path)
    train(opt, binding, range(2))
    saved_state_dict = opt.state_dict()
    binding.save_to(str(tmp_path / "ckpt"))
    binding.store.close()

    opt, _, binding = bind(tmp_path, seed=1)
    opt.load_state_dict(saved_state_dict)
    with pytest.raises(StoreUnusableError, match="the load hook .* did not run"):
        opt.optimizer.step()
    # A load that fails keeps it armed, saying why: the params are the checkpoint's, the mains are not.
    with pytest.raises(CheckpointMismatchError, match="holds no state for rank0"):
        binding.load_from(str(tmp_path / "elsewhere"))
    with pytest.raises(StoreUnusableError, match=r"its load failed \(CheckpointMismatchError: .*holds no state"):
        opt.optimizer.step()
    assert binding.load_from(str(tmp_path / "ckpt"))
    assert binding.store.steps_taken == 2
    train(opt, binding, range(2, 3))
    binding.store.close()


def test_a_state_from_another_save_is_refused_before_it_changes_anything(tmp_path):
    opt, _, binding = bind(tmp_path)
    train(opt, binding, range(2))
    saved_state_dict = opt.state_dict()
    train(opt, binding, range(2, 3))
    binding.save_to(str(tmp_path / "ckpt"))  # a save after step 3; the state dict says step 2
    binding.store.close()

    opt, params, binding = bind(tmp_path, seed=1)
    before = [m.clone() for _, m, _, _ in binding.iter_state()]
    opt.load_state_dict(saved_state_dict)
    with pytest.raises(
        CheckpointMismatchError, match="after step 3, .* saved after step 2: they come from different saves"
    ):
        binding.load_from(str(tmp_path / "ckpt"))
    assert all(same_bytes(a, b) for a, (_, b, _, _) in zip(before, binding.iter_state(), strict=True))
    binding.store.close()


@pytest.mark.parametrize(
    "marker, message",
    [
        (None, "written without optimizer-state streaming"),
        ({"hook_abi_version": MARKER_VERSION + 1, "steps_taken": 1}, "written with hook ABI"),
    ],
)
def test_a_state_dict_that_cannot_be_resumed_is_refused(tmp_path, marker, message):
    opt, _, binding = bind(tmp_path)
    state = {"optimizer": {"param_groups": [{"lr": 1.0}]}}
    if marker is not None:
        state["optimizer"][STREAMED_STATE_KEY] = marker
    with pytest.raises(CheckpointMismatchError, match=message):
        opt.load_state_dict(state)
    assert opt.optimizer.param_groups[0]["lr"] == LR, "a refused state dict changes nothing"
    binding.store.close()


def test_without_a_loaded_state_dict_the_load_hook_starts_fresh_with_a_warning(tmp_path, caplog):
    """What --no-load-optim (or --finetune) leads to: Megatron loads no optimizer
    state dict, rebuilds the mains from the loaded params, and the hook says so."""
    opt, params, binding = bind(tmp_path)
    with torch.no_grad():
        for p in params:
            p.fill_(0.5)
    opt.reload_model_params()
    with caplog.at_level(logging.WARNING):
        assert binding.load_from(str(tmp_path / "ckpt")) is False
    assert "Adam starts fresh from the loaded params" in caplog.text
    for _, main, exp_avg, _ in binding.iter_state():
        assert torch.equal(main, torch.full_like(main, 0.5)) and exp_avg is None
    binding.store.close()


def test_offload_and_parameter_state_files_are_no_ops(tmp_path):
    opt, _, binding = bind(tmp_path)
    for call in (opt.offload_to_cpu, opt.restore_from_cpu):
        assert call() is None
    assert opt.save_parameter_state(os.path.join(str(tmp_path), "x.pt")) is None
    assert not (tmp_path / "x.pt").exists()
    binding.store.close()


def test_zero_grad_releases_reads_prefetched_for_a_step_that_never_ran(tmp_path):
    """With fp16 loss scaling a step is skipped when the grads hold inf/nan; a chain
    member may have prefetched for it. The next iteration's zero_grad drops them."""
    opt, _, binding = bind(tmp_path)
    train(opt, binding, range(1))
    binding.store.prefetch()
    mains = [entry.main for entry in binding.entries]
    assert any(m.untyped_storage().nbytes() for m in mains), "prefetch materialized the first buckets"
    opt.zero_grad()
    assert not any(m.untyped_storage().nbytes() for m in mains)
    assert binding.store._pipeline.accounting.current == 0
    train(opt, binding, range(1, 2))
    binding.store.close()


def test_streaming_an_optimizer_twice_is_refused(tmp_path):
    """A second store would take the first one's released (empty) mains as its
    initial state."""
    from miles_plugins.optimizers.megatron.binding import attach

    opt, _, binding = bind(tmp_path)
    with pytest.raises(StreamConfigError, match="this optimizer streams already"):
        attach(opt, StreamConfig(directory=str(tmp_path / "again")))
    assert not (tmp_path / "again").exists()
    binding.store.close()


def test_a_dense_and_an_expert_optimizer_share_the_ranks_staging_budget(tmp_path, monkeypatch):
    """The budget bounds the rank's pinned host memory (miles documents
    --offload-train-disk-chunk-mb so), however many optimizers the chain holds."""
    from miles_plugins.optimizers.megatron import binding as megatron

    # The patched-tree and drift checks need megatron.training, which the 0.16 wheel here lacks.
    monkeypatch.setattr(megatron, "check_upstream", lambda: None)
    attach = megatron.attach

    chain = types.SimpleNamespace(chained_optimizers=[dp1_distributed_optimizer(0)[0], dp1_distributed_optimizer(1)[0]])
    config = StreamConfig(directory=str(tmp_path / "scratch"), name="rank0", staging_budget_mb=256)
    bindings = attach(chain, config)
    try:
        assert [b.store.config.staging_budget_mb for b in bindings] == [128, 128]
        assert sum(b.store.config.staging_bytes_total for b in bindings) <= 256 << 20
    finally:
        for binding in bindings:
            binding.store.close()
    chain = types.SimpleNamespace(chained_optimizers=[dp1_distributed_optimizer(0)[0], dp1_distributed_optimizer(1)[0]])
    small = StreamConfig(directory=str(tmp_path / "scratch2"), name="rank0", staging_budget_mb=6)
    with pytest.raises(
        StreamConfigError, match="6 MiB is shared by this rank's 2 distributed optimizers .* 3 MiB each"
    ):
        attach(chain, small)


def test_a_chain_streamed_on_a_rank_where_it_holds_no_params_is_marked_streamed(tmp_path):
    """No store there, but the save hook must still join the ranks' agreement on an
    asynchronous checkpoint (megatron_hooks.async_finalize): the optimizer is marked."""
    from megatron_hooks.contract import STREAMING_ATTR
    from miles_plugins.optimizers.megatron.binding import attach

    stub = types.SimpleNamespace(is_stub_optimizer=True)  # Megatron's for a chain part with no params here
    chain = types.SimpleNamespace(chained_optimizers=[stub, stub])
    assert attach(chain, StreamConfig(directory=str(tmp_path / "scratch"), name="rank0")) == []
    assert getattr(chain, STREAMING_ATTR) is True
    opt, _, binding = bind(tmp_path / "bound")
    assert getattr(opt, STREAMING_ATTR, False) is False, "a binding alone does not mark: attach marks the chain"
    binding.store.close()


@pytest.mark.parametrize("ranks, one_slot", [(1, False), (2, True)], ids=["alone", "two-ranks-share-the-drive"])
def test_ranks_of_a_node_plan_their_disk_buckets_with_their_share_of_the_drive(
    tmp_path, monkeypatch, small_drives, ranks, one_slot
):
    """Every rank of a node measures the same free space at once: planned on all of it, each
    took two slots and the ranks' reservations then failed together (seen with two stores on a
    small tmpfs). Here the drive holds this rank's two slots, but not two ranks' worth."""
    from miles_plugins.optimizers.homes import memory_probes as budgets
    from miles_plugins.optimizers.megatron import binding as megatron

    monkeypatch.setattr(megatron, "check_upstream", lambda: None)
    monkeypatch.setattr(budgets, "local_ranks", lambda group=False: (ranks, "the test"))
    sizes = bucket_sizes(tmp_path)
    drive = small_drives("drive", 2 * sum(sizes) + (64 << 10))
    opt, _ = dp1_distributed_optimizer()
    config = StreamConfig(directory=str(drive / "state"), name="rank0", bucket_cap_elements=3000)
    (binding,) = megatron.attach(opt, config)
    try:
        assert bool(binding.store.placed.one_slot) == one_slot, binding.store.placed.one_slot
    finally:
        binding.store.close()


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_the_chain_s_optimizers_fill_the_rank_s_budgets_in_turn(tmp_path, monkeypatch, tier):
    """The GPU and host budgets are the rank's: the first store takes what it places,
    the next what is left (buckets the tier takes count against no budget)."""
    from miles_plugins.optimizers.megatron import binding as megatron

    monkeypatch.setattr(megatron, "check_upstream", lambda: None)  # needs megatron.training (see above)
    sizes = bucket_sizes(tmp_path)  # both members have the same layout
    budget = sum(sizes) + sizes[-1]
    chain = types.SimpleNamespace(chained_optimizers=[dp1_distributed_optimizer(0)[0], dp1_distributed_optimizer(1)[0]])
    config = StreamConfig(
        directory=str(tmp_path / "scratch"),
        name="rank0",
        bucket_cap_elements=3000,
        tier=tier,
        gpu_budget_bytes=budget,
        host_budget_bytes=max(sizes),
    )
    bindings = megatron.attach(chain, config)
    try:
        assert [b.store.placement["gpu"] for b in bindings] == [len(sizes), 1]
        assert sum(b.store.home_bytes["gpu"] for b in bindings) == budget
        # The host budget went to the second store; with the host tier, so did every bucket the GPU left.
        assert bindings[0].store.placement["host"] == 0
        if tier == "host":
            assert bindings[1].store.placement["host"] == len(sizes) - 1
        else:
            assert 0 < bindings[1].store.home_bytes["host"] <= max(sizes)
    finally:
        for binding in bindings:
            binding.store.close()


def test_a_chain_shares_one_auto_gpu_budget_sized_after_its_last_store_stepped(tmp_path):
    """What attach does for a Megatron chain (dense, expert): one AutoGpuBudget for the rank's stores."""

    shared = AutoGpuBudget(0)  # the CPU: no allocator statistics until the test gives them
    chain = []
    for i in range(2):
        opt, params = dp1_distributed_optimizer(i)
        config = StreamConfig(
            directory=str(tmp_path / "scratch"), name=f"rank0.opt{i}", bucket_cap_elements=3000, gpu_budget_bytes="auto"
        )
        chain.append((opt, params, MegatronBinding(opt, config, auto_gpu=shared)))
    stores = [binding.store for _, _, binding in chain]
    assert shared.stores == stores
    shared.memory = SimulatedDevice(headroom=stores[1].file_bytes_total + stores[0].buckets[-1].file_size)
    for i, (opt, _, binding) in enumerate(chain):
        for entry, grad in zip(binding.entries, grads(0), strict=True):
            entry.main.grad = grad
        opt.optimizer.step()
        # Nothing moves until every store of the rank has stepped: the peak is not known before.
        assert sum(s.placement["gpu"] for s in stores) == (0 if i == 0 else len(stores[1].buckets) + 1)
    assert stores[1].placement["gpu"] == len(stores[1].buckets) and stores[0].placement["gpu"] == 1
    for store in stores:
        store.close()


def test_a_chain_shares_the_rank_s_overlap_window(tmp_path, monkeypatch):
    """The window is the rank's (--stream-optimizer-state-overlap-gb): the expert store
    holds what the dense one left of it, however the two move their state."""
    from miles_plugins.optimizers.megatron import binding as megatron

    monkeypatch.setattr(megatron, "check_upstream", lambda: None)
    chain = types.SimpleNamespace(chained_optimizers=[dp1_distributed_optimizer(0)[0], dp1_distributed_optimizer(1)[0]])
    # Three quarters of the chain's state: the dense store's whole state, and half the expert's.
    window = 3 * sum(torch.Size(shape).numel() for shape in SHAPES) * 12 // 2
    config = StreamConfig(directory=str(tmp_path / "s"), name="rank0", bucket_cap_elements=3000, overlap_bytes=window)
    bindings = megatron.attach(chain, config)
    try:
        dense, expert = (b.store for b in bindings)
        assert dense.overlap_bytes_bound == dense.state_bytes_total
        assert 0 < expert.config.overlap_bytes == window - dense.state_bytes_total
        assert dense.overlap_bytes_bound + expert.overlap_bytes_bound <= window
        held = []
        for step in range(3):
            for binding in bindings:
                for entry, grad in zip(binding.entries, grads(step), strict=True):
                    entry.main.grad = grad
                binding.dist_opt.optimizer.step()
            held.append(sum(b.store._pipeline.accounting.current for b in bindings))
            for _ in range(3):
                for binding in bindings:
                    binding.store.progress()
                held.append(sum(b.store._pipeline.accounting.current for b in bindings))
        assert 0 < max(held) <= window
    finally:
        for binding in bindings:
            binding.store.close()
