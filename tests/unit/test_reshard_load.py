"""A streamed state saved at DP=N resumes at DP=M, byte for byte.

Each DP rank is a real ``StreamingStore`` over its shard of every param (Megatron's
sharding, ``helpers.megatron_shards``: contiguous ranges of a padded buffer,
cutting params anywhere), all in one process. The reference is independent: one
plain ``torch.optim.AdamW`` over the whole fp32 params, never saved or sharded.
Adam is elementwise, so the sharded runs must match it exactly, before and after
the resume: mains, both moments, and the bf16 params.
"""

import os
import shutil

import pytest
import torch

from miles_plugins.optimizers import CheckpointMismatchError, StreamConfig
from miles_plugins.optimizers.formats import quant8
from miles_plugins.optimizers.step.adam import backend_for
from miles_plugins.optimizers.step.entries import Entry
from miles_plugins.optimizers.store.streaming_store import StreamingStore
from tests.helpers import REPO, as_format, ckpt_cli, megatron_param_layout, megatron_shards, rewrite_manifest
from tests.unit.reference import same_bytes

pytest.importorskip("megatron.core.optimizer.distrib_optimizer")  # Megatron's sharding (helpers.megatron_shards)

# Names, sizes and master groups (decay, no decay, frozen); "norm" is an fp32 param
# (its moments streamed, or resident: fp32-moments-resident); "tied" holds mains halfway between two bf16 values, which remainder
# mains keep as exceptions, and its group's lr of 0 keeps them so.
PARAMS = {
    "emb": (6000, 0),
    "w1": (1, 1),
    "tied": (5000, 2),
    "twin_a": (2048, 0),
    "twin_b": (2048, 0),
    "w3": (4100, 0),
    "bias": (130, 1),
    "norm": (300, 1),
}
FP32 = {"norm"}
GROUP_LR = (1e-2, 1e-2, 0.0)
MODEL = [[(name, numel) for name, (numel, _) in PARAMS.items()]]  # one DDP bucket
DECAY = 0.1
SAVE_AT, STEPS = 3, 6


def grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(numel, generator=g) for name, (numel, _) in PARAMS.items()}


def initial() -> dict[str, torch.Tensor]:
    """Every param's fp32 main before the first step."""
    g = torch.Generator().manual_seed(7)
    mains = {}
    for name, (numel, _) in PARAMS.items():
        value = torch.randn(numel, generator=g)
        if name not in FP32:
            value = value.bfloat16().float()
        if name == "tied":
            value = (value.view(torch.int32) + 0x8000).view(torch.float32)
        mains[name] = value
    return mains


def param_groups(mains_of_group) -> list[dict]:
    return [{"params": mains_of_group(g), "lr": lr, "weight_decay": DECAY * (g == 0)} for g, lr in enumerate(GROUP_LR)]


def reference(steps: int):
    """Whole params, plain AdamW; returns {name: (param, main, exp_avg, exp_avg_sq)}."""
    mains = initial()
    optimizer = torch.optim.AdamW(param_groups(lambda g: [m for n, m in mains.items() if PARAMS[n][1] == g]))
    for step in range(steps):
        for name, grad in grads(step).items():
            mains[name].grad = grad
        optimizer.step()
    return {
        n: (m if n in FP32 else m.bfloat16(), m, optimizer.state[m]["exp_avg"], optimizer.state[m]["exp_avg_sq"])
        for n, m in mains.items()
    }


class Rank:
    """One DP rank: its params (bf16 shards, or the fp32 param's shard itself) and a store."""

    def __init__(self, tmp_path, dp: int, rank: int, pieces, config: dict) -> None:
        values = initial()
        self.entries, self.pieces = [], pieces
        for piece in pieces:
            main = values[piece.key][piece.start : piece.start + piece.numel].clone()
            param = main if piece.key in FP32 else main.bfloat16()
            group = PARAMS[piece.key][1]
            self.entries.append(Entry(param, main, group, name=piece.key, start=piece.start))
        # Entries are listed group by group, as the master's param groups hold them.
        self.entries.sort(key=lambda e: e.group_index)
        master = torch.optim.AdamW(param_groups(lambda g: [e.main for e in self.entries if e.group_index == g]))
        topology = {
            "shard_peers": {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0},
            "dp_size": dp,
            "dp_rank": rank,
        }
        self.store = StreamingStore(
            self.entries,
            backend_for(master),
            StreamConfig(
                directory=str(tmp_path / f"scratch_dp{dp}"),
                name=f"rank{rank}.opt0",
                **{"bucket_cap_elements": 2500, **config},
            ),
            copy_to_model=lambda e: e.param.copy_(e.main) if e.param is not e.main else None,
            topology=topology,
            param_layout=megatron_param_layout(MODEL),
        )

    def step(self, step: int) -> None:
        full = grads(step)
        for e in self.entries:
            e.main.grad = full[e.name][e.start : e.start + e.main.numel()]
        self.store.step()

    def load_params(self, saved) -> None:
        for e in self.entries:
            e.param.copy_(saved[e.name][0][e.start : e.start + e.param.numel()])

    def check(self, expected) -> None:
        for index, main, exp_avg, exp_avg_sq in self.store.iter_state():
            e = self.entries[index]
            cut = slice(e.start, e.start + main.numel())
            param, ref_main, ref_avg, ref_sq = expected[e.name]
            assert same_bytes(e.param, param[cut]), e.name
            assert same_bytes(main, ref_main[cut]) and same_bytes(exp_avg, ref_avg[cut]), e.name
            assert same_bytes(exp_avg_sq, ref_sq[cut]), e.name


def ranks(tmp_path, dp: int, config: dict, model=MODEL) -> list[Rank]:
    shards, _ = megatron_shards(model, dp)
    return [Rank(tmp_path, dp, r, shards[r], config) for r in range(dp)]


def _saved(tmp_path, dp: int, config: dict | None = None, steps: int = 1, iteration: str | None = None):
    """Every rank of DP=``dp`` takes ``steps`` steps and saves into ``tmp_path/ckpt``, or into
    the ``streamed_optimizer_state/`` of ``tmp_path/ckpt/<iteration>``; returns that iteration's
    directory (None without one)."""
    saved = tmp_path / "ckpt" / iteration if iteration else None
    for rank in ranks(tmp_path / "a", dp, config or {}):
        for step in range(steps):
            rank.step(step)
        rank.store.save_to(str(saved / "streamed_optimizer_state" if saved else tmp_path / "ckpt"))
        rank.store.close()
    return saved


CONFIGS = {
    "disk-fp32": dict(),  # the fp32 "norm" param's moments stream (in a bucket of their own)
    "fp32-moments-resident": dict(fp32_param_moments="resident"),
    "disk-remainder": dict(main_storage="remainder"),
    "host-pipelined": dict(tier="host"),
    "disk-sync": dict(engine="sync"),
}


@pytest.mark.parametrize("saved_dp, new_dp", [(2, 3), (3, 1), (1, 4), (4, 2), (2, 2)])
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_a_state_saved_at_one_dp_size_resumes_at_another_byte_for_byte(tmp_path, saved_dp, new_dp, config):
    saving = ranks(tmp_path / "a", saved_dp, CONFIGS[config])
    for step in range(SAVE_AT):
        for rank in saving:
            rank.step(step)
    for rank in saving:
        rank.check(reference(SAVE_AT))
        rank.store.save_to(str(tmp_path / "ckpt"))
        rank.store.close()
    resumed = ranks(tmp_path / "b", new_dp, CONFIGS[config])
    for rank in resumed:
        rank.load_params(reference(SAVE_AT))  # Megatron's own checkpoint restores (and reshards) the params
        assert rank.store.load_from(str(tmp_path / "ckpt"), expected_steps=SAVE_AT)
    for step in range(SAVE_AT, STEPS):
        for rank in resumed:
            rank.step(step)
    expected = reference(STEPS)
    for rank in resumed:
        rank.check(expected)
        rank.store.close()


def test_a_saved_rank_missing_is_named_and_nothing_changes(tmp_path):
    _saved(tmp_path, 3)
    import shutil

    shutil.rmtree(tmp_path / "ckpt" / "rank1.opt0")
    resumed = ranks(tmp_path / "b", 2, {})
    with pytest.raises(CheckpointMismatchError, match=r"param '\w+': elements \[\d+, \d+\) are in no saved piece"):
        resumed[0].store.load_from(str(tmp_path / "ckpt"))
    resumed[0].step(0)  # untouched by the refused load: it steps from its own initial state
    resumed[0].check(reference(1))
    for rank in resumed:
        rank.store.close()


def test_a_flipped_byte_in_a_block_read_is_refused(tmp_path):
    _saved(tmp_path, 2)
    path = tmp_path / "ckpt" / "rank0.opt0" / "bucket_00000.bin"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    resumed = ranks(tmp_path / "b", 3, {})
    with pytest.raises(
        CheckpointMismatchError, match=r"bucket_00000.bin: block 0: CRC-32 .* the checkpoint is corrupt"
    ):
        resumed[0].store.load_from(str(tmp_path / "ckpt"))
    for rank in resumed:
        rank.store.close()


def _roundtrip(x: torch.Tensor, moment: str) -> torch.Tensor:
    """``x`` stored in 8 bits in blocks starting at ``x[0]`` and read back (fp32 below one block)."""
    if not quant8.quantizes(x.numel()):
        return x
    signed, sqrt = quant8.MOMENT_FORMATS[moment]
    decoded = quant8.dequantize_chunk(*quant8.quantize_chunk(x, signed, sqrt), signed)
    return decoded.square() if sqrt else decoded


@pytest.mark.parametrize("saved_dp, new_dp", [(2, 3), (3, 1)])
def test_8bit_moments_reshard_by_quantizing_the_saved_values_in_the_new_blocks(tmp_path, saved_dp, new_dp):
    saving = ranks(tmp_path / "a", saved_dp, dict(moment_dtype="8bit"))
    # What was saved, gathered in param space: (param, main, exp_avg, exp_avg_sq), moments as stored, decoded.
    saved = {}
    for name, (numel, _) in PARAMS.items():
        saved[name] = [torch.empty(numel, dtype=torch.float32 if name in FP32 else torch.bfloat16)]
        saved[name] += [torch.empty(numel) for _ in range(3)]
    for rank in saving:
        for step in range(2):
            rank.step(step)
        for index, *state in rank.store.iter_state():
            e = rank.entries[index]
            for full, value in zip(saved[e.name], (e.param, *state), strict=True):
                full[e.start : e.start + value.numel()] = value
        rank.store.save_to(str(tmp_path / "ckpt"))
        rank.store.close()
    resumed = ranks(tmp_path / "b", new_dp, dict(moment_dtype="8bit"))
    for rank in resumed:
        rank.load_params(saved)
        assert rank.store.load_from(str(tmp_path / "ckpt"), expected_steps=2)
        for index, main, exp_avg, exp_avg_sq in rank.store.iter_state():
            e = rank.entries[index]
            cut = slice(e.start, e.start + main.numel())
            assert same_bytes(main, saved[e.name][1][cut]), e.name  # mains stay exact
            moments = zip((exp_avg, exp_avg_sq), ("exp_avg", "exp_avg_sq"), saved[e.name][2:], strict=True)
            for moment, name, full in moments:
                # The fp32 "norm" is whole in one rank at both sizes: its blocks line up and
                # requantizing its decoded values gives them back exactly.
                stored = full[cut] if e.name in FP32 else _roundtrip(full[cut], name)
                assert same_bytes(moment, stored), (e.name, name)
        rank.step(2)  # and it trains on
        rank.store.close()


@pytest.mark.parametrize(
    "change, config, model",
    [
        ("bucket cap", dict(bucket_cap_elements=1000), MODEL),
        ("param order in the buffer", {}, [MODEL[0][::-1]]),
        # Two params of one size trade places: every entry keeps its size, so only the pieces tell.
        (
            "same sizes, other params",
            {},
            [[{"twin_a": ("twin_b", 2048), "twin_b": ("twin_a", 2048)}.get(n, (n, k)) for n, k in MODEL[0]]],
        ),
    ],
)
def test_another_layout_at_the_same_dp_size_is_rebuilt_from_the_saved_pieces(tmp_path, change, config, model):
    """Same topology, other entries: the saved pieces, not the sizes, decide what goes where."""
    _saved(tmp_path, 2, steps=SAVE_AT)
    resumed = ranks(tmp_path / "b", 2, config, model)
    for rank in resumed:
        rank.load_params(reference(SAVE_AT))
        assert rank.store.load_from(str(tmp_path / "ckpt"), expected_steps=SAVE_AT)
        rank.step(SAVE_AT)
    for rank in resumed:
        rank.check(reference(SAVE_AT + 1))
        rank.store.close()


def test_a_saved_layout_this_version_would_not_write_is_refused(tmp_path):

    _saved(tmp_path, 2)
    rewrite_manifest(tmp_path / "ckpt" / "rank1.opt0" / "manifest.json", lambda d: d["layout"][0].update(size=123))
    resumed = ranks(tmp_path / "b", 1, {})
    with pytest.raises(CheckpointMismatchError, match="bucket_00000.bin is laid out for 123 bytes"):
        resumed[0].store.load_from(str(tmp_path / "ckpt"))
    resumed[0].store.close()


def test_a_checkpoint_from_before_param_ranges_says_it_loads_only_at_its_own_size(tmp_path):

    _saved(tmp_path, 1)

    def to_format_2(data):
        as_format(tmp_path / "ckpt" / "rank0.opt0", 2)(data)
        del data["pieces"], data["resident_pieces"], data["topology"]["shard_peers"]

    rewrite_manifest(tmp_path / "ckpt" / "rank0.opt0" / "manifest.json", to_format_2)
    resumed = ranks(tmp_path / "b", 2, {})
    for rank in resumed:  # rank 0 finds its own name, rank 1 only another rank's save
        with pytest.raises(CheckpointMismatchError, match="saved before checkpoints recorded each entry's param range"):
            rank.store.load_from(str(tmp_path / "ckpt"))
        rank.store.close()
    again = ranks(tmp_path / "c", 1, {})  # at its own size it still loads
    assert again[0].store.load_from(str(tmp_path / "ckpt"))
    again[0].store.close()


def test_other_tp_sizes_without_param_keys_are_refused_in_one_line_naming_them(tmp_path):
    """Saves that record no param keys and global boxes (here: no Megatron model) load
    only at their own TP, PP and EP sizes, with or without a save of this rank's name."""

    _saved(tmp_path, 2)
    for r in range(2):
        path = tmp_path / "ckpt" / f"rank{r}.opt0" / "manifest.json"
        rewrite_manifest(path, lambda d: d["topology"]["shard_peers"].update(tp_size=2))
    resumed = ranks(tmp_path / "b", 3, {})
    for rank in (resumed[2], resumed[0]):
        with pytest.raises(CheckpointMismatchError) as refused:
            rank.store.load_from(str(tmp_path / "ckpt"))
        message = str(refused.value)
        assert "\n" not in message and "saved with pp_size 1, tp_size 2 (this run: pp_size 1, tp_size 1)" in message
        assert "record(s) no param keys and global boxes" in message and "--no-load-optim" in message
    for rank in resumed:
        rank.store.close()


@pytest.mark.parametrize("config", ["disk-fp32", "disk-remainder", "fp32-moments-resident"])
def test_ckpt_reshard_writes_the_stores_a_run_at_the_new_size_loads_as_its_own(tmp_path, config, monkeypatch, capsys):
    """Offline, through the same reads and plan; the new ranks then load without resharding."""
    from miles_plugins.optimizers.checkpoint import cli as ckpt
    from miles_plugins.optimizers.checkpoint import reader

    saved = _saved(tmp_path, 2, CONFIGS[config], SAVE_AT, "iter_0000003")
    out = tmp_path / "new" / "iter_0000003"
    assert ckpt.main(["reshard", str(saved), "--dp", "3", "--out", str(out)]) == 0
    assert ckpt.main(["inspect", str(out)]) == 0
    monkeypatch.setattr(reader, "ReshardedLoad", None)  # a load that resharded would fail here
    resumed = ranks(tmp_path / "b", 3, CONFIGS[config])
    for rank in resumed:
        rank.load_params(reference(SAVE_AT))
        assert rank.store.load_from(str(out / "streamed_optimizer_state"), expected_steps=SAVE_AT)
        for step in range(SAVE_AT, STEPS):
            rank.step(step)
        rank.check(reference(STEPS))
        rank.store.close()
    assert ckpt.main(["reshard", str(saved), "--dp", "3", "--out", str(out)]) == 1
    assert "exists already" in capsys.readouterr().err  # never over a checkpoint


def test_ckpt_reshard_of_a_corrupted_checkpoint_exits_1_and_leaves_nothing(tmp_path, capsys):
    from miles_plugins.optimizers.checkpoint import cli as ckpt

    saved = _saved(tmp_path, 2, iteration="iter_0000001")
    path = saved / "streamed_optimizer_state" / "rank1.opt0" / "bucket_00001.bin"
    data = bytearray(path.read_bytes())
    data[7] ^= 1
    path.write_bytes(bytes(data))
    out = tmp_path / "new" / "iter_0000001"
    assert ckpt.main(["reshard", str(saved), "--dp", "3", "--out", str(out)]) == 1
    assert "rank1.opt0/bucket_00001.bin: block 0: CRC-32" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # nothing written, not even the directories it made


def test_ckpt_reshard_refuses_a_checkpoint_with_tensor_parallelism(tmp_path, capsys):
    from miles_plugins.optimizers.checkpoint import cli as ckpt

    saved = _saved(tmp_path, 2, iteration="iter_0000001")
    for r in range(2):
        path = saved / "streamed_optimizer_state" / f"rank{r}.opt0" / "manifest.json"
        rewrite_manifest(path, lambda d: d["topology"]["shard_peers"].update(tp_size=2))
    assert ckpt.main(["reshard", str(saved), "--dp", "1", "--out", str(tmp_path / "new")]) == 1
    refused = capsys.readouterr().err
    assert (
        "saved with pp_size 1, tp_size 2 by a version (or from a model) that did not record each param's key" in refused
    )
    assert "loads only at its own TP, PP and EP sizes" in refused and refused.count("\n") == 1


def test_a_save_cut_off_while_replacing_is_read_from_its_previous_copy(tmp_path):
    """As a load of its own save does: .<name>.previous is the previous complete save."""
    _saved(tmp_path, 2)
    (tmp_path / "ckpt" / "rank1.opt0").rename(tmp_path / "ckpt" / ".rank1.opt0.previous")
    resumed = ranks(tmp_path / "b", 1, {})
    resumed[0].load_params(reference(1))
    assert resumed[0].store.load_from(str(tmp_path / "ckpt"), expected_steps=1)
    resumed[0].step(1)
    resumed[0].check(reference(2))
    resumed[0].store.close()


@pytest.mark.parametrize("config", ["8bit", "bf16", "host"])
def test_ckpt_reshard_gives_the_state_an_online_reshard_gives(tmp_path, config):
    """Every storage format: the stores written offline, loaded as their own, hold what
    a resharded load of the original checkpoint holds."""
    from miles_plugins.optimizers.checkpoint import cli as ckpt

    settings = {"8bit": dict(moment_dtype="8bit"), "bf16": dict(moment_dtype="bf16"), "host": dict(tier="host")}[config]
    saved = _saved(tmp_path, 2, settings, 2, "iter_0000002")
    out = tmp_path / "new" / "iter_0000002"
    assert ckpt.main(["reshard", str(saved), "--dp", "3", "--out", str(out)]) == 0
    online = ranks(tmp_path / "b", 3, settings)
    offline = ranks(tmp_path / "c", 3, settings)
    for a, b in zip(online, offline, strict=True):
        assert a.store.load_from(str(saved / "streamed_optimizer_state"), expected_steps=2)
        assert b.store.load_from(str(out / "streamed_optimizer_state"), expected_steps=2)
        for (_, *x), (_, *y) in zip(a.store.iter_state(), b.store.iter_state(), strict=True):
            assert all(same_bytes(u, v) for u, v in zip(x, y, strict=True))
        a.store.close()
        b.store.close()


@pytest.mark.parametrize("inside", ["streamed_optimizer_state/rank2.opt0", "streamed_optimizer_state/dp3", "."])
def test_ckpt_reshard_never_writes_into_the_state_it_reads(tmp_path, inside, capsys):
    from miles_plugins.optimizers.checkpoint import cli as ckpt

    saved = _saved(tmp_path, 2, iteration="iter_0000002")
    assert ckpt.main(["reshard", str(saved), "--dp", "3", "--out", str(saved / inside)]) == 1
    assert "lies inside the state it reads" in capsys.readouterr().err
    assert ckpt.main(["inspect", str(saved)]) == 0  # untouched


def test_ckpt_reshard_refuses_saved_ranks_of_different_formats(tmp_path, capsys):
    from miles_plugins.optimizers.checkpoint import cli as ckpt

    saved = _saved(tmp_path, 2, iteration="iter_0000002")
    path = saved / "streamed_optimizer_state" / "rank1.opt0" / "manifest.json"
    rewrite_manifest(path, lambda d: d.update(optimizer_class="torch.optim.adam.Adam"))
    assert ckpt.main(["reshard", str(saved), "--dp", "3", "--out", str(tmp_path / "new")]) == 1
    assert "rank1.opt0: optimizer class differs" in capsys.readouterr().err


def test_ckpt_reshard_says_a_plain_pytorch_save_has_no_parallelism_to_reshard(tmp_path, capsys):
    from miles_plugins.optimizers import StreamedOptimizer
    from miles_plugins.optimizers.checkpoint import cli as ckpt

    param = torch.nn.Parameter(torch.randn(1000, dtype=torch.bfloat16))
    front = StreamedOptimizer(torch.optim.AdamW([param]), StreamConfig(directory=str(tmp_path / "s"), name="rank0"))
    param.grad = torch.randn_like(param)
    front.step()
    saved = tmp_path / "ckpt" / "iter_0000001"
    front.save_to(str(saved / "streamed_optimizer_state"))
    front.close()
    assert ckpt.main(["reshard", str(saved), "--dp", "2", "--out", str(tmp_path / "new")]) == 1
    assert "no parallel topology: a plain-PyTorch save" in capsys.readouterr().err


def test_ckpt_reshard_refuses_an_output_another_reshard_is_writing(tmp_path, capsys):
    """Two reshards into one place: the second is refused while the first holds the
    output's lock (it used to remove the first's partial output, which then
    renamed what was left into place and reported success)."""
    from miles_plugins.optimizers.checkpoint import cli as ckpt
    from miles_plugins.optimizers.homes.locks import lock_file, unlock_file

    saved = _saved(tmp_path, 2, iteration="iter_0000002")
    out = tmp_path / "new" / "iter_0000002"
    state = out / "streamed_optimizer_state"
    out.mkdir(parents=True)
    # Stand-ins for a running reshard (another process in use; flock is per open file, so
    # a lock taken here excludes the command's own open of the file as it would another's).
    (out / "streamed_optimizer_state.partial").mkdir()
    held = lock_file(f"{state}.lock", 0)
    try:
        assert ckpt.main(["reshard", str(saved), "--dp", "3", "--out", str(out)]) == 1
        assert f"a reshard into {state} is refused: another is under way" in capsys.readouterr().err
        assert (out / "streamed_optimizer_state.partial").exists(), "a running reshard's output is left alone"
    finally:
        unlock_file(f"{state}.lock", held)
    # Once that run is gone, its partial output is stale: removed, and the reshard completes.
    assert ckpt.main(["reshard", str(saved), "--dp", "3", "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["streamed_optimizer_state"]
    assert ckpt.main(["inspect", str(out)]) == 0


def test_ckpt_reshard_names_a_missing_store_instead_of_failing_inside(tmp_path, capsys):
    from miles_plugins.optimizers.checkpoint import cli as ckpt

    saved = _saved(tmp_path, 2, iteration="iter_0000002")
    shutil.rmtree(saved / "streamed_optimizer_state" / "rank0.opt0")
    assert ckpt.main(["reshard", str(saved), "--dp", "3", "--out", str(tmp_path / "new")]) == 1
    err = capsys.readouterr().err
    assert "saved by 2 ranks, and the store of rank(s) [0] is missing (rank0.opt0)" in err, err
    assert "Traceback" not in err and not (tmp_path / "new").exists()


def test_ckpt_reshard_checks_free_space_before_writing(tmp_path, capsys, monkeypatch):
    from miles_plugins.optimizers.checkpoint import cli as ckpt
    from miles_plugins.optimizers.homes import fs

    saved = _saved(tmp_path, 2, iteration="iter_0000002")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(fs.shutil, "disk_usage", lambda path: usage._replace(free=4096))  # a nearly full drive
    assert ckpt.main(["reshard", str(saved), "--dp", "3", "--out", str(tmp_path / "new")]) == 1
    said = capsys.readouterr()
    assert "not enough free space for the resharded state" in said.err
    assert "is not an iteration directory (iter_<N> or release)" in said.out  # "new": a checkpoint root, say
    assert not (tmp_path / "new").exists()


def test_ckpt_reshard_cancelled_by_sigterm_leaves_nothing(tmp_path):
    """A scheduler's cancel (SIGTERM) part way: the partial output, its lock and the
    directories made for it go; the exit status says so."""
    import signal
    import subprocess
    import sys

    saved = _saved(tmp_path, 2, iteration="iter_0000002")
    out = tmp_path / "new" / "iter_0000002"
    cmd = [sys.executable, "-m", "miles_plugins.optimizers.ckpt", "reshard", str(saved), "--dp", "4000"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen([*cmd, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as run:
        assert run.stdout.readline().startswith(b"rank0.opt0: "), "the first new store is written"
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=60)
    assert run.returncode == 143 and b"reshard terminated (SIGTERM): nothing was written" in err, err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("stray", ["symlink", "copy"])
def test_ckpt_reshard_refuses_a_store_a_load_would_not_read(tmp_path, capsys, stray):
    from miles_plugins.optimizers.checkpoint import cli as ckpt

    saved = _saved(tmp_path, 2, iteration="iter_0000002")
    state = saved / "streamed_optimizer_state"
    if stray == "symlink":
        shutil.move(state / "rank1.opt0", tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", state / "rank1.opt0")
        reason = "rank1.opt0 is not a plain directory (a load refuses it)"
    else:
        shutil.copytree(state / "rank1.opt0", state / "rank1.opt0.bak")
        reason = "rank1.opt0.bak: not named as a Megatron chain's stores are"
    assert ckpt.main(["reshard", str(saved), "--dp", "3", "--out", str(tmp_path / "new")]) == 1
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_ckpt_reshard_goes_on_unlocked_where_the_filesystem_has_no_flock(tmp_path, capsys, monkeypatch):
    """Lustre mounted noflock, NFS without a lock manager: flock fails with ENOLCK (faked
    here: this machine's filesystems have flock). The reshard says so and completes."""
    import errno
    import fcntl

    from miles_plugins.optimizers.checkpoint import cli as ckpt

    saved = _saved(tmp_path, 2, iteration="iter_0000002")

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "new" / "iter_0000002"
    assert ckpt.main(["reshard", str(saved), "--dp", "3", "--out", f"{out}/"]) == 0  # a trailing slash too
    assert "has no flock (No locks available): a reshard into" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["streamed_optimizer_state"], "no lock file, no partial output left"
    monkeypatch.undo()
    assert ckpt.main(["inspect", str(out)]) == 0


def test_ckpt_reshard_of_a_removed_moment_dtype_is_refused_in_one_line_as_a_load_refuses_it(tmp_path):
    """A save from a version that offered fp16 moments: the command says what the online
    load says (it died with a KeyError traceback), exit 1 as for any checkpoint it cannot read."""
    from miles_plugins.optimizers.checkpoint.manifest import removed_moment_dtype

    saved = _saved(tmp_path, 2, iteration="iter_0000001")
    for r in range(2):
        path = saved / "streamed_optimizer_state" / f"rank{r}.opt0" / "manifest.json"
        rewrite_manifest(path, lambda d: d.update(moment_dtype="fp16"))
    out = tmp_path / "new" / "iter_0000001"
    result = ckpt_cli("reshard", str(saved), "--dp", "1", "--out", str(out))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == (
        f"cannot reshard {saved}: cannot reshard the opt0 stores offline: {removed_moment_dtype({'moment_dtype': 'fp16'})}"
    )
    assert not (tmp_path / "new").exists()


def test_ckpt_inspect_reports_a_removed_and_reshard_an_unknown_moment_dtype(tmp_path):
    """Sound files in a format a load refuses are a problem for inspect (it exited 0); a dtype
    this version never knew (a newer version's save) is refused by reshard in one line (it
    was a KeyError traceback)."""
    from miles_plugins.optimizers.checkpoint.manifest import removed_moment_dtype

    saved = _saved(tmp_path, 2, iteration="iter_0000001")
    manifests = [saved / "streamed_optimizer_state" / f"rank{r}.opt0" / "manifest.json" for r in range(2)]
    for path in manifests:
        rewrite_manifest(path, lambda d: d.update(moment_dtype="fp16"))
    inspected = ckpt_cli("inspect", str(saved))
    assert inspected.returncode == 1 and removed_moment_dtype({"moment_dtype": "fp16"}) in inspected.stdout
    for path in manifests:
        rewrite_manifest(path, lambda d: d.update(moment_dtype="fp4"))
    result = ckpt_cli("reshard", str(saved), "--dp", "1", "--out", str(tmp_path / "new" / "iter_0000001"))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "its moments are stored as 'fp4', which this version does not know" in result.stderr
    assert not (tmp_path / "new").exists()


def test_ckpt_reshard_passes_a_stray_file_by_as_a_load_does(tmp_path, capsys):
    """A note beside the stores blocked the rewrite ("not a plain directory (a load
    refuses it)"), though loads never read it."""
    from miles_plugins.optimizers.checkpoint import cli as ckpt

    saved = _saved(tmp_path, 2, iteration="iter_0000001")
    (saved / "streamed_optimizer_state" / "NOTES.txt").write_text("copied from cluster A\n")
    out = tmp_path / "new" / "iter_0000001"
    assert ckpt.main(["reshard", str(saved), "--dp", "1", "--out", str(out)]) == 0, capsys.readouterr().err
    assert sorted(os.listdir(out / "streamed_optimizer_state")) == ["rank0.opt0"]
