"""The upstream Megatron functions the binding reproduces or relies on, pinned.

Each pin lists every fingerprint (``megatron_hooks.fingerprint``) the binding
was validated against and where: "GPU tier" means ``make test-gpu`` passed on
that release (bit identity, streamed vs resident); "review" means the diff to
a GPU-validated shape was read and touches only paths the construction guards
refuse (fp8/fp4 params, Megatron FSDP, state offloaders, the precision-aware
optimizer) or nothing the binding uses. A function whose fingerprint is not
listed stops setup (the tripwire); ``ci/matrix.toml`` records which Megatron
commits trip on purpose.

No torch here: the ``drift`` command loads these pins through the
``megatron_hooks.pins`` entry point.
"""

from __future__ import annotations

from megatron_hooks.fingerprint import KnownShape, Pin

DISTRIB = "megatron/core/optimizer/distrib_optimizer.py"
MIXED = "megatron/core/optimizer/optimizer.py"

GPU_0_16 = "core_v0.16.1 55ac708 = megatron-core 0.16.1 (GPU tier)"
GPU_0_18 = "core_v0.18.2 571370c = megatron-core 0.18.2 (GPU tier)"
GPU_0_19 = "megatron-core 0.19.2 = core_v0.19.0 5be9626 (GPU tier)"
GPU_DEV = "dev d48bd6b (GPU tier)"
REVIEW = "{} (review: {})"

PINS: tuple[Pin, ...] = (
    Pin(
        DISTRIB,
        "DistributedOptimizer._copy_main_params_to_model_params",
        (
            KnownShape(
                "bc86c385c68afa19", (GPU_0_16, "core_v0.15.3 309ffca", "core_v0.17.0 9539a12", "radixark 4716f75")
            ),
            KnownShape("6a7d10e5fae0f9cd", (REVIEW.format("megatron-core 0.17.1", "adds the fp4 branch"),)),
            KnownShape("0f768d99a7eedf40", (GPU_0_19, GPU_0_18, "main d98e8a6")),
            KnownShape("ae82fbf9fd301c09", (GPU_DEV,)),
        ),
        "ShardMap.param_buffer_shard reproduces copy_group_params' non-fp8 branch: the world range "
        "'gbuf_world_in_bucket', model_param_gbuf_map's (gbuf, dtype, bucket) order and "
        "buffers[i].buckets[j].param_data; and nothing new must run before the copy (e.g. master weights "
        "brought back from an offload)",
        "miles_plugins.optimizers.megatron.shard_map.ShardMap.param_buffer_shard",
    ),
    Pin(
        DISTRIB,
        "DistributedOptimizer.step_with_ready_grads",
        (
            KnownShape("5f73f8895c7cfca4", (GPU_0_16, "core_v0.15.3 309ffca", "megatron-core 0.17.1")),
            KnownShape("66cafe7d4a93ee83", (GPU_0_19, GPU_0_18, "main d98e8a6")),
            KnownShape(
                "89240bc6e64c0fcc",
                (REVIEW.format("radixark 4716f75, 2e64d78", "state offloader hooks, refused by the guards"),),
            ),
        ),
        "the binding runs upstream's own method (the all-gather tail changed in core_v0.18.0 and is not "
        "reproduced); it must still call MixedPrecisionOptimizer.step_with_ready_grads exactly once before "
        "the param all-gather",
        "miles_plugins.optimizers.megatron.overrides.step_with_ready_grads",
    ),
    Pin(
        MIXED,
        "MixedPrecisionOptimizer.step_with_ready_grads",
        (
            KnownShape("9670b94d11e0cc08", (GPU_0_16, GPU_0_18, "core_v0.15.3 309ffca", "radixark 4716f75")),
            KnownShape("fcfa331c95410768", (GPU_0_19, "main d98e8a6")),
            KnownShape("bcb0204744010799", (GPU_DEV,)),
        ),
        "self.optimizer.step() (the streamed step) must run exactly once, followed by "
        "_copy_main_params_to_model_params (a no-op on a streamed optimizer); any other path to the inner "
        "step bypasses the stream",
        "miles_plugins.optimizers.megatron.overrides.step_with_ready_grads",
    ),
    Pin(
        MIXED,
        "MixedPrecisionOptimizer.reload_model_params",
        (KnownShape("65a7995db6d993eb", (GPU_0_19, GPU_0_16, GPU_0_18, "core_v0.15.3 309ffca", GPU_DEV)),),
        "the binding replaces it with a bucket-by-bucket rebuild of the mains from the params (or a state "
        "dict's params); recheck that upstream still means only that",
        "miles_plugins.optimizers.megatron.binding.MegatronBinding.reload_mains",
    ),
    Pin(
        DISTRIB,
        "DistributedOptimizer._get_model_param_range_map",
        (KnownShape("ae533e493c3bbccb", (GPU_0_19, GPU_0_16, GPU_0_18, "core_v0.15.3 309ffca", GPU_DEV)),),
        "the binding reads the 'param' and 'gbuf_world_in_bucket' ranges of every model param",
        "miles_plugins.optimizers.megatron.shard_map.ShardMap.model_shard",
    ),
    Pin(
        DISTRIB,
        "DistributedOptimizer._build_model_param_gbuf_map",
        (KnownShape("819c09ff760917a3", (GPU_0_19, GPU_0_16, GPU_0_18, "core_v0.15.3 309ffca", GPU_DEV)),),
        "model_param_gbuf_map values must stay (gbuf index, dtype, bucket index): the binding keys streaming "
        "buckets by DDP bucket and finds the param buffer through it",
        "miles_plugins.optimizers.megatron.shard_map.ShardMap.ddp_bucket",
    ),
    Pin(
        DISTRIB,
        "DistributedOptimizer._build_model_gbuf_param_range_map",
        (KnownShape("d2a5e0c55ca3cdf6", (GPU_0_19, GPU_0_16, GPU_0_18, "core_v0.15.3 309ffca", GPU_DEV)),),
        "builds 'gbuf_world_in_bucket' (the param's range in its bucket's param_data) and 'param'",
        "miles_plugins.optimizers.megatron.shard_map.ShardMap.param_buffer_shard",
    ),
    Pin(
        DISTRIB,
        "DistributedOptimizer._build_model_gbuf_range",
        (
            KnownShape("3a0388a269ee99a3", (GPU_0_16, GPU_0_18, "core_v0.15.3 309ffca", GPU_DEV)),
            KnownShape("c0c7babf1ca10926", (REVIEW.format("megatron-core 0.17.1", "nvfp4 unpacked index map"),)),
            KnownShape("0e590b9864682b1e", (GPU_0_19, "main d98e8a6")),
        ),
        "passes each bucket's offset and the world range to _build_model_gbuf_param_range_map",
        "miles_plugins.optimizers.megatron.shard_map.ShardMap.param_buffer_shard",
    ),
    Pin(
        DISTRIB,
        "DistributedOptimizer._build_model_and_main_param_groups",
        (
            KnownShape("8ccc43b206a29696", (GPU_0_16, "core_v0.15.3 309ffca", "core_v0.17.0 9539a12")),
            KnownShape("73a067b4bf5a6d40", (REVIEW.format("megatron-core 0.17.1", "nvfp4 params"),)),
            KnownShape("3c8ca945639cfdfb", (GPU_0_18,)),
            KnownShape("9bc812fb00465317", (GPU_0_19, "main d98e8a6")),
            KnownShape("5bcf2685969c850d", (GPU_DEV,)),
            KnownShape(
                "ce2db64bd72bf2cd",
                (REVIEW.format("radixark 4716f75, 2e64d78", "witness params, detached fp32 shard views"),),
            ),
        ),
        "bf16/fp16 mains must be contiguous fp32 clones of the param shards (the binding evicts their "
        "storage) and fp32 shards views of the param buffer (the binding checks the aliasing)",
        "miles_plugins.optimizers.megatron.shard_map.ShardMap.entries",
    ),
)
