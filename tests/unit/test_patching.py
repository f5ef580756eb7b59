"""The patch series and its tooling on real megatron-core wheels (downloaded from the
package registry into .cache/ on first use), as a plain directory and as a git checkout."""

import shutil
import subprocess

import pytest

from ci.megatron_sources import wheel_tree
from megatron_hooks import __main__ as cli
from megatron_hooks import patching
from tests.helpers import REPO


@pytest.fixture(scope="module")
def wheel_019(tmp_path_factory):
    return wheel_tree("0.19.2", tmp_path_factory.mktemp("wheel"))


@pytest.fixture
def tree(wheel_019, tmp_path):
    dest = tmp_path / "site"
    shutil.copytree(wheel_019, dest)
    return dest


def target(root):
    return root / patching.TARGET


def test_apply_is_idempotent_and_revert_restores_every_byte(tree):
    original = target(tree).read_bytes()
    assert patching.status(tree).state == "unpatched"
    assert patching.apply(tree).startswith("applied 3 patches")
    patched = target(tree).read_bytes()
    assert patching.status(tree).state == "patched"
    assert patching.status(tree).hooks == {"save": True, "load": True}
    assert patching.apply(tree).startswith("already applied")
    assert target(tree).read_bytes() == patched  # no duplicated hooks
    assert patching.revert(tree).startswith("reverted 3 patches")
    assert target(tree).read_bytes() == original
    assert patching.revert(tree).startswith("nothing to revert")


def test_the_save_hook_runs_after_the_checkpoint_is_written_and_before_the_tracker(tree):
    patching.apply(tree)
    lines = target(tree).read_text().splitlines()
    save = next(i for i, line in enumerate(lines) if "_optimizer_state_hooks.save(" in line)
    torch_save = max(i for i, line in enumerate(lines[:save]) if "torch.save(state_dict, checkpoint_name)" in line)
    tracker = next(i for i, line in enumerate(lines) if i > save and "f.write('release' if release" in line)
    assert torch_save < save < tracker
    load = next(i for i, line in enumerate(lines) if "_optimizer_state_hooks.load(" in line)
    reload = max(i for i, line in enumerate(lines[:load]) if "optimizer.reload_model_params()" in line)
    assert load - reload < 5


def test_the_megatron_directory_itself_is_accepted(tree):
    assert patching.apply(tree / "megatron").startswith("applied")


def test_a_conflict_changes_nothing_and_names_the_hunk(tree):
    text = target(tree).read_text()
    text = text.replace("    # rerun state\n", "    # rerun-state handling moved\n")
    target(tree).write_text(text)
    with pytest.raises(patching.PatchError) as info:
        patching.apply(tree)
    message = str(info.value)
    assert "nothing was changed" in message
    assert "0003-checkpointing-load-the-streamed-optimizer-state-with.patch" in message
    assert "# rerun state" in message  # the context it looked for
    assert target(tree).read_text() == text


def test_a_git_checkout_is_patched_in_its_work_tree(tree):
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q", str(tree)], check=True)
    subprocess.run([*git, "-C", str(tree), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(tree), "commit", "-qm", "base"], check=True)
    patching.apply(tree)
    changed = subprocess.run(
        ["git", "-C", str(tree), "diff", "--stat"], capture_output=True, text=True, check=True
    ).stdout
    assert "megatron/training/checkpointing.py" in changed and "15 insertions" in changed
    patching.revert(tree)
    assert subprocess.run(["git", "-C", str(tree), "diff"], capture_output=True, text=True).stdout == ""


def test_foreign_hooks_are_detected_and_not_stacked_on(tree):
    text = target(tree).read_text()
    # The marker of radixark/Megatron-LM #63's hooks (not their code).
    target(tree).write_text(text + "\n_FOREIGN = '_nvme_state_store'\n")
    assert patching.status(tree).state == "foreign"
    with pytest.raises(patching.PatchError, match="radixark/Megatron-LM #63"):
        patching.apply(tree)


def test_a_wheel_without_megatron_training_is_refused_with_the_reason(tmp_path):
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    with pytest.raises(patching.PatchError, match="before 0.17 do not ship"):
        patching.status(tmp_path)


def test_cli_exit_codes(tree, capsys):
    assert cli.main(["status", "--megatron-dir", str(tree)]) == 1
    assert cli.main(["apply", "--megatron-dir", str(tree)]) == 0
    assert cli.main(["status", "--megatron-dir", str(tree)]) == 0
    assert cli.main(["apply", "--megatron-dir", str(tree / "nowhere")]) == 2
    assert "no megatron/training/checkpointing.py" in capsys.readouterr().err


def test_make_patch_status_reports_an_unpatched_tree_without_failing_make(tmp_path):
    """`make patch-status` on an unpatched tree printed "not patched" and then make's
    "*** Error 1", which reads like a crash; a tree the command cannot read still fails."""
    import os
    import sys

    checkpointing = tmp_path / patching.TARGET
    checkpointing.parent.mkdir(parents=True)
    checkpointing.write_text("def save_checkpoint():\n    pass\n\n\ndef load_checkpoint():\n    pass\n")
    make = ["make", "-s", "-C", REPO, "patch-status", f"MEGATRON_DIR={tmp_path}", f"PYTHON={sys.executable}"]
    make.append(f"VENV={tmp_path / 'no-venv'}")  # the command runs with this interpreter
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run(make, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{checkpointing}: not patched" in result.stdout and "make apply-patches" in result.stdout
    assert "Error" not in result.stdout + result.stderr
    checkpointing.write_text("def broken(:\n")
    result = subprocess.run(make, capture_output=True, text=True, env=env)
    assert result.returncode != 0 and "is not valid Python" in result.stderr


def test_what_a_tree_or_a_series_can_break_is_one_line_and_exit_2(tree, tmp_path, capsys):
    """Exit 1 means "not patched" (status) or drift: a crash must not look like either."""
    a_file = tmp_path / "series-file"
    a_file.write_text("")
    assert cli.main(["apply", "--megatron-dir", str(tree), "--patches", str(a_file)]) == 2
    assert "Not a directory" in capsys.readouterr().err
    target(tree).write_text("def broken(:\n")
    for command in ("status", "apply"):
        assert cli.main([command, "--megatron-dir", str(tree)]) == 2, command
        assert f"{target(tree)}:1 is not valid Python" in capsys.readouterr().err, command
    (tree / "megatron" / "core" / "optimizer" / "distrib_optimizer.py").write_text("class (:\n")  # pinned code
    assert cli.main(["drift", "--megatron-dir", str(tree)]) == 2
    assert "distrib_optimizer.py:1 is not valid Python" in capsys.readouterr().err
    target(tree).write_bytes(b"\xff\xfe not utf-8")
    assert cli.main(["status", "--megatron-dir", str(tree)]) == 2
    assert f"{target(tree)} is not UTF-8 text" in capsys.readouterr().err


def test_a_git_apply_that_fails_after_its_check_leaves_the_file_and_says_why(tree, monkeypatch, capsys):
    """As on a read-only tree (which root, running the tests, cannot make here): the check
    passes, the apply fails having written nothing. Git is faked for that one call."""
    real = patching._git_apply

    def failing(root, patches, *flags):
        if "--check" in flags:
            return real(root, patches, *flags)
        return subprocess.CompletedProcess([], 1, "", "error: unable to write file: Read-only file system")

    before = target(tree).read_bytes()
    monkeypatch.setattr(patching, "_git_apply", failing)
    assert cli.main(["apply", "--megatron-dir", str(tree)]) == 2
    assert "is unchanged: error: unable to write file: Read-only file system" in capsys.readouterr().err
    assert target(tree).read_bytes() == before


def test_a_tree_patched_for_abi_1_reverts_with_its_own_series_and_takes_this_one(tree):
    """An upgrade: the tree carries ABI 1's series (its save passes no async request);
    revert finds that series under patches/abi1, and this version's applies after it."""
    original = target(tree).read_bytes()
    patching._apply_series(tree, patching.series(patching.DEFAULT_PATCHES_DIR / "abi1"), reverse=False)
    assert (patching.status(tree).state, patching.status(tree).abi) == ("other-abi", 1)
    with pytest.raises(patching.PatchError, match="Revert those hooks first"):
        patching.apply(tree)
    assert patching.revert(tree).startswith("reverted 3 patches")
    assert target(tree).read_bytes() == original
    patching.apply(tree)
    assert "ckpt_type, async_save_request)" in target(tree).read_text()
    # The async request is a local of save_checkpoint, set before the hook runs.
    lines = target(tree).read_text().splitlines()
    hook = next(i for i, line in enumerate(lines) if "_optimizer_state_hooks.save(" in line)
    assert any("async_save_request = None" in line for line in lines[:hook])
