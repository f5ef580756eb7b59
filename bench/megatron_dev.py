"""Megatron-LM dev's chunked optimizer-state offload (NVIDIA/Megatron-LM PR #6244), a peer of
``bench.optimizer_step``'s placement points (``megatron-dev-chunked@<P>``).

Its child process imports dev's ``megatron`` from ``$MEGATRON_DEV_DIR`` (put first on
its ``PYTHONPATH`` by the driver), never the installed megatron-core.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

# Megatron-LM dev's chunked optimizer-state offload (NVIDIA/Megatron-LM PR #6244, seen at dev
# d48bd6be): the checkout the megatron-dev-chunked child imports, and how the parent tells that
# a checkout has the feature (the offloader's module, and the config field that turns it on).
DEV_DIR_ENV = "MEGATRON_DEV_DIR"
DEV_OFFLOADER_FILE = "megatron/core/optimizer/cpu_offloading/chunked_optimizer_state_offload.py"
DEV_CONFIG_FILE = "megatron/core/optimizer/optimizer_config.py"
DEV_CONFIG_FIELD = "chunked_optimizer_state_offload"
# --optimizer-state-offload-chunk-size-mb of the dev points: the dev README's example. The flag's
# default, 0, restores all selected moments at once, so the GPU window is not bounded at all.
DEV_CHUNK_MB = 256


def checkout_missing() -> str | None:
    """Why ``$MEGATRON_DEV_DIR`` is no checkout with dev's chunked offload, or None. Read, not
    imported: the driver keeps the installed megatron-core, the child imports the checkout."""
    root = os.environ.get(DEV_DIR_ENV)
    if not root:
        return f"needs {DEV_DIR_ENV}: a Megatron-LM dev checkout with chunked optimizer-state offload (PR #6244)"
    try:
        with open(os.path.join(root, DEV_CONFIG_FILE)) as f:
            config = f.read()
    except OSError:
        return f"{DEV_DIR_ENV}={root} has no {DEV_CONFIG_FILE}: not a Megatron-LM checkout"
    if DEV_CONFIG_FIELD not in config or not os.path.isfile(os.path.join(root, DEV_OFFLOADER_FILE)):
        return f"{DEV_DIR_ENV}={root} lacks chunked optimizer-state offload (PR #6244: {DEV_OFFLOADER_FILE})"
    return None


def build(
    params: list[torch.Tensor], grads: list[torch.Tensor], fraction: float, chunk_mb: int, adamw: dict
) -> tuple[Callable[[], object], Callable[[], None], dict]:
    """Megatron-LM dev's chunked optimizer-state offload over the bench's model, built as dev's
    training builds it for ``--use-distributed-optimizer --chunked-optimizer-state-offload
    --optimizer-state-offload-fraction F``: a one-rank process group, megatron-core's
    ``DistributedDataParallel`` (bf16 param buffer, fp32 grad buffer) over a module holding
    ``params``, and ``get_megatron_optimizer``, whose ``DistributedOptimizer`` installs the
    offloader (dev d48bd6be: distrib_optimizer.py, ``enable_chunked_optimizer_state_offload``).

    ``grads`` are copied into the grad buffer, and both lists are emptied: the DDP buffers hold
    the params and grads from here on, as in training. Returns ``optimizer.step``, the work
    dev's training loop does between two steps (``offload_optimizer_state_for_forward``: the
    selected masters back to pinned host memory; the moments went back within the step), and
    what the offloader planned. Needs dev's ``megatron`` first on ``sys.path`` and a GPU.
    """
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    dev_dir = os.path.realpath(os.environ.get(DEV_DIR_ENV, ""))
    found = os.path.realpath(megatron.core.__file__)
    if not os.environ.get(DEV_DIR_ENV) or not found.startswith(dev_dir + os.sep):
        raise RuntimeError(
            f"megatron-dev-chunked imported megatron.core from {found}, not from {DEV_DIR_ENV}="
            f"{os.environ.get(DEV_DIR_ENV)!r}: run it through the driver with {DEV_DIR_ENV} set, which "
            "puts that checkout first on the child's PYTHONPATH"
        )
    if not hasattr(OptimizerConfig, DEV_CONFIG_FIELD):
        raise RuntimeError(f"megatron.core at {found} has no {DEV_CONFIG_FIELD} (NVIDIA/Megatron-LM PR #6244)")

    if not torch.distributed.is_initialized():
        # One rank: an in-process store, no port and no file.
        torch.distributed.init_process_group("nccl", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()

    class Params(MegatronModule):
        """The bench's tensors as one module's parameters (megatron's DDP wraps a module)."""

        def __init__(self, config: TransformerConfig, tensors: list[torch.Tensor]) -> None:
            super().__init__(config)
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(t) for t in tensors)

    # DDP takes the model's config; a one-layer bf16 one serves a module that has no forward.
    model_config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
    )
    # What dev's training builds for bf16 with the distributed optimizer: fp32 grads in the
    # buffer (--accumulate-allreduce-grads-in-fp32 is forced for bf16), no overlap flags.
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    module = Params(model_config, params)
    # As dev's wrap_model_chunks_with_ddp (training.py) does: the optimizer's layout, then DDP.
    layout = DistributedOptimizer.compute_full_param_layout(
        list(module.parameters()), ddp_config.bucket_size, 1, ddp_config, expert_data_parallel_world_size=1
    )
    model = DistributedDataParallel(model_config, ddp_config, module, full_param_layout=layout)
    for param, grad in zip(module.parameters(), grads, strict=True):
        param.main_grad.copy_(grad)
    params.clear()
    grads.clear()

    config = OptimizerConfig(
        optimizer="adam",
        lr=adamw["lr"],
        weight_decay=adamw["weight_decay"],
        adam_beta1=adamw["betas"][0],
        adam_beta2=adamw["betas"][1],
        adam_eps=adamw["eps"],
        bf16=True,
        use_distributed_optimizer=True,
        clip_grad=0.0,  # the other modes do not clip: time the update, not a grad-norm pass
        chunked_optimizer_state_offload=True,
        optimizer_state_offload_fraction=fraction,
        optimizer_state_offload_chunk_size_mb=chunk_mb,
    )
    # No overrides: every tensor here stands for a matrix, so all get weight decay, as in the
    # other modes (the standard overrides would exempt them for being 1-D).
    optimizer = get_megatron_optimizer(config, [model], config_overrides={})
    # The offloader is dev's private attribute (optimizer.py, MegatronOptimizer.__init__); a
    # point whose optimizer has none would time a resident step under an offload label.
    managers = [m for o in optimizer.chained_optimizers if (m := o._optimizer_state_offloader) is not None]
    if fraction > 0 and not managers:
        raise RuntimeError(
            f"get_megatron_optimizer installed no chunked offloader at fraction {fraction}: "
            "dev installs it from DistributedOptimizer only (use_distributed_optimizer)"
        )
    total = sum(p.numel() for o in optimizer.chained_optimizers for g in o.optimizer.param_groups for p in g["params"])
    selected = sum(p.numel() for m in managers for p in m.selected_params)
    planned = {
        "host_fraction": selected / total,
        "chunks": sum(len(m.chunks) for m in managers),
        "chunk_mb": chunk_mb,
        "accounted_pinned_bytes": 12 * selected,  # fp32 main + two fp32 moments per selected param
        "inner_optimizer": ", ".join(sorted({type(o.optimizer).__name__ for o in optimizer.chained_optimizers})),
    }
    return optimizer.step, optimizer.offload_optimizer_state_for_forward, planned
