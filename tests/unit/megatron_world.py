"""A world of CPU ranks training a real megatron-core GPT with streamed optimizer state.

Each rank (spawned, gloo) builds ``GPTModel`` with the local layer spec, wraps it
in ``Float16Module`` and ``DistributedDataParallel``, builds the optimizer chain
with ``get_megatron_optimizer`` (dense and, at EP > 1, expert
``DistributedOptimizer``s) and streams each with a real ``MegatronBinding``.

Fakes, because megatron-core allocates on CUDA where this machine has none
(:func:`cpu_for_cuda`): factory calls asking for a CUDA device get the CPU,
``torch.cuda.current_device()`` is "cpu", ``Tensor.cuda()`` returns the tensor
(the tied embedding's all-reduce at PP > 1), and ``Tensor.type()`` names CPU
tensors as CUDA ones (DistributedOptimizer sorts params by those names).

The optimizer state is compared in global terms, by a route apart from the
code under test: each param's local state is placed through Megatron's own
``sharded_state_dict`` of the live model (its ShardedTensors, a factory's parts
built over the state tensor) into each key's global tensor by torch slicing,
summed over the ranks with a count of contributions. Grads and initial params are
functions of global position (:func:`global_values`), so a run at any layout
takes the same Adam steps element by element.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import zlib

import torch

from miles_plugins.optimizers import StreamConfig

STATE = ("main", "exp_avg", "exp_avg_sq")


def cpu_for_cuda() -> None:
    """The fakes named in the module docstring, for this (spawned) process."""
    from torch.overrides import TorchFunctionMode

    class CpuForCuda(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    real_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not (args or kwargs) and "cuda" not in name else name

    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = cuda_type
    CpuForCuda().__enter__()


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout and the model built at it."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    moe: bool = True
    vocab: int = 64
    tied: bool = False
    ddp_bucket: int | None = None  # overlap_grad_reduce with this DDP bucket size

    def __str__(self) -> str:
        return f"tp{self.tp}pp{self.pp}ep{self.ep}"


@dataclasses.dataclass
class World:
    """One rank's model chunks, optimizer chain and bindings at a layout."""

    layout: Layout
    chunks: list
    optimizer: object
    bindings: list

    def close(self) -> None:
        from megatron.core import parallel_state as mpu

        for binding in self.bindings:
            binding.store.close()
        mpu.destroy_model_parallel()


def build(layout: Layout, scratch: str, **config) -> World:
    """This rank's model, optimizer chain and bindings at ``layout``, params set to
    :func:`global_values` ``("param", 0)``; stores ``rank<k>.opt<i>`` under ``scratch``."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from miles_plugins.optimizers.megatron.binding import MegatronBinding

    mpu.initialize_model_parallel(layout.tp, layout.pp, expert_model_parallel_size=layout.ep)
    experts = dict(num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2) if layout.moe else {}
    config_ = TransformerConfig(
        num_layers=4, hidden_size=16, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=32,
        gated_linear_unit=True, add_bias_linear=False, use_cpu_initialization=True, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp, expert_model_parallel_size=layout.ep, **experts,
    )  # fmt: skip
    model = GPTModel(
        config=config_,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4 if layout.moe else None, moe_grouped_gemm=False),
        vocab_size=layout.vocab,
        max_sequence_length=8,
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=layout.tied,
    )
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=layout.ddp_bucket is not None, bucket_size=layout.ddp_bucket
    )
    chunk = DistributedDataParallel(config_, ddp, Float16Module(config_, model))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, bf16=True, use_distributed_optimizer=True),
        [chunk],
    )
    rank = torch.distributed.get_rank()
    members = getattr(optimizer, "chained_optimizers", [optimizer])
    world = World(layout, [chunk], optimizer, [])
    set_params(world, lambda key, shape: global_values(key, shape, "param", 0))
    for i, member in enumerate(members):
        member.reload_model_params()  # the mains from the params just set
        stream = StreamConfig(directory=f"{scratch}/{layout}", name=f"rank{rank}.opt{i}", **config)
        world.bindings.append(MegatronBinding(member, stream))
    return world


def global_values(key: str, shape: tuple[int, ...], what: str, step: int) -> torch.Tensor:
    """A global tensor of ``key`` that depends on nothing but its arguments."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{what}/{step}".encode()))
    return torch.randn(shape, generator=g)


def _parts(chunk, param: torch.nn.Parameter, local: torch.Tensor, sharded: dict) -> list:
    """Megatron's ShardedTensors of ``param``, built over ``local`` (a tensor of its shape)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    sh = sharded[id(param)]
    if isinstance(sh, ShardedTensorFactory):
        return list(nested_values(sh.build_fn(sh.key, local, sh.replica_id, None)))
    return [dataclasses.replace(sh, data=local, dtype=local.dtype)]


def megatron_parts(chunks, param: torch.nn.Parameter) -> list:
    """Megatron's ShardedTensors of ``param``, built over a new tensor of its shape."""
    return _parts(None, param, torch.empty(param.shape), _sharded(chunks))


def _sharded(chunks) -> dict:
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.utils import unwrap_model

    metadata = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True),
    }
    out = {}
    for chunk in chunks:
        for sh in nested_values(unwrap_model(chunk).sharded_state_dict(metadata=metadata)):
            if isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
                out[id(sh.data)] = sh
    return out


def _box(part) -> tuple[slice, ...]:
    shape = (1,) * part.prepend_axis_num + tuple(part.local_shape)
    return tuple(slice(o, o + e) for o, e in zip(part.global_offset, shape, strict=True))


def _primary(part) -> bool:
    replica = part.replica_id if isinstance(part.replica_id, tuple) else (part.replica_id,)
    return all(r == 0 for r in replica[:2])


def set_params(world: World, values) -> None:
    """Every param (each TP/PP/EP copy) from ``values(key, global_shape)``, by Megatron's boxes."""
    sharded = _sharded(world.chunks)
    with torch.no_grad():
        for chunk in world.chunks:
            for _, param in chunk.named_parameters():
                local = torch.empty(param.shape, dtype=torch.float32)
                for part in _parts(chunk, param, local, sharded):
                    part.data.copy_(values(part.key, tuple(part.global_shape))[_box(part)].reshape(part.data.shape))
                param.copy_(local)


def train(world: World, steps: range) -> None:
    """Streamed steps with the grads :func:`global_values` gives each global element."""
    sharded = _sharded(world.chunks)
    for step in steps:
        for binding in world.bindings:
            for entry in binding.entries:
                local = torch.empty(entry.model_param.shape, dtype=torch.float32)
                for part in _parts(None, entry.model_param, local, sharded):
                    part.data.copy_(
                        global_values(part.key, tuple(part.global_shape), "grad", step)[_box(part)].reshape(
                            part.data.shape
                        )
                    )
                entry.main.grad = local.view(-1)[entry.start : entry.start + entry.main.numel()].clone()
        for binding in world.bindings:
            binding.dist_opt.optimizer.step()


def global_state(world: World) -> dict[str, dict[str, torch.Tensor]]:
    """Each key's global main and moments, summed over the ranks' primary copies, with
    ``count`` (contributions per element); ``mismatch``: replica elements that differ."""
    sharded = _sharded(world.chunks)
    local: dict[int, dict[str, torch.Tensor]] = {}
    params = {}
    for binding in world.bindings:
        for entry, *values in binding.iter_state():
            param = entry.model_param
            params[id(param)] = param
            state = local.setdefault(id(param), {w: torch.full((param.numel(),), float("nan")) for w in STATE})
            for what, value in zip(STATE, values, strict=True):
                state[what][entry.start : entry.start + value.numel()] = value
    shapes = {}
    for sh in sharded.values():
        for part in _parts(None, sh.data, torch.empty(sh.data.shape), sharded):
            shapes[part.key] = tuple(part.global_shape)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, shapes)  # a stage holds only its own keys
    shapes = {k: s for theirs in everyone for k, s in theirs.items()}
    out = {k: {w: torch.zeros(s) for w in (*STATE, "count", "mismatch")} for k, s in sorted(shapes.items())}
    replicas = []
    for pid, state in local.items():
        for what in STATE:
            for part in _parts(None, params[pid], state[what].view(params[pid].shape), sharded):
                held = ~torch.isnan(part.data)
                box = out[part.key][what][_box(part)].view(part.data.shape)
                if _primary(part):
                    box[held] += part.data[held]
                    if what == "main":
                        out[part.key]["count"][_box(part)].view(part.data.shape)[held] += 1
                else:
                    replicas.append((part, what, held))
    for key in out:
        for what in ("main", "exp_avg", "exp_avg_sq", "count"):
            torch.distributed.all_reduce(out[key][what])
    for part, what, held in replicas:
        mismatch = out[part.key]["mismatch"][_box(part)].view(part.data.shape)
        mismatch[held] += (out[part.key][what][_box(part)].view(part.data.shape)[held] != part.data[held]).float()
    for key in out:
        torch.distributed.all_reduce(out[key]["mismatch"])
    return out


def differences(a: dict, b: dict, rows: int | None = None) -> list[str]:
    """Where two global states differ (bytes), over their first ``rows`` rows where given."""
    found = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            found.append(f"{key}: in one state only")
            continue
        for what in (*STATE, "count", "mismatch"):
            x, y = a[key][what], b[key][what]
            if rows is not None:
                x, y = x[:rows], y[:rows]
            if x.shape != y.shape or not torch.equal(x.view(torch.int32), y.view(torch.int32)):
                found.append(
                    f"{key} {what}: {x.shape} vs {y.shape}, {int((x != y).sum()) if x.shape == y.shape else '-'} differ"
                )
    return found


def spawn(world_size: int, scenario, *args) -> dict:
    """Run ``scenario(out, *args)`` on ``world_size`` spawned ranks (gloo over a file);
    returns what rank 0 wrote to ``out`` (a JSON file path)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(world_size, os.path.join(tmp, "init"), scenario, out, args), nprocs=world_size)
        with open(out) as f:
            return json.load(f)


def _rank(rank: int, world_size: int, init: str, scenario, out: str, args: tuple) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    cpu_for_cuda()
    torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    try:
        result = scenario(*args)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        torch.distributed.destroy_process_group()
