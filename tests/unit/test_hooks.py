"""What the patched checkpointing.py lines call: store discovery across a chain, the
iteration directory per checkpoint format, the save/load dispatch into real stores,
and the refusal of a tree without the hooks."""

import re
import sys
import types

import pytest
import torch

from megatron_hooks import checkpoint as hooks
from megatron_hooks.contract import OptimizerStateStore
from tests.helpers import Chain, streamed


def test_iteration_dir_per_checkpoint_format():
    assert hooks.iteration_dir("/ck/iter_0000010", "GLOBAL") == "/ck/iter_0000010"
    legacy = "/ck/iter_0000010/mp_rank_00_001/model_optim_rng.pt"
    assert hooks.iteration_dir(legacy, types.SimpleNamespace(name="LEGACY")) == "/ck/iter_0000010"
    assert hooks.iteration_dir("/ck/release/mp_rank_00/model_optim_rng.pt", "LEGACY") == "/ck/release"
    with pytest.raises(RuntimeError, match="--non-persistent-ckpt-type global"):
        hooks.iteration_dir("/ck/iter_0000010", "LOCAL")
    with pytest.raises(RuntimeError, match="naming changed"):
        hooks.iteration_dir("/ck/iter_0000010/mp_rank_00/model_optim_rng.pt", "GLOBAL")


def test_save_and_load_reach_every_store_in_the_chain(tmp_path):
    (p0, s0, h0), (_, s1, h1) = streamed(tmp_path, "rank0.opt0", 0), streamed(tmp_path, "rank0.opt1", 1)
    assert isinstance(s0.store, OptimizerStateStore)
    chain = Chain(h0, types.SimpleNamespace(), h1)  # a member without a store (stub) is skipped
    assert hooks.stores_of(chain) == [s0.store, s1.store]
    name = str(tmp_path / "ckpt" / "iter_0000001")
    hooks.save(types.SimpleNamespace(no_save_optim=False), chain, name, "GLOBAL")
    saved = tmp_path / "ckpt" / "iter_0000001" / hooks.STATE_DIRNAME
    assert sorted(p.name for p in saved.iterdir()) == ["rank0.opt0", "rank0.opt1"]
    before = [m.clone() for _, m, _, _ in s0.iter_state()]
    p0.grad = torch.randn_like(p0)
    s0.step()
    hooks.load(types.SimpleNamespace(), chain, name, "GLOBAL")
    assert s0.store.steps_taken == 1
    assert all(torch.equal(a, b) for a, (_, b, _, _) in zip(before, s0.iter_state(), strict=True))
    s0.close()
    s1.close()


def test_no_save_optim_saves_nothing(tmp_path, caplog):
    _, front, holder = streamed(tmp_path, "rank0", 0)
    hooks.save(types.SimpleNamespace(no_save_optim=True), holder, str(tmp_path / "iter_0000001"), "GLOBAL")
    assert not (tmp_path / "iter_0000001").exists()
    assert "--no-save-optim" in caplog.text
    front.close()


def test_no_stores_means_the_hooks_do_nothing(tmp_path):
    hooks.save(types.SimpleNamespace(), None, str(tmp_path / "x"), "LOCAL")  # not even the LOCAL refusal
    hooks.load(types.SimpleNamespace(), Chain(types.SimpleNamespace()), str(tmp_path / "x"), "GLOBAL")
    assert list(tmp_path.iterdir()) == []


def test_a_tree_without_the_hooks_is_refused():
    pytest.importorskip("megatron.core")
    try:
        import megatron.training.checkpointing  # noqa: F401
    except ImportError:
        # megatron-core < 0.17 (the CPU venv): no training package at all.
        with pytest.raises(hooks.HooksNotInstalledError, match="megatron.training.checkpointing cannot be imported"):
            hooks.check_patched()
    else:
        pytest.skip("megatron.training is importable here; the GPU tier checks a patched tree")


def _checkpointing(monkeypatch, **attrs) -> None:
    """Stand in for megatron.training.checkpointing: this venv's megatron-core
    (0.16.1, the newest for Python 3.11) ships no megatron/training, so the
    module check_patched inspects is built here with the attributes a patched
    or unpatched file would have. The GPU tier checks a really patched tree."""
    module = types.ModuleType("megatron.training.checkpointing")
    module.__file__ = "/megatron/training/checkpointing.py"
    for name, value in attrs.items():
        setattr(module, name, value)
    training = types.ModuleType("megatron.training")
    training.checkpointing = module
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.checkpointing", module)


@pytest.mark.parametrize(
    "attrs, message",
    [
        ({}, "lacks the optimizer-state checkpoint hooks: its checkpoints would silently drop"),
        ({hooks.PATCH_MARKER: hooks.HOOK_ABI_VERSION + 1}, "carries checkpoint hooks for ABI 3, this plugin speaks 2"),
        (
            {hooks.PATCH_MARKER: hooks.HOOK_ABI_VERSION, hooks.HOOKS_NAME: None},
            "is patched but its hooks module is None, not megatron_hooks.checkpoint",
        ),
        (
            {hooks.PATCH_MARKER: hooks.HOOK_ABI_VERSION, hooks.HOOKS_NAME: types.ModuleType("other_hooks")},
            "is patched but its hooks module is <module 'other_hooks'>",
        ),
    ],
    ids=["unpatched", "another ABI", "hooks not importable at import time", "another hooks module"],
)
def test_check_patched_refuses_a_tree_it_cannot_trust(monkeypatch, attrs, message):
    _checkpointing(monkeypatch, **attrs)
    with pytest.raises(hooks.HooksNotInstalledError, match=re.escape(message)):
        hooks.check_patched()


def test_check_patched_accepts_a_tree_patched_for_this_abi(monkeypatch):
    _checkpointing(monkeypatch, **{hooks.PATCH_MARKER: hooks.HOOK_ABI_VERSION, hooks.HOOKS_NAME: hooks})
    hooks.check_patched()


def test_a_tree_patched_for_abi_1_is_answered_with_synchronous_saves_and_said_so(monkeypatch, caplog):
    """ABI 1's save passes no async request: its trees still stream, saving synchronously."""
    _checkpointing(monkeypatch, **{hooks.PATCH_MARKER: 1, hooks.HOOKS_NAME: hooks})
    with caplog.at_level("WARNING"):
        hooks.check_patched()
    assert "with --async-save the streamed optimizer state is saved synchronously there" in caplog.text


def _loaded_at(tmp_path, iteration_name, **args):
    """A store saved into ``iteration_name`` and loaded back through the hooks with ``args``."""
    param, front, holder = streamed(tmp_path, "rank0.opt0", 0)
    name = str(tmp_path / "ckpt" / iteration_name)
    hooks.save(types.SimpleNamespace(no_save_optim=False), holder, name, "GLOBAL")
    hooks.load(types.SimpleNamespace(**args), holder, name, "GLOBAL")
    param.grad = torch.randn_like(param)
    return front, holder


def test_a_run_counting_from_another_iteration_than_its_loaded_state_is_refused(tmp_path):
    """Megatron's legacy format with the distributed optimizer counts from the latest
    checkpointed iteration even under --ckpt-step, while the params and the streamed
    state come from the asked one: the next step refuses, naming both."""
    front, _ = _loaded_at(tmp_path, "iter_0000010", iteration=20)
    with pytest.raises(
        RuntimeError, match=r"loaded from iteration 10 \(.*iter_0000010\), but Megatron continues from iteration 20"
    ):
        front.step()
    assert front.store.steps_taken == 1, "the refused step did not run"
    with pytest.raises(RuntimeError, match="continues from iteration 20"):
        front.step()  # still armed
    front.close()


@pytest.mark.parametrize(
    "iteration_name, args",
    [
        ("iter_0000010", dict(iteration=10)),
        ("iter_0000010", dict(iteration=20, override_ckpt_iteration=20)),  # asked for on purpose
        ("release", dict(iteration=0)),
    ],
    ids=["same-iteration", "override-ckpt-iteration", "release"],
)
def test_a_run_continuing_where_its_state_belongs_steps(tmp_path, iteration_name, args):
    front, _ = _loaded_at(tmp_path, iteration_name, **args)
    front.step()
    assert front.store.steps_taken == 2
    front.close()


def test_a_save_before_any_step_refuses_the_same_mismatch(tmp_path):
    """The other face of it: the run ends at once (its count is past --train-iters) and
    saves, filing iteration 10's state under 20."""
    front, holder = _loaded_at(tmp_path, "iter_0000010", iteration=20)
    name = str(tmp_path / "ckpt" / "iter_0000020")
    with pytest.raises(RuntimeError, match="loaded from iteration 10 .* continues from iteration 20"):
        hooks.save(types.SimpleNamespace(no_save_optim=False), holder, name, "GLOBAL")
    front.close()


def test_a_save_after_skipped_steps_of_a_sound_resume_goes_through(tmp_path):
    """Resumed at 10 and counting from 10, the first iterations overflowed (fp16: the
    optimizer step is skipped, the count advances) and a save comes at 11: sound."""
    front, holder = _loaded_at(tmp_path, "iter_0000010", iteration=10)
    hooks.save(types.SimpleNamespace(no_save_optim=False), holder, str(tmp_path / "ckpt" / "iter_0000011"), "GLOBAL")
    front.close()


def test_a_second_load_replaces_what_the_first_expected(tmp_path):
    front, holder = _loaded_at(tmp_path, "iter_0000010", iteration=20)
    name = str(tmp_path / "ckpt" / "iter_0000020")
    front.store.save_to(str(tmp_path / "ckpt" / "iter_0000020" / hooks.STATE_DIRNAME))  # a later save to reload
    hooks.load(types.SimpleNamespace(iteration=20), holder, name, "GLOBAL")
    front.step()  # counts from 20, loaded from 20: one check, and it passes
    assert front.store.steps_taken == 2
    front.close()


@pytest.mark.parametrize(
    "args",
    [
        dict(ckpt_format="torch"),
        dict(ckpt_format="torch_dist"),  # Megatron detects the legacy format on disk whatever this says
        dict(ckpt_format="torch", override_ckpt_iteration=10),  # that branch overwrites the override too
    ],
    ids=["torch", "detected", "override"],
)
def test_a_legacy_load_megatron_counts_from_the_tracker_is_refused_at_the_load(tmp_path, args):
    """For callers that keep load_checkpoint's iteration to themselves (miles sets no
    args.iteration): from a legacy checkpoint with the distributed optimizer Megatron
    counts from the tracker file's iteration, so a load of another one is refused right there."""
    param, front, holder = streamed(tmp_path, "rank0.opt0", 0)
    ckpt = tmp_path / "ckpt"
    name = str(ckpt / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt")  # the legacy format's file
    hooks.save(types.SimpleNamespace(no_save_optim=False), holder, name, "LEGACY")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("20")
    load_args = types.SimpleNamespace(use_distributed_optimizer=True, **args)
    with pytest.raises(RuntimeError, match=r"loaded from iteration 10 .* continues from iteration 20"):
        hooks.load(load_args, holder, name, "LEGACY")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    hooks.load(load_args, holder, name, "LEGACY")  # the tracker's own iteration loads
    front.close()


def test_a_torch_dist_load_is_not_judged_by_the_tracker(tmp_path):
    """--auto-detect-ckpt-format from a torch_dist iteration: Megatron counts from the loaded one."""
    param, front, holder = streamed(tmp_path, "rank0.opt0", 0)
    name = str(tmp_path / "ckpt" / "iter_0000010")
    hooks.save(types.SimpleNamespace(no_save_optim=False), holder, name, "GLOBAL")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("20")
    hooks.load(types.SimpleNamespace(ckpt_format="torch", use_distributed_optimizer=True), holder, name, "GLOBAL")
    front.close()
