"""The launcher for Megatron-LM scripts: usage, refusals, and the two wrapped names.

A real ``pretrain_gpt.py`` needs CUDA, so here the scripts run against a
stand-in ``megatron/training`` package written into a temporary tree: the
few names the launcher wraps (``arguments.parse_args``,
``training.get_megatron_optimizer``, ``training.train``) with the same call
structure as Megatron-LM core_v0.19.0 (``parse_and_validate_args`` calls
``parse_args`` by its module-global name; ``pretrain`` calls
``setup_model_and_optimizer``, which calls ``get_megatron_optimizer``, then
``train``). The real script runs through the launcher in the GPU tier.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO

TRAINING = {
    "__init__.py": "from .global_vars import get_args\nfrom .training import pretrain\n",
    "global_vars.py": """
        _ARGS = None

        def get_args():
            return _ARGS

        def set_args(args):
            global _ARGS
            _ARGS = args
    """,
    "arguments.py": """
        import argparse

        from megatron.training.global_vars import set_args

        def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False):
            args = parse_args(extra_args_provider, ignore_unknown_args)
            set_args(args)
            return args

        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            parser = argparse.ArgumentParser(allow_abbrev=False)
            parser.add_argument("--use-distributed-optimizer", action="store_true")
            parser.add_argument("--train-iters", type=int, default=1)
            parser.add_argument("--yaml-cfg")
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            args = parser.parse_args()
            if args.yaml_cfg:  # as Megatron: the file's arguments replace the command line's
                args = argparse.Namespace(yaml_cfg=args.yaml_cfg, use_distributed_optimizer=True, train_iters=1)
            return args
    """,
    "training.py": """
        def get_megatron_optimizer(config, model_chunks):
            print("optimizer built", flush=True)
            return object()

        def setup_model_and_optimizer():
            return get_megatron_optimizer(None, [])

        def train(optimizer):
            print("training", flush=True)

        def pretrain():
            train(setup_model_and_optimizer())
    """,
}
PATCHED = """
    from megatron_hooks import checkpoint as _optimizer_state_hooks

    MILES_OPTIMIZER_STATE_HOOK_ABI = _optimizer_state_hooks.HOOK_ABI_VERSION
"""
PRETRAIN = """
    import sys

    from megatron.training import pretrain
    from megatron.training.arguments import parse_and_validate_args

    if __name__ == "__main__":
        args = parse_and_validate_args(extra_args_provider=lambda p: p.add_argument("--mine", default="x") and p)
        print("argv0", sys.argv[0], "mine", args.mine, "tier", args.stream_optimizer_state_tier, flush=True)
        pretrain()
"""


def _tree(tmp_path, patched=True, script=PRETRAIN) -> str:
    """A tree holding a stand-in megatron/training and ``script`` as pretrain.py."""
    package = tmp_path / "megatron" / "training"
    package.mkdir(parents=True)
    for name, body in TRAINING.items():
        (package / name).write_text(textwrap.dedent(body))
    (package / "checkpointing.py").write_text(textwrap.dedent(PATCHED) if patched else "")
    (tmp_path / "pretrain.py").write_text(textwrap.dedent(script))
    return str(tmp_path / "pretrain.py")


# Streaming on, with the settings it needs to get past parsing.
STREAMING = ("--stream-optimizer-state-to-disk", "--use-distributed-optimizer")


def _launch(*args, launcher=(sys.executable, "-m", "miles_plugins.launch"), cwd=REPO):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*launcher, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_without_a_script_it_prints_its_usage_and_exits_2():
    result = _launch()
    assert result.returncode == 2
    assert "usage: python -m miles_plugins.launch SCRIPT.py" in result.stderr


def test_a_missing_script_is_refused_with_exit_2(tmp_path):
    result = _launch(str(tmp_path / "nope.py"))
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = _launch(str(tmp_path))
    assert result.returncode == 2 and "is not a file" in result.stderr


def test_a_script_that_is_not_python_is_refused_in_one_line_with_exit_2(tmp_path):
    """`python -m miles_plugins.launch README.md` printed a SyntaxError traceback. A
    script that imports a broken module still shows that module's traceback."""
    readme = os.path.join(REPO, "README.md")
    result = _launch(readme)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"miles_plugins.launch: {readme} is not a Python script (line ")
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"PK\x03\x04\x00\x00torch")
    result = _launch(str(binary))
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "is not a Python script (it holds NUL bytes" in result.stderr
    (tmp_path / "broken.py").write_text("def (:\n")
    (tmp_path / "imports_broken.py").write_text("import broken\n")
    result = _launch(str(tmp_path / "imports_broken.py"))
    assert result.returncode == 1 and "Traceback" in result.stderr and "broken.py" in result.stderr


def test_the_script_runs_unmodified_with_the_streaming_flags_on_megatrons_parser(tmp_path):
    script = _tree(tmp_path)
    result = _launch(script, "--mine", "y", "--stream-optimizer-state-tier", "host")
    assert result.returncode == 0, result.stderr
    assert f"argv0 {script} mine y tier host" in result.stdout
    assert "--stream-optimizer-state-tier given, but --stream-optimizer-state-to-disk is off" in result.stderr
    assert result.stdout.index("optimizer built") < result.stdout.index("training")


def test_settings_streaming_cannot_work_with_are_refused_in_one_line_each(tmp_path):
    """Refused where the optimizer is about to be built (before a build streaming would leave
    without mains), on the arguments Megatron's own validation left, one line per reason
    (it was a traceback from inside the launcher)."""
    result = _launch(_tree(tmp_path), "--stream-optimizer-state-to-disk", "--offload-train-disk-dir", "a,,b")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "--use-distributed-optimizer is off" in result.stderr
    assert "--offload-train-disk-dir: directory must be a non-empty path" in result.stderr
    assert "optimizer built" not in result.stdout and "training" not in result.stdout.splitlines()


def test_streaming_is_set_up_with_megatrons_args_right_after_the_optimizer_is_built(tmp_path):
    """Megatron's parsed args and the built optimizer reach setup_optimizer_state_streaming
    before training starts: the stand-in's optimizer is no DistributedOptimizer, refused
    in one line."""
    result = _launch(_tree(tmp_path), *STREAMING)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "binds to Megatron's DistributedOptimizer only" in result.stderr and "builtins.object" in result.stderr
    assert "optimizer built" in result.stdout and "training" not in result.stdout.splitlines()


def test_an_unpatched_tree_is_refused_when_the_script_parses_its_arguments(tmp_path):
    result = _launch(_tree(tmp_path, patched=False), "--stream-optimizer-state-to-disk")
    assert result.returncode == 1
    assert "lacks the optimizer-state checkpoint hooks" in result.stderr and "make apply-patches" in result.stderr
    assert "argv0" not in result.stdout
    # Without streaming the launcher does not care.
    assert _launch(str(tmp_path / "pretrain.py")).returncode == 0


def test_a_script_that_puts_the_tree_on_sys_path_itself_is_checked_against_that_tree(tmp_path):
    """As Megatron-LM's examples/multimodal/train.py does: the tree is importable only
    once the script has run its first lines."""
    _tree(tmp_path)
    script = tmp_path / "examples" / "multimodal" / "train.py"
    script.parent.mkdir(parents=True)
    script.write_text(
        "import os, sys\n"
        "sys.path.append(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir))\n"
        + textwrap.dedent(PRETRAIN)
    )
    result = _launch(str(script), *STREAMING)
    # The tree passed the check; streaming then refuses the stand-in's optimizer, as it should.
    assert "binds to Megatron's DistributedOptimizer only" in result.stderr, result.stderr
    assert f"argv0 {script}" in result.stdout and "optimizer built" in result.stdout


def test_a_script_that_parses_its_own_arguments_is_refused(tmp_path):
    script = _tree(
        tmp_path,
        script="""
            import argparse
            argparse.ArgumentParser().parse_known_args()
            print("trained without megatron.training")
        """,
    )
    result = _launch(script, "--stream-optimizer-state-to-disk")
    assert result.returncode == 1
    assert "never parsed its arguments through megatron.training.arguments.parse_args" in result.stderr


def test_a_script_that_trains_with_an_optimizer_built_elsewhere_is_refused_when_training_starts(tmp_path):
    script = _tree(
        tmp_path,
        script="""
            from megatron.training import training
            from megatron.training.arguments import parse_and_validate_args

            parse_and_validate_args()
            training.train(object())
        """,
    )
    result = _launch(script, *STREAMING)
    assert result.returncode == 1
    assert "the training loop started without an optimizer built by megatron.training" in result.stderr
    assert "training" not in result.stdout.splitlines()


def test_an_optimizer_built_elsewhere_with_settings_streaming_refuses_names_them(tmp_path):
    """As --optimizer muon is, by a function the launcher does not wrap: at training's
    start the refusals of the settings are what it says, not only that nothing streams."""
    script = _tree(
        tmp_path,
        script="""
            from megatron.training import training
            from megatron.training.arguments import parse_and_validate_args

            parse_and_validate_args()
            training.train(object())
        """,
    )
    result = _launch(script, "--stream-optimizer-state-to-disk")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "cannot be used with:\n  - --use-distributed-optimizer is off" in result.stderr


def test_the_scripts_exit_status_is_the_launchers(tmp_path):
    assert _launch(_tree(tmp_path, script="import sys\nsys.exit(3)\n")).returncode == 3


@pytest.mark.parametrize("nproc", [1])
def test_it_runs_under_torchrun_as_a_module(tmp_path, nproc):
    script = _tree(tmp_path)
    torchrun = (sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone")
    result = _launch("-m", "miles_plugins.launch", script, "--mine", "z", launcher=torchrun)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mine z tier disk" in result.stdout


def test_a_symlinked_script_finds_the_tree_beside_its_real_file(tmp_path):
    """As python does: the script's real directory goes first on sys.path."""
    script = _tree(tmp_path / "tree")
    (tmp_path / "jobs").mkdir()
    link = tmp_path / "jobs" / "pretrain.py"
    link.symlink_to(script)
    result = _launch(str(link), "--mine", "q")
    assert result.returncode == 0, result.stderr
    assert "mine q" in result.stdout


def test_help_and_runs_that_build_no_optimizer_exit_cleanly(tmp_path):
    script = _tree(tmp_path)
    result = _launch(script, "--stream-optimizer-state-to-disk", "--help")
    assert result.returncode == 0, result.stderr
    assert "--stream-optimizer-state-tier" in result.stdout, "the streaming flags are in Megatron's help"
    evaluate_only = _tree(
        tmp_path / "eval",
        script="""
            from megatron.training.arguments import parse_and_validate_args
            parse_and_validate_args()
            print("evaluated")
        """,
    )
    result = _launch(evaluate_only, *STREAMING)
    assert result.returncode == 0 and "evaluated" in result.stdout, result.stderr
    # It cannot tell such a run from one with an optimizer of its own: it says nothing streamed.
    assert "built no optimizer through megatron.training's setup_model_and_optimizer" in result.stderr


def test_a_flag_megatrons_parsing_drops_is_refused(tmp_path):
    result = _launch(_tree(tmp_path), "--stream-optimizer-state-to-disk", "--yaml-cfg", "run.yaml")
    assert result.returncode == 1
    assert "--yaml-cfg replaces the command line" in result.stderr and "training" not in result.stdout.splitlines()


def test_nothing_is_imported_ahead_of_the_script_and_a_second_run_wraps_nothing_twice(tmp_path):
    script = _tree(
        tmp_path,
        script="""
            import sys
            print("imported before the script:", "megatron.training.training" in sys.modules)
            from megatron.training import training
            from megatron.training.arguments import parse_and_validate_args
            parse_and_validate_args()
            build = training.get_megatron_optimizer
            print("wrapped once:", not getattr(build.__wrapped__, "_miles_launch", False))
            training.pretrain()
        """,
    )
    driver = tmp_path / "driver.py"
    driver.write_text(
        f"import sys\nfrom miles_plugins import launch\nlaunch.run({script!r}, [])\nlaunch.run({script!r}, [])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, str(driver)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("imported before the script: False") == 1  # the second run finds them imported
    assert result.stdout.count("wrapped once: True") == 2
    assert result.stdout.count("optimizer built") == 2


def test_another_after_import_hook_on_the_same_module_coexists(tmp_path):
    """A second finder of the same kind (a test probe's, a profiler's) wraps the same
    module: both run, neither recurses into the other."""
    script = _tree(tmp_path)
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys\nfrom miles_plugins import launch\n"
        "sys.meta_path.insert(0, launch._AfterImport({'megatron.training.training': lambda m: print('other hook')}))\n"
        f"raise SystemExit(launch.main([{script!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, str(driver)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "other hook" in result.stdout and "optimizer built" in result.stdout


BYPASS = """
    import importlib.machinery
    import sys

    class First:  # resolves the training module itself, ahead of every other finder
        def find_spec(self, name, path, target=None):
            if name == "megatron.training.training":
                return importlib.machinery.PathFinder.find_spec(name, path)
            return None

    sys.meta_path.insert(0, First())
"""
PROBE = """
    import importlib.util

    importlib.util.find_spec("megatron.training.training")  # a probe, no import
"""


@pytest.mark.parametrize("prelude", [BYPASS, PROBE], ids=["finder-bypassed", "spec-probed-first"])
def test_training_is_wrapped_however_its_import_went(tmp_path, prelude):
    """Without the streaming flag nothing is imported ahead of the script, so the
    script's own import is the first."""
    check = """
        from megatron.training import training
        from megatron.training.arguments import parse_and_validate_args

        parse_and_validate_args()
        print("wrapped:", getattr(training.get_megatron_optimizer, "_miles_launch", False))
    """
    script = _tree(tmp_path, script=textwrap.dedent(prelude) + textwrap.dedent(check))
    result = _launch(script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wrapped: True" in result.stdout


def test_help_on_an_unpatched_tree_prints_help(tmp_path):
    result = _launch(_tree(tmp_path, patched=False), "--stream-optimizer-state-to-disk", "--help")
    assert result.returncode == 0, result.stderr
    assert "--stream-optimizer-state-tier" in result.stdout


def test_a_script_that_streams_its_own_optimizer_gets_no_warning(tmp_path):
    """It parses through megatron.training and calls setup_optimizer_state_streaming itself,
    as the README advises; the call's count stands in for a real DistributedOptimizer
    here (that needs CUDA), the launcher reads only the count."""
    script = _tree(
        tmp_path,
        script="""
            from megatron.training.arguments import parse_and_validate_args
            from miles_plugins.optimizers import nvme_stream

            parse_and_validate_args()
            nvme_stream.streamed_optimizers += 1  # what setup_optimizer_state_streaming counts
            print("own loop trained")
        """,
    )
    result = _launch(script, *STREAMING)
    assert result.returncode == 0 and "own loop trained" in result.stdout, result.stderr
    assert "warning" not in result.stderr
