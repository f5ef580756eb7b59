"""A streamed state saved at one TP/PP/DP layout resumes at another, in one process.

Each rank is a real ``StreamingStore`` over its DP shard of every param it holds
at its TP and PP coordinates, recording hand-made Megatron facts (keys, boxes,
replica ids, a SwiGLU factory's two parts, a TP-replicated fp32 norm, layers on a
prepended axis split by PP, a padded vocabulary). Grads and initial values are
functions of global position, and every check is in global terms: this test's
own placement of each part (torch slicing of its box) against the resharded
load's flat-run arithmetic. The Megatron-built counterpart is ``test_topology.py``.
"""

import math
import zlib

import pytest
import torch

from miles_plugins.optimizers import CheckpointMismatchError, StreamConfig
from miles_plugins.optimizers.formats import quant8
from miles_plugins.optimizers.step.adam import backend_for
from miles_plugins.optimizers.step.entries import Entry
from miles_plugins.optimizers.store.streaming_store import StreamingStore
from tests.helpers import megatron_shards

LAYERS, STEPS = 2, 2
STATE = ("main", "exp_avg", "exp_avg_sq")


def params(tp: int, pp: int, tp_rank: int, pp_rank: int, vocab: int) -> dict[str, dict]:
    """The facts of the params of rank (tp_rank, pp_rank), as ``param_facts`` records them."""

    def part(key, start, local, shape, offset, prepend=0, replica=(0, 0, 0), mismatch=False):
        return dict(key=key, start=start, local_shape=list(local), global_shape=list(shape),
                    global_offset=list(offset), prepend_axis_num=prepend, replica_id=list(replica),
                    allow_shape_mismatch=mismatch)  # fmt: skip

    out = {}
    if pp_rank == 0:
        rows = vocab // tp
        out["emb"] = [part("emb", 0, (rows, 4), (vocab, 4), (tp_rank * rows, 0), mismatch=True)]
    per_stage = LAYERS // pp
    for local in range(per_stage):
        layer = pp_rank * per_stage + local
        f = 8 // tp
        out[f"layers.{local}.fc1"] = [  # a SwiGLU factory: two halves of one key, 8 + 8 rows
            part("fc1", 0, (f, 6), (LAYERS, 16, 6), (layer, tp_rank * f, 0), 1),
            part("fc1", f * 6, (f, 6), (LAYERS, 16, 6), (layer, 8 + tp_rank * f, 0), 1),
        ]
        c = 10 // tp  # row-parallel: split on its last axis
        out[f"layers.{local}.proj"] = [part("proj", 0, (4, c), (LAYERS, 4, 10), (layer, 0, tp_rank * c), 1)]
        out[f"layers.{local}.norm"] = [part("norm", 0, (6,), (LAYERS, 6), (layer, 0), 1, replica=(0, tp_rank, 0))]
    return {name: {"parts": parts, "tp_axis": None, "position": i} for i, (name, parts) in enumerate(out.items())}


def global_values(key: str, shape, what: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{what}/{step}".encode()))
    return torch.randn(shape, generator=g)


def _box(part: dict) -> tuple[slice, ...]:
    shape = [1] * part["prepend_axis_num"] + part["local_shape"]
    return tuple(slice(o, o + e) for o, e in zip(part["global_offset"], shape, strict=True))


def local_of(facts: dict, values) -> torch.Tensor:
    """A param's local flat tensor from ``values(key, global_shape)``."""
    numel = sum(math.prod(p["local_shape"]) for p in facts["parts"])
    out = torch.empty(numel)
    for p in facts["parts"]:
        n = math.prod(p["local_shape"])
        out[p["start"] : p["start"] + n] = values(p["key"], tuple(p["global_shape"]))[_box(p)].reshape(-1)
    return out


class Layout:
    """Every rank's store at (tp, pp, dp), each entry a DP shard of a local param."""

    def __init__(self, tmp, tp: int, pp: int, dp: int, config: dict, vocab: int = 12) -> None:
        self.stores, self.facts = [], []
        for rank in range(tp * pp * dp):
            tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
            facts = params(tp, pp, tp_rank, pp_rank, vocab)
            model = [[(n, sum(math.prod(p["local_shape"]) for p in f["parts"])) for n, f in facts.items()]]
            shards, _ = megatron_shards(model, dp)
            entries = []
            for piece in shards[dp_rank]:
                value = local_of(facts[piece.key], lambda k, s: global_values(k, s, "param", 0))
                if piece.key.endswith(".norm"):  # an fp32 param: its own main (moments streamed or resident)
                    main = value[piece.start : piece.end].clone()
                    entries.append(Entry(main, main, 0, name=piece.key, start=piece.start))
                    continue
                main = value[piece.start : piece.end].bfloat16().float()
                entries.append(Entry(main.bfloat16(), main, 0, name=piece.key, start=piece.start))
            peers = dict(tp_size=tp, tp_rank=tp_rank, ep_size=1, pp_size=pp, pp_rank=pp_rank, optimizer_instance=0)
            topology = dict(shard_peers=peers, world_size=tp * pp * dp, tp_size=tp, tp_rank=tp_rank, pp_size=pp,
                            pp_rank=pp_rank, ep_size=1, ep_rank=0, dp_size=dp, dp_rank=dp_rank, optimizer_instance=0)  # fmt: skip
            master = torch.optim.AdamW([{"params": [e.main for e in entries]}], lr=1e-2, weight_decay=0.1)
            self.stores.append(
                StreamingStore(
                    entries,
                    backend_for(master),
                    StreamConfig(directory=str(tmp / f"scratch{rank}"), name=f"rank{rank}.opt0", **config),
                    copy_to_model=lambda e: e.param.copy_(e.main) if e.param is not e.main else None,
                    topology=topology,
                    param_facts={"metadata": {"flags": True}, "params": facts},
                )
            )
            self.facts.append(facts)

    def train(self, steps) -> None:
        for step in steps:
            for store, facts in zip(self.stores, self.facts, strict=True):
                for e in store.entries:
                    grad = local_of(facts[e.name], lambda k, s, step=step: global_values(k, s, "grad", step))
                    e.main.grad = grad[e.start : e.start + e.main.numel()]
                store.step()

    def global_state(self, shapes: dict) -> dict:
        """Each key's main and moments from the primary parts, and how many ranks gave each element."""
        out = {k: {w: torch.zeros(s) for w in (*STATE, "count")} for k, s in shapes.items()}
        for store, facts in zip(self.stores, self.facts, strict=True):
            for index, *values in store.iter_state():
                e = store.entries[index]
                for p in facts[e.name]["parts"]:
                    if p["replica_id"][:2] != [0, 0]:
                        continue
                    lo, hi = (
                        max(e.start, p["start"]),
                        min(e.start + e.main.numel(), p["start"] + math.prod(p["local_shape"])),
                    )
                    for what, value in (*zip(STATE, values, strict=True), ("count", torch.ones(e.main.numel()))):
                        local = torch.zeros(math.prod(p["local_shape"]))
                        local[lo - p["start"] : hi - p["start"]] = value[lo - e.start : hi - e.start]
                        region = out[p["key"]][what][_box(p)]
                        region += local.view(region.shape)
        return out

    def save(self, directory) -> None:
        for store in self.stores:
            store.save_to(str(directory))

    def load(self, directory, saved: dict) -> None:
        """The params first, as Megatron loads them (``saved``'s mains: an fp32 param is its
        own main, a remainder main needs its bf16 param), then the streamed state."""

        def params(key, shape):
            out = torch.zeros(shape)
            common = tuple(slice(0, min(a, b)) for a, b in zip(shape, saved[key]["main"].shape, strict=True))
            out[common] = saved[key]["main"][common]
            return out

        for store, facts in zip(self.stores, self.facts, strict=True):
            for e in store.entries:
                e.param.copy_(local_of(facts[e.name], params)[e.start : e.start + e.param.numel()])
            assert store.load_from(str(directory), expected_steps=STEPS)

    def close(self) -> None:
        for store in self.stores:
            store.close()


SHAPES = {"emb": (12, 4), "fc1": (LAYERS, 16, 6), "proj": (LAYERS, 4, 10), "norm": (LAYERS, 6)}


def assert_same(a: dict, b: dict) -> None:
    for key in SHAPES:
        for what in (*STATE, "count"):
            assert torch.equal(a[key][what].view(torch.int32), b[key][what].view(torch.int32)), (key, what)


@pytest.mark.parametrize(
    "saved, loaded", [((2, 1, 2), (1, 2, 3)), ((1, 2, 1), (2, 1, 2))], ids=["tp2dp2-to-pp2dp3", "pp2-to-tp2dp2"]
)
@pytest.mark.parametrize(
    "config",
    [{}, {"main_storage": "remainder"}, {"moment_dtype": "bf16", "fp32_param_moments": "resident"}],
    ids=["fp32", "remainder", "bf16-fp32-moments-resident"],
)
def test_a_state_saved_at_one_layout_resumes_at_another_byte_for_byte(tmp_path, saved, loaded, config):
    config = {"bucket_cap_elements": 50, **config}
    a = Layout(tmp_path / "a", *saved, config)
    a.train(range(STEPS))
    before = a.global_state(SHAPES)
    assert torch.all(before["fc1"]["count"] == 1) and torch.all(before["norm"]["count"] == 1)
    a.save(tmp_path / "ckpt")
    a.close()
    b = Layout(tmp_path / "b", *loaded, config)
    b.load(tmp_path / "ckpt", before)
    assert_same(b.global_state(SHAPES), before)
    b.train(range(STEPS, STEPS + 1))
    resumed = b.global_state(SHAPES)
    b.close()
    reference = Layout(tmp_path / "r", *loaded, config)
    reference.train(range(STEPS + 1))
    assert_same(resumed, reference.global_state(SHAPES))
    reference.close()


def test_8bit_moments_are_decoded_and_quantized_again_in_the_new_entries_blocks(tmp_path):
    config = {"bucket_cap_elements": 600, "moment_dtype": "8bit"}
    a = Layout(tmp_path / "a", 2, 1, 1, config)
    a.train(range(STEPS))
    before = a.global_state(SHAPES)
    a.save(tmp_path / "ckpt")
    a.close()
    b = Layout(tmp_path / "b", 1, 1, 3, config)
    b.load(tmp_path / "ckpt", before)
    for store, facts in zip(b.stores, b.facts, strict=True):
        for index, main, exp_avg, exp_avg_sq in store.iter_state():
            e = store.entries[index]
            cut = slice(e.start, e.start + main.numel())
            assert torch.equal(main, local_of(facts[e.name], lambda k, s: before[k]["main"])[cut])
            for what, got in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                expected = local_of(facts[e.name], lambda k, s, w=what: before[k][w])[cut].clone()
                signed, sqrt = quant8.MOMENT_FORMATS[what]
                if quant8.quantizes(expected.numel()):  # the saved values, quantized in this entry's blocks
                    quant8.encode_in_place(expected, signed, sqrt)
                    quant8.decode_in_place(expected, signed, sqrt)
                assert torch.equal(got, expected), (e.name, what)
    b.close()


def test_a_padded_vocabulary_copies_the_rows_both_hold_and_zeroes_the_rest(tmp_path):
    """Megatron pads the vocabulary per TP size (allow_shape_mismatch): 12 rows saved, 16 loaded."""
    a = Layout(tmp_path / "a", 2, 1, 1, {})
    a.train(range(STEPS))
    before = a.global_state(SHAPES)
    a.save(tmp_path / "ckpt")
    a.close()
    b = Layout(tmp_path / "b", 1, 1, 2, {}, vocab=16)
    b.load(tmp_path / "ckpt", before)
    after = b.global_state({**SHAPES, "emb": (16, 4)})
    for what in STATE:
        assert torch.equal(after["emb"][what][:12], before["emb"][what])
        assert torch.all(after["emb"][what][12:] == 0)
    b.close()


def test_a_missing_saved_rank_and_another_model_are_refused_in_one_line(tmp_path):
    a = Layout(tmp_path / "a", 2, 1, 2, {})
    a.train(range(STEPS))
    a.save(tmp_path / "ckpt")
    a.close()
    (tmp_path / "ckpt" / "rank3.opt0").rename(tmp_path / "rank3.opt0")
    b = Layout(tmp_path / "b", 1, 1, 1, {})
    with pytest.raises(CheckpointMismatchError) as refused:
        b.stores[0].load_from(str(tmp_path / "ckpt"), expected_steps=STEPS)
    assert "\n" not in str(refused.value) and "a saved rank's store is missing" in str(refused.value)
    (tmp_path / "rank3.opt0").rename(tmp_path / "ckpt" / "rank3.opt0")
    b.close()
    reshaped = Layout(tmp_path / "d", 1, 1, 1, {})
    reshaped.facts[0]["layers.0.proj"]["parts"][0]["global_shape"] = [LAYERS, 4, 11]  # another model's shape
    with pytest.raises(CheckpointMismatchError) as refused:
        reshaped.stores[0].load_from(str(tmp_path / "ckpt"), expected_steps=STEPS)
    assert "\n" not in str(refused.value) and "key 'proj' has global shape [2, 4, 10] in the checkpoint" in str(
        refused.value
    )
    reshaped.close()
    other = Layout(tmp_path / "c", 1, 1, 1, {})
    other.facts[0]["layers.0.norm"]["parts"][0]["key"] = "other"  # a param the checkpoint holds no key of
    with pytest.raises(CheckpointMismatchError) as refused:
        other.stores[0].load_from(str(tmp_path / "ckpt"), expected_steps=STEPS)
    assert "\n" not in str(refused.value) and "no saved store holds key 'other'" in str(refused.value)
    assert "--no-load-optim" in str(refused.value)
    other.close()
