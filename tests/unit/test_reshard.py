"""The remap of a load at another DP size (``reshard.plan``), over random shard layouts.

Each DP size's sharding comes from megatron-core's own range code
(``DistributedOptimizer._build_model_gbuf_param_range_map``, the function that
decides which elements of which param a DP rank owns). The buffer layout it is
given follows Megatron's padding rules, reproduced in ``helpers.megatron_shards`` because upstream builds
it inside ``_ParamAndGradBuffer.__init__`` (no function to call): each param's
start padded to 64 elements, params in reverse order, each bucket's end padded
to a multiple of lcm(dp, 128).
"""

import random

import pytest

from miles_plugins.optimizers.checkpoint.reshard_plan import Copy, Piece, RemapError, plan
from tests.helpers import megatron_param_layout, megatron_shards

pytest.importorskip("megatron.core.optimizer.distrib_optimizer")


def _model(seed: int) -> list[list[tuple[str, int]]]:
    """DDP buckets of (param name, numel): sizes from 1 element to several shards."""
    rng = random.Random(seed)
    return [
        [(f"b{b}.p{i}", rng.choice([1, 7, 64, 129, rng.randint(1, 5000), rng.randint(5000, 40000)])) for i in range(n)]
        for b, n in enumerate(rng.randint(1, 6) for _ in range(3))
    ]


def test_the_offline_sharding_is_megatrons():
    """reshard_offline computes a new DP size's sharding from the recorded layout alone:
    the same pieces as megatron-core's range code."""
    from miles_plugins.optimizers.checkpoint.reshard_targets import megatron_pieces

    model = _model(5)
    for dp in range(1, 9):
        pieces, _ = megatron_shards(model, dp)
        for rank in range(dp):
            assert [p for _, p in megatron_pieces(megatron_param_layout(model), dp, rank)] == pieces[rank]


def _values(model) -> dict[str, list[int]]:
    """A distinct value per element of every param."""
    return {name: [p * 1_000_000 + i for i in range(numel)] for p, (name, numel) in enumerate(sum(model, []))}


@pytest.mark.parametrize("seed", [0, 1])
def test_every_element_comes_from_the_rank_that_saved_it_for_each_dp_n_to_m(seed):
    model = _model(seed)
    full = _values(model)
    padding_changed = False
    for saved_dp in range(1, 9):
        saved, saved_sizes = megatron_shards(model, saved_dp)
        stored = {(r, k): full[p.key][p.start : p.end] for r, pieces in enumerate(saved) for k, p in enumerate(pieces)}
        sources = [((r, k), p) for r, pieces in enumerate(saved) for k, p in enumerate(pieces)]
        for new_dp in range(1, 9):
            targets, new_sizes = megatron_shards(model, new_dp)
            padding_changed |= saved_sizes != new_sizes
            for pieces in targets:
                for piece, copies in zip(pieces, plan(pieces, sources), strict=True):
                    out = [None] * piece.numel
                    for c in copies:
                        out[c.target_offset : c.target_offset + c.count] = stored[c.source][
                            c.source_offset : c.source_offset + c.count
                        ]
                    assert out == full[piece.key][piece.start : piece.end], (saved_dp, new_dp, piece)
    assert padding_changed  # the DP sizes padded the buckets differently


def test_a_piece_spanning_three_saved_ones():
    sources = [("a", Piece("w", 0, 10)), ("b", Piece("w", 10, 5)), ("c", Piece("w", 15, 20)), ("x", Piece("v", 0, 8))]
    assert plan([Piece("w", 8, 12), Piece("v", 3, 2)], sources) == [
        [Copy("a", 8, 0, 2), Copy("b", 0, 2, 5), Copy("c", 0, 7, 5)],
        [Copy("x", 3, 0, 2)],
    ]


def test_elements_no_saved_rank_holds_are_named():
    model = _model(3)
    saved, _ = megatron_shards(model, 4)
    sources = [((r, k), p) for r, pieces in enumerate(saved) if r != 2 for k, p in enumerate(pieces)]
    targets, _ = megatron_shards(model, 1)
    with pytest.raises(RemapError, match=r"param 'b\d\.p\d+': elements \[\d+, \d+\) are in no saved piece"):
        plan(targets[0], sources)
    with pytest.raises(RemapError, match=r"param 'w': elements \[4, 6\) are in no saved piece"):
        plan([Piece("w", 0, 10)], [("a", Piece("w", 0, 4)), ("b", Piece("w", 6, 4))])
    with pytest.raises(RemapError, match=r"param 'w': elements \[0, 3\)"):
        plan([Piece("w", 0, 3)], [("a", Piece("v", 0, 3))])


def test_overlapping_saved_pieces_are_refused():
    with pytest.raises(RemapError, match="overlap: the checkpoint mixes saves"):
        plan([Piece("w", 0, 4)], [("a", Piece("w", 0, 4)), ("b", Piece("w", 3, 4))])
