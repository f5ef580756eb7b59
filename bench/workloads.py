"""The suite's workloads and their modes, as tables (``bench.suite`` runs them).

A workload is a model for Megatron-LM's ``pretrain_gpt.py`` and the modes it is run in;
a mode is where the optimizer state lives (``Placement``: our flags, as data), or
Megatron dev's chunked offload at a fraction, or neither (resident). Every mode names the
baseline it is compared with (its resident, run in the same call) and the peers that
must run beside it (Megatron dev at about its memory). Model flags may hold ``{gpus}``
and ``{layers}``: the GPUs the workload runs on (``torchrun`` processes) and the layers
derived from them (the workload's ``layers_at``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from bench.megatron_dev import dev_flags

GIB = 1 << 30
WARMUP = 3  # iterations whose one-time costs (allocation, auto budgets, graphs) are not timed
MEASURED = 10
QUICK_WARMUP, QUICK_MEASURED = 1, 2
STARTUP_S = 40  # a 1B run's launch, build and first iteration's extra on one H200, with room


@dataclass(frozen=True)
class Placement:
    """Where our streaming puts the state: a ``tier`` home (``host`` or ``disk``; None
    leaves the homes to the budgets), GPU and host budgets (GiB or ``"auto"``), the
    overlap window (GiB held on the GPU across the step), the stored forms, buckets in
    flight and elements per bucket (None: the defaults)."""

    tier: str | None = None
    gpu_budget_gb: float | str | None = None
    host_budget_gb: float | str | None = None
    window_gb: float | None = None
    main_storage: str = "fp32"
    moment_dtype: str = "fp32"
    buckets_in_flight: int | None = None
    bucket_cap: int | None = None

    @property
    def exact(self) -> bool:
        """fp32 and remainder mains are exact; only compact moments are not."""
        return self.moment_dtype == "fp32"


AUTO = Placement(gpu_budget_gb="auto", host_budget_gb="auto")


@dataclass(frozen=True)
class Mode:
    """One run of a workload: ``ours`` (our placement), ``dev_fraction`` (Megatron dev's
    chunked offload of that fraction of the state) or neither (resident, Megatron's own
    optimizer). ``model`` adds to the workload's model flags (layers, recompute);
    ``baseline`` runs in the same call (None: no run to compare with exists); ``peers``
    too; ``expect``: ``"oom"`` (must run out of device memory) or ``"identical"`` (losses
    and params byte-equal to the baseline's at every iteration); ``memory_max_gib``: a
    cgroup limit on host memory, page cache included; ``est_s_per_iter`` plans the calls."""

    name: str
    ours: Placement | None = None
    dev_fraction: float | None = None
    model: tuple[str, ...] = ()
    baseline: str | None = "resident"
    peers: tuple[str, ...] = ()
    expect: str | None = None
    memory_max_gib: float | None = None
    est_s_per_iter: float = 2.0
    warmup: int = WARMUP

    @property
    def kind(self) -> str:
        return "ours" if self.ours else "megatron-dev" if self.dev_fraction is not None else "resident"

    @property
    def exact(self) -> bool | None:
        """Exact against resident: ours by its stored forms; dev's is not checked here."""
        return self.ours.exact if self.ours else None if self.dev_fraction is not None else True


@dataclass(frozen=True)
class Workload:
    """A model (``pretrain_gpt.py`` flags), its modes, and the GPU counts it runs at
    (``gpu_counts``, the first the default)."""

    name: str
    title: str
    model: tuple[str, ...]
    modes: tuple[Mode, ...]
    gpu_counts: tuple[int, ...] = (1,)
    layers_at: Callable[[int], int] | None = None  # the layers at a GPU count, for {layers}
    quick: tuple[str, ...] = ()  # model flags of a smoke run (``--quick``), after the mode's
    startup_s: float = STARTUP_S
    env: dict[str, str] = field(default_factory=dict)

    def mode(self, name: str) -> Mode:
        for mode in self.modes:
            if mode.name == name:
                return mode
        raise KeyError(name)


def split(flags: str) -> tuple[str, ...]:
    return tuple(flags.split())


# The local transformer implementation without fusions: Transformer Engine does not reach
# the GPU machine (GPU_NOTES), and the same kernels run in every mode.
LOCAL = split(
    "--mock-data --tokenizer-type NullTokenizer --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion "
    "--no-persist-layer-norm --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 1 "
    "--lr-decay-iters 100 --bf16 --use-distributed-optimizer --log-interval 1 --eval-iters 0 "
    "--eval-interval 100000 --seed 1234 --ckpt-format torch_dist"
)
EXACT = ("--deterministic-mode",)  # the same kernels in every run: byte identity compares
RECOMPUTE = split("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
HOST = Placement(tier="host")
DISK = Placement(tier="disk")
REMAINDER_8BIT = {"main_storage": "remainder", "moment_dtype": "8bit"}
# The disk modes' host limit: the process needs about 4 GB, the state is 13.7 GB; the page
# cache cannot hold the state, should direct I/O fall back to buffered.
DISK_HOST_GIB = 10


def _dev(fraction: float, est: float) -> Mode:
    return Mode(f"dev@{fraction:g}", dev_fraction=fraction, est_s_per_iter=est)


# 1.15B params, 13.75 GB of fp32 optimizer state: 20 layers, hidden 2048, seq 2048,
# micro-batch 4, global batch 32, untied embeddings.
DENSE_1B = Workload(
    name="dense-1b",
    title="pretrain_gpt.py, 1.15B GPT",
    model=LOCAL
    + split(
        "--vocab-size 32768 --num-layers 20 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
        "--max-position-embeddings 2048 --untie-embeddings-and-output-weights --micro-batch-size 4 "
        "--global-batch-size 32"
    ),
    quick=split("--num-layers 2"),
    gpu_counts=(1, 2, 4, 8),
    modes=(
        Mode("resident", baseline=None, est_s_per_iter=1.95),
        Mode("host", HOST, est_s_per_iter=2.35),
        Mode("host+window-3g", Placement(tier="host", window_gb=3), peers=("dev@1",), est_s_per_iter=2.2),
        # The gpu home sized to sit under dev's lowest peak at fraction 0.5: half-size
        # buckets let it stop between two of a layer's halves.
        Mode(
            "gpu-budget-at-dev@0.5",
            Placement(tier="host", gpu_budget_gb=6.15, buckets_in_flight=6, bucket_cap=32_000_000),
            peers=("dev@0.5",),
            est_s_per_iter=2.1,
        ),
        Mode("disk", DISK, memory_max_gib=DISK_HOST_GIB, est_s_per_iter=17.0),
        Mode(
            "disk-remainder-8bit",
            Placement(tier="disk", **REMAINDER_8BIT),
            memory_max_gib=DISK_HOST_GIB,
            est_s_per_iter=7.5,
        ),
        Mode("auto", AUTO, est_s_per_iter=2.0),
        _dev(0.25, 2.0),
        _dev(0.5, 2.1),
        _dev(0.75, 2.15),
        _dev(1, 2.2),
    ),
)

# hidden 5120, 40 heads, seq 1024, micro-batch 1, global batch 8; the layers set the size
# (gpt_params): 16 = 5.1B, 24 = 7.6B, 50 = 15.8B, 57 = 18.0B.
SCALE_HIDDEN, SCALE_VOCAB, SCALE_SEQ = 5120, 8192, 1024
SCALE_1GPU = Workload(
    name="scale-1gpu",
    title="pretrain_gpt.py at sizes whose state does not fit one GPU",
    model=LOCAL
    + split(
        f"--vocab-size {SCALE_VOCAB} --hidden-size {SCALE_HIDDEN} --num-attention-heads 40 "
        f"--seq-length {SCALE_SEQ} --max-position-embeddings {SCALE_SEQ} --micro-batch-size 1 --global-batch-size 8"
    ),
    quick=split("--num-layers 2"),
    startup_s=90,
    env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"},
    modes=(
        Mode("5.1b-resident", model=("--num-layers", "16", *EXACT), baseline=None, est_s_per_iter=1.0),
        Mode(
            "5.1b-auto",
            AUTO,
            model=("--num-layers", "16", *EXACT),
            baseline="5.1b-resident",
            expect="identical",
            est_s_per_iter=1.1,
        ),
        Mode("7.6b-resident", model=("--num-layers", "24"), baseline=None, expect="oom", est_s_per_iter=1.0),
        Mode("7.6b-auto", AUTO, model=("--num-layers", "24"), baseline="7.6b-resident", est_s_per_iter=1.6),
        Mode(
            "7.6b-auto-remainder-8bit",
            Placement(gpu_budget_gb="auto", host_budget_gb="auto", **REMAINDER_8BIT),
            model=("--num-layers", "24"),
            baseline="7.6b-resident",
            est_s_per_iter=1.8,
        ),
        # The largest found per storage; their resident cannot run (the state alone exceeds
        # the GPU), so they have no baseline. At about 40 s an iteration, one warm-up
        # iteration keeps the run inside a call.
        Mode(
            "15.8b-auto-remainder",
            Placement(gpu_budget_gb="auto", host_budget_gb="auto", main_storage="remainder"),
            model=("--num-layers", "50", *RECOMPUTE),
            baseline=None,
            est_s_per_iter=41.0,
            warmup=1,
        ),
        Mode(
            "18.0b-auto-remainder-8bit",
            Placement(gpu_budget_gb="auto", host_budget_gb="auto", **REMAINDER_8BIT),
            model=("--num-layers", "57", *RECOMPUTE),
            baseline=None,
            est_s_per_iter=7.5,
        ),
    ),
)


@dataclass(frozen=True)
class MoeShape:
    """Qwen3-30B-A3B's shape (its config.json): the headline model of the design this
    project replaces. Every layer is a MoE layer; experts are SwiGLU, no biases."""

    layers: int = 48
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    topk: int = 8
    expert_ffn: int = 768
    vocab: int = 151936
    # The full model's layers spread over this many GPUs (EP = GPUs) is the per-GPU
    # expert load the workload keeps at every GPU count.
    full_model_gpus: int = 8


QWEN3_30B_A3B = MoeShape()


def moe_layer_params(shape: MoeShape = QWEN3_30B_A3B) -> dict[str, int]:
    """One layer's parameters: ``dense`` (attention, norms, router: on every rank) and
    ``expert`` (one expert: split over expert parallelism)."""
    h, d = shape.hidden, shape.head_dim
    attention = h * (shape.heads + 2 * shape.kv_heads) * d + shape.heads * d * h  # qkv, output
    norms = 2 * h + 2 * d  # before attention and MLP; q and k layernorms
    router = h * shape.experts
    return {"dense": attention + norms + router, "expert": 3 * h * shape.expert_ffn}  # SwiGLU fc1 (2x), fc2


def moe_params(layers: int, shape: MoeShape = QWEN3_30B_A3B, active: bool = False) -> int:
    """Parameters of the MoE GPT with ``layers`` layers (untied embeddings, a final
    norm); ``active``: those one token uses (top-k experts)."""
    layer = moe_layer_params(shape)
    experts = shape.topk if active else shape.experts
    return layers * (layer["dense"] + experts * layer["expert"]) + 2 * shape.vocab * shape.hidden + shape.hidden


def moe_layers(gpus: int, shape: MoeShape = QWEN3_30B_A3B) -> int:
    """The layers at ``gpus`` GPUs: each GPU's expert share as in the full model at
    ``full_model_gpus`` (48 at 8, 24 at 4, 12 at 2)."""
    if gpus < 1 or shape.experts % gpus or gpus > shape.full_model_gpus:
        raise ValueError(
            f"the moe workload runs expert-parallel over 1 to {shape.full_model_gpus} GPUs dividing "
            f"{shape.experts} experts, not {gpus}"
        )
    return shape.layers * gpus // shape.full_model_gpus


def moe_resident_bytes_per_gpu(gpus: int, shape: MoeShape = QWEN3_30B_A3B) -> int:
    """What resident training holds per GPU before activations: bf16 params, fp32 grads
    and 12 bytes of optimizer state per param, the experts split over EP = ``gpus`` and
    the dense params' state over DP = ``gpus`` (the distributed optimizer)."""
    layers = moe_layers(gpus, shape)
    layer = moe_layer_params(shape)
    experts = layers * shape.experts // gpus * layer["expert"]
    dense = moe_params(layers, shape) - layers * shape.experts * layer["expert"]
    return experts * (2 + 4 + 12) + dense * (2 + 4) + 12 * dense // gpus


MOE = Workload(
    name="moe",
    title="pretrain_gpt.py, a Qwen3-30B-A3B-shaped MoE GPT, expert-parallel",
    gpu_counts=(8, 4, 2, 1),
    layers_at=moe_layers,
    model=LOCAL
    + split(
        f"--num-layers {{layers}} --hidden-size {QWEN3_30B_A3B.hidden} "
        f"--num-attention-heads {QWEN3_30B_A3B.heads} --group-query-attention "
        f"--num-query-groups {QWEN3_30B_A3B.kv_heads} --kv-channels {QWEN3_30B_A3B.head_dim} --qk-layernorm "
        f"--num-experts {QWEN3_30B_A3B.experts} --moe-router-topk {QWEN3_30B_A3B.topk} "
        f"--moe-ffn-hidden-size {QWEN3_30B_A3B.expert_ffn} --ffn-hidden-size 6144 "
        "--expert-model-parallel-size {gpus} --moe-token-dispatcher-type alltoall "
        "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 "
        "--swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
        f"--rotary-base 1000000 --untie-embeddings-and-output-weights --vocab-size {QWEN3_30B_A3B.vocab} "
        "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 32 "
        "--overlap-grad-reduce --overlap-param-gather"
    ),
    quick=split("--num-layers {gpus} --seq-length 1024 --max-position-embeddings 1024"),
    startup_s=180,
    env={"NCCL_ALGO": "Ring"},
    modes=(
        Mode("resident", baseline=None, est_s_per_iter=6.0),
        Mode("host+auto-gpu", Placement(tier="host", gpu_budget_gb="auto"), est_s_per_iter=7.0),
        Mode(
            "host+auto-gpu-remainder-8bit",
            Placement(tier="host", gpu_budget_gb="auto", **REMAINDER_8BIT),
            est_s_per_iter=7.0,
        ),
    ),
)

WORKLOADS = {w.name: w for w in (DENSE_1B, SCALE_1GPU, MOE)}


def gpt_params(layers: int, hidden: int = SCALE_HIDDEN, vocab: int = SCALE_VOCAB, seq: int = SCALE_SEQ) -> int:
    """A dense GPT's parameters (12 h^2 + 13 h per layer, untied embeddings and output,
    learned positions; what Megatron's local spec builds)."""
    return layers * (12 * hidden**2 + 13 * hidden) + 2 * vocab * hidden + seq * hidden


def model_flags(workload: Workload, mode: Mode, gpus: int, quick: bool = False) -> list[str]:
    """The model's flags for ``mode`` at ``gpus`` GPUs; a smoke run's flags last (they win)."""
    if gpus not in workload.gpu_counts:
        counts = ", ".join(map(str, workload.gpu_counts))
        raise ValueError(f"{workload.name} runs at {counts} GPUs, not {gpus}")
    layers = workload.layers_at(gpus) if workload.layers_at else None
    flags = [*workload.model, *mode.model, *(workload.quick if quick else ())]
    return [flag.format(gpus=gpus, layers=layers) for flag in flags]


def placement_flags(placement: Placement) -> list[str]:
    """Our flags for ``placement`` (after ``--offload-train-disk-dir``)."""
    flags = ["--stream-optimizer-state-to-disk"]
    for value, flag in (
        (placement.tier, "--stream-optimizer-state-tier"),
        (placement.gpu_budget_gb, "--stream-optimizer-state-gpu-budget-gb"),
        (placement.host_budget_gb, "--stream-optimizer-state-host-budget-gb"),
        (placement.window_gb, "--stream-optimizer-state-overlap-gb"),
        (placement.buckets_in_flight, "--stream-optimizer-state-buckets-in-flight"),
        (placement.bucket_cap, "--stream-optimizer-state-bucket-cap"),
    ):
        if value is not None:
            flags += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    if placement.main_storage != "fp32":
        flags += ["--stream-optimizer-state-main-storage", placement.main_storage]
    if placement.moment_dtype != "fp32":
        flags += ["--stream-optimizer-state-moment-dtype", placement.moment_dtype]
    return flags


def mode_flags(mode: Mode, disk_dir: str) -> list[str]:
    """The optimizer's flags of ``mode``: ours, dev's, or none (resident)."""
    if mode.ours:
        return ["--offload-train-disk-dir", disk_dir, *placement_flags(mode.ours)]
    return dev_flags(mode.dev_fraction) if mode.dev_fraction is not None else []


def run_estimate_s(workload: Workload, mode: Mode, quick: bool = False) -> float:
    iterations = QUICK_WARMUP + QUICK_MEASURED if quick else mode.warmup + MEASURED
    return workload.startup_s + iterations * mode.est_s_per_iter


def with_company(workload: Workload, names: list[str]) -> list[list[str]]:
    """Each asked mode with what must run in its call: its baseline first, then itself,
    then its peers (known names only: ``KeyError`` names an unknown one)."""
    groups = []
    for name in names:
        mode = workload.mode(name)
        group = [mode.baseline] if mode.baseline else []
        group += [name, *mode.peers]
        for member in group:
            workload.mode(member)
        groups.append(group)
    return groups


def plan_calls(workload: Workload, names: list[str], budget_s: float, quick: bool = False) -> list[list[str]]:
    """The calls that run ``names``: each mode in a call with its baseline and peers, the
    modes packed into as few calls as their estimated times allow within ``budget_s``
    (a group longer than that gets a call of its own), each call in table order."""
    order = {mode.name: i for i, mode in enumerate(workload.modes)}
    cost = {m.name: run_estimate_s(workload, m, quick) for m in workload.modes}
    calls: list[list[str]] = []
    for group in with_company(workload, names):
        for call in calls:
            added = [m for m in group if m not in call]
            if sum(cost[m] for m in call + added) <= budget_s:
                call.extend(added)
                break
        else:
            calls.append(list(dict.fromkeys(group)))
    return [sorted(call, key=order.__getitem__) for call in calls]
