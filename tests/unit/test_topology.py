"""Resume at another TP, PP or EP size with real megatron-core, on spawned CPU ranks.

Each test spawns a world (``megatron_world.py``: gloo, a GPT with MoE and SwiGLU,
DDP, the optimizer chain, real bindings) and runs its cases one after another in
it. A case trains at one layout, saves, loads at another (online, or after
``ckpt reshard``), and compares the global state before and after: every main
and moment byte of every key, each element held by exactly one primary copy,
replicas equal to it. One more step after the load must equal a run that took
every step at the new layout. Slow (most of it imports): ``make test-topology``.
"""

import tempfile

import pytest
import torch

pytest.importorskip("megatron.core")

from miles_plugins.optimizers.checkpoint.manifest import Manifest  # noqa: E402
from tests.unit.megatron_world import (  # noqa: E402
    Layout,
    build,
    differences,
    global_state,
    megatron_parts,
    set_params,
    spawn,
    train,
)

pytestmark = pytest.mark.topology

STEPS = 2
CAP = {"bucket_cap_elements": 1000}


def _trained(layout: Layout, scratch: str, config: dict, ckpt: str) -> dict:
    """Train at ``layout`` and save into ``ckpt``; the global state saved."""
    world = build(layout, scratch, **config)
    train(world, range(STEPS))
    state = global_state(world)
    for binding in world.bindings:
        binding.save_to(ckpt)
    world.close()
    torch.distributed.barrier()
    return state


def _loaded(layout: Layout, scratch: str, config: dict, ckpt: str, params: dict):
    """A world at ``layout`` with the trained params (as Megatron loads them) and the saved state."""
    world = build(layout, scratch, **config)
    set_params(world, lambda key, shape: params[key]["main"][tuple(slice(0, n) for n in shape)])
    for binding in world.bindings:
        binding.store.load_from(ckpt, expected_steps=STEPS)
    return world


def _uncovered(state: dict) -> list[str]:
    return [k for k, v in state.items() if not torch.all(v["count"] == 1) or torch.any(v["mismatch"] != 0)]


def recorded_facts(tmp: str, tps: list[int]) -> dict:
    """Per TP size, over every rank: where a param's recorded facts (read back from the
    saved manifest) differ from Megatron's own ShardedTensors of the same param; each
    key's recorded TP axis, and the axes Megatron's fragmentation says TP splits."""
    out = {}
    for tp in tps:
        world = build(Layout(tp=tp), f"{tmp}/{tp}", **CAP)
        problems, axes = [], {}
        for binding in world.bindings:
            binding.save_to(f"{tmp}/{tp}/ckpt")
            recorded = Manifest.read(f"{tmp}/{tp}/ckpt/{binding.store.config.name}").data["param_facts"]["params"]
            for name, param in binding_names(world, binding).items():
                parts = megatron_parts(world.chunks, param)
                expected = [
                    {
                        "key": part.key,
                        "start": part.data.storage_offset(),  # built over a fresh tensor of the param's shape
                        "local_shape": list(part.local_shape),
                        "global_shape": list(part.global_shape),
                        "global_offset": list(part.global_offset),
                        "prepend_axis_num": part.prepend_axis_num,
                        "replica_id": list(part.replica_id),
                        "allow_shape_mismatch": part.allow_shape_mismatch,
                    }
                    for part in parts
                ]
                if recorded[name]["parts"] != expected:
                    problems.append(f"{name}: recorded {recorded[name]['parts']}, Megatron {expected}")
                fragmented = [
                    a for a, f in enumerate(parts[0].axis_fragmentations) if a >= parts[0].prepend_axis_num and f > 1
                ]
                axes[parts[0].key] = [recorded[name]["tp_axis"], fragmented]
        world.close()
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, [problems, axes])
        out[tp] = {"problems": [p for rank in everyone for p in rank[0]], "axes": everyone[0][1]}
    return out


def binding_names(world, binding) -> dict:
    """The params ``binding``'s optimizer shards, by the names the binding gives them."""
    ours = {p for buffer in binding.dist_opt.buffers for p in buffer.param_index_map}
    return {f"{i}/{n}": p for i, chunk in enumerate(world.chunks) for n, p in chunk.named_parameters() if p in ours}


def test_the_recorded_boxes_are_megatrons_own_at_tp_1_2_and_4():
    """Each key's TP axis is recorded at TP 1 too (from the param's attributes), and is
    where Megatron's sharding splits the key at TP 2 and 4 (vocabulary, experts, SwiGLU)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = spawn(4, recorded_facts, tmp, [1, 2, 4])
    for tp in ("1", "2", "4"):
        assert not result[tp]["problems"], result[tp]["problems"][:3]
    keys = result["1"]["axes"]
    assert len(keys) >= 12 and any(axis is not None for axis, _ in keys.values())
    for key, (axis, _) in keys.items():
        for tp in ("2", "4"):
            assert result[tp]["axes"][key][0] == axis, key
            assert result[tp]["axes"][key][1] == ([] if axis is None else [axis]), key


def resume_cases(tmp: str, cases: list) -> dict:
    """Per case (name, saved layout, loaded layout, config): what differs after the load
    and after one more step, and what the saved state does not cover exactly once."""
    results = {}
    for name, saved, loaded, config in cases:
        ckpt = f"{tmp}/{name}/ckpt"
        before = _trained(saved, f"{tmp}/{name}/a", config, ckpt)
        world = _loaded(loaded, f"{tmp}/{name}/b", config, ckpt, before)
        after = global_state(world)
        train(world, range(STEPS, STEPS + 1))
        resumed = global_state(world)
        world.close()
        reference = build(loaded, f"{tmp}/{name}/r", **config)
        train(reference, range(STEPS + 1))
        expected = global_state(reference)
        reference.close()
        results[name] = {
            "loaded": differences(before, after),
            "stepped": differences(resumed, expected),
            "uncovered": _uncovered(before) + _uncovered(after),
            "trained": len(differences(before, resumed)),  # the step changed something: the checks can fail
        }
    return results


def _check(results: dict) -> None:
    for name, result in results.items():
        assert result["trained"] > 0, name
        assert not result["loaded"] and not result["stepped"] and not result["uncovered"], (name, result)


def test_online_resume_at_other_tp_pp_and_ep_sizes_of_a_world_of_two():
    cases = [
        ("tp2-to-tp1", Layout(tp=2), Layout(tp=1), CAP),
        ("tp1-to-tp2-remainder", Layout(tp=1), Layout(tp=2), {**CAP, "main_storage": "remainder"}),
        ("pp2-to-pp1-tied", Layout(pp=2, tied=True), Layout(pp=1, tied=True), CAP),
        ("pp1-to-pp2-tied", Layout(pp=1, tied=True), Layout(pp=2, tied=True), CAP),
        ("ep2-to-ep1", Layout(ep=2), Layout(ep=1), CAP),
        ("ep1-to-ep2-bf16", Layout(ep=1), Layout(ep=2), {**CAP, "moment_dtype": "bf16"}),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        _check(spawn(2, resume_cases, tmp, cases))


def refusals(tmp: str) -> dict:
    """What a load at TP 1 of a TP 2 save answers: from a model of other keys, with a
    saved rank's store missing, and from saves whose records lack the keys and boxes
    (as format 3 wrote them); and what ``ckpt reshard --tp 1`` answers to those."""
    import pathlib
    import shutil

    from miles_plugins.optimizers.checkpoint.cli import reshard_command
    from miles_plugins.optimizers.errors import CheckpointMismatchError
    from tests.helpers import rewrite_manifest

    ckpt = pathlib.Path(tmp, "ckpt")
    _trained(Layout(tp=2), f"{tmp}/a", CAP, str(ckpt))
    rank = torch.distributed.get_rank()

    def refusal(layout: Layout) -> str:
        world = build(layout, f"{tmp}/b", **CAP)
        try:
            world.bindings[0].store.load_from(str(ckpt), expected_steps=STEPS)
            return "loaded"
        except CheckpointMismatchError as exc:
            return str(exc)
        finally:
            world.close()

    out = {"other model": refusal(Layout(tp=1, moe=False))}
    if rank == 0:
        shutil.move(ckpt / "rank1.opt0", pathlib.Path(tmp, "aside"))
    torch.distributed.barrier()
    out["store missing"] = refusal(Layout(tp=1))
    torch.distributed.barrier()
    if rank == 0:
        shutil.move(pathlib.Path(tmp, "aside"), ckpt / "rank1.opt0")
        for store in ckpt.iterdir():
            rewrite_manifest(store / "manifest.json", lambda d: d.update(format_version=3, param_facts=None))
        out["offline"] = reshard_command(str(ckpt), None, f"{tmp}/iter_0000002", (1, None, None))
    torch.distributed.barrier()
    out["without records"] = refusal(Layout(tp=1))
    return out


def test_refusals_of_another_model_a_missing_store_and_records_without_keys_are_one_line():
    with tempfile.TemporaryDirectory() as tmp:
        out = spawn(2, refusals, tmp)
    for what in ("other model", "store missing", "without records"):
        assert out[what] != "loaded" and "\n" not in out[what], (what, out[what])
    assert "no saved store holds key" in out["other model"], out["other model"]
    assert "--no-load-optim" in out["other model"]
    assert "a saved rank's store is missing" in out["store missing"]
    assert "record(s) no param keys and global boxes" in out["without records"]
    assert "it loads only at the TP, PP and EP sizes it was saved at" in out["without records"]
    assert out["offline"] == 1


def test_online_resume_at_other_layouts_mixed_with_dp_in_a_world_of_four():
    cases = [
        ("tp2dp2-to-tp1dp4-remainder", Layout(tp=2), Layout(tp=1), {**CAP, "main_storage": "remainder"}),
        ("ep2dp2-to-ep1dp4", Layout(ep=2), Layout(ep=1), CAP),
        ("tp2pp2-to-tp4-tied", Layout(tp=2, pp=2, tied=True), Layout(tp=4, tied=True), CAP),
        ("tp1-to-tp2ep2-ddp-buckets", Layout(ddp_bucket=600), Layout(tp=2, ep=2, ddp_bucket=600), CAP),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        _check(spawn(4, resume_cases, tmp, cases))


def offline_cases(tmp: str, cases: list) -> dict:
    """Per case (name, saved layout, the layouts ``ckpt reshard`` rewrites it for in
    turn, config): at each, what differs from the saved state after the new layout's
    ranks load the rewritten stores, and which stores a run there loads as its own."""
    from miles_plugins.optimizers.checkpoint.cli import reshard_command
    from miles_plugins.optimizers.checkpoint.manifest import differences as manifest_differences

    results = {}
    for name, saved, layouts, config, _ in cases:
        source = f"{tmp}/{name}/ckpt0"
        before = _trained(saved, f"{tmp}/{name}/a", config, source)
        steps = []
        for i, layout in enumerate(layouts, 1):
            out = f"{tmp}/{name}/iter_{i:07d}"
            if torch.distributed.get_rank() == 0:
                status = reshard_command(source, None, out, (layout.tp, layout.pp, layout.ep))
            torch.distributed.barrier()
            source = f"{out}/streamed_optimizer_state"
            world = _loaded(layout, f"{tmp}/{name}/b{i}", config, source, before)
            own = [
                not manifest_differences(
                    Manifest.read(f"{source}/{b.store.config.name}").data, b.store._parts.persistence.description
                )
                for b in world.bindings
            ]
            after = global_state(world)
            world.close()
            everyone = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, own)
            steps.append(
                {
                    "layout": str(layout),
                    "status": status if torch.distributed.get_rank() == 0 else None,
                    "loaded": differences(before, after),
                    "uncovered": _uncovered(after),
                    "own": all(o for rank in everyone for o in rank),
                }
            )
        results[name] = steps
    return results


def test_offline_round_trips_to_other_tp_pp_and_ep_sizes_mixed_with_dp():
    """``ckpt reshard --tp/--pp/--ep`` in a world of four: every step's stores load at
    their layout byte-identical to the original state, as each rank's own store. One
    exception, loaded through the online reshard instead: a save of one stage with a
    tied embedding records no copy of it for the last stage of PP 2."""
    cases = [
        ("tp2-tp1-tp4", Layout(tp=2), [Layout(tp=1), Layout(tp=4)], {**CAP, "main_storage": "remainder"}, True),
        ("pp2-pp1-tied", Layout(pp=2, tied=True), [Layout(pp=1, tied=True)], CAP, True),
        ("ep2-ep1-ep4", Layout(ep=2), [Layout(ep=1), Layout(ep=4)], CAP, True),
        ("tp2pp2-tp1-ddp-buckets", Layout(tp=2, pp=2, ddp_bucket=600), [Layout(ddp_bucket=600)], CAP, True),
        ("pp1-pp2-tied", Layout(pp=1, tied=True), [Layout(pp=2, tied=True)], CAP, False),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        results = spawn(4, offline_cases, tmp, cases)
    for name, _, _, _, own in cases:
        for step in results[name]:
            assert step["status"] == 0 and not step["loaded"] and not step["uncovered"], (name, step)
            assert step["own"] == own, (name, step["layout"], "loaded as its own" if step["own"] else "resharded")
