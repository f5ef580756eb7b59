"""The tripwire: normalized-AST fingerprints, static checks over real wheels, the live
check against the installed megatron-core, and the opt-out."""

import ast
import shutil
import subprocess
import sys

import pytest

from ci.megatron_sources import wheel_tree
from megatron_hooks import fingerprint
from miles_plugins.optimizers.megatron.pins import PINS

SOURCE = '''
class A:
    def f(self, x):
        """Docstring."""
        # a comment
        return x + 1
'''


def fp(source, qualname="A.f"):
    return fingerprint.fingerprint_node(fingerprint.find_function(ast.parse(source), qualname))


def test_comments_docstrings_and_layout_do_not_count_code_does():
    reformatted = "class A:\n    def f(self,\n          x):\n        return (x +\n                1)  # other\n"
    assert fp(SOURCE) == fp(reformatted)
    assert fp(SOURCE) != fp(SOURCE.replace("x + 1", "x + 2"))
    assert fp(SOURCE) != fp(SOURCE.replace("return x + 1", "return 1 + x"))


@pytest.fixture(scope="module")
def wheel_019(tmp_path_factory):
    return wheel_tree("0.19.2", tmp_path_factory.mktemp("wheel"))


def test_every_pin_is_known_on_the_gpu_validated_release(wheel_019):
    findings = fingerprint.check_tree(PINS, str(wheel_019))
    assert [f.status for f in findings] == ["ok"] * len(PINS)


def test_a_hand_modified_function_trips_and_is_named_with_file_and_line(wheel_019, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(wheel_019, tree)
    path = tree / "megatron/core/optimizer/distrib_optimizer.py"
    text = path.read_text()
    old = "shard_model_param.data.copy_(shard_main_param)"
    assert text.count(old) == 1
    path.write_text(text.replace(old, "shard_model_param.data.copy_(shard_main_param * 1)"))
    findings = {f.pin.qualname: f for f in fingerprint.check_tree(PINS, str(tree))}
    drifted = findings["DistributedOptimizer._copy_main_params_to_model_params"]
    assert drifted.status == "drift"
    assert [q for q, f in findings.items() if not f.good] == ["DistributedOptimizer._copy_main_params_to_model_params"]
    message = drifted.explain()
    assert f"{path}:{drifted.line}" in message and "core_v0.19.0 5be9626" in message and "Recheck:" in message
    assert "def _copy_main_params_to_model_params" in path.read_text().splitlines()[drifted.line - 1]


def test_live_check_passes_on_the_installed_megatron_core():
    pytest.importorskip("megatron.core")
    assert all(f.status == "ok" for f in fingerprint.check_live(PINS))


def test_live_check_refuses_drift_unless_opted_out_for_that_function(monkeypatch, caplog):
    pytest.importorskip("megatron.core")
    pin = PINS[0]
    changed = fingerprint.Pin(pin.path, pin.qualname, (fingerprint.KnownShape("0" * 16, ("nowhere",)),), pin.recheck)
    with pytest.raises(
        fingerprint.DriftError, match=r"_copy_main_params_to_model_params at .*distrib_optimizer.py:\d+"
    ):
        fingerprint.check_live([changed])
    monkeypatch.setenv(fingerprint.ALLOW_DRIFT_ENV, "SomethingElse.f")
    with pytest.raises(fingerprint.DriftError):
        fingerprint.check_live([changed])
    monkeypatch.setenv(fingerprint.ALLOW_DRIFT_ENV, pin.qualname)
    assert fingerprint.check_live([changed])[0].status == "allowed-drift"
    assert "UPSTREAM DRIFT ALLOWED" in caplog.text


def test_drift_command_reads_the_registered_pins_and_exits_by_outcome(wheel_019, tmp_path):
    run = [sys.executable, "-m", "megatron_hooks", "drift", "--megatron-dir"]
    ok = subprocess.run([*run, str(wheel_019)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "DistributedOptimizer.step_with_ready_grads" in ok.stdout
    tree = tmp_path / "tree"
    shutil.copytree(wheel_019, tree)
    path = tree / "megatron/core/optimizer/optimizer.py"
    path.write_text(
        path.read_text().replace("self.optimizer.step()", "self.optimizer.step(); self.optimizer.step()", 1)
    )
    drift = subprocess.run([*run, str(tree)], capture_output=True, text=True)
    assert drift.returncode == 1 and "DRIFT: MixedPrecisionOptimizer.step_with_ready_grads" in drift.stdout


def test_megatron_hooks_imports_without_torch():
    code = (
        "import sys, megatron_hooks.checkpoint, megatron_hooks.patching, megatron_hooks.fingerprint, "
        "megatron_hooks.__main__, miles_plugins.optimizers.megatron.pins; assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_pin_names_plugin_code_that_exists():
    """A pin's owner is what a reader rechecks on drift: it must name real code."""
    import importlib

    for pin in PINS:
        module_path, _, attribute = pin.owner.rpartition(".")
        target = None
        while module_path and target is None:
            try:
                target = importlib.import_module(module_path)
            except ModuleNotFoundError:
                module_path, _, outer = module_path.rpartition(".")
                attribute = f"{outer}.{attribute}"
        for part in attribute.split("."):
            target = getattr(target, part)
        assert callable(target), pin.owner
