"""Run a Megatron-LM training script with optimizer-state streaming available.

    python -m miles_plugins.launch SCRIPT.py [script args] [--stream-optimizer-state-to-disk ...]
    torchrun --nproc-per-node=8 -m miles_plugins.launch SCRIPT.py [script args] ...

For people who run Megatron-LM's own ``pretrain_gpt.py`` and its siblings and
have no launcher code to add two lines to. The script runs unmodified, as
``python SCRIPT.py`` would run it (as ``__main__``, its directory first on
``sys.path``, ``sys.argv`` = ``[SCRIPT.py, *args]``). Before it starts, two names
of Megatron-LM's training package are wrapped in memory (no patch hunks):

- ``megatron.training.arguments.parse_args`` (as every module that imports it
  afterwards sees it): the script's ``extra_args_provider`` is followed by
  :func:`~miles_plugins.optimizers.megatron.args.add_arguments`, so Megatron's parser
  knows the streaming flags;
- ``megatron.training.training.get_megatron_optimizer``, which
  ``setup_model_and_optimizer`` calls: with streaming on it builds the
  optimizer without device memory for the fp32 mains (``build_without_mains``:
  the build's peak is then 6 bytes per param, not 10), and once it has built it,
  :func:`setup_optimizer_state_streaming` turns streaming on (a no-op without
  ``--stream-optimizer-state-to-disk``), before ``load_checkpoint`` runs.

Nothing is imported ahead of the script: each module is wrapped right after
its own code has run, when the script first imports it. Streaming still needs
the checkpoint hooks of the patch series in the tree (``make apply-patches``):
with ``--stream-optimizer-state-to-disk`` on the command line, the tree's
``megatron.training.checkpointing`` is checked when the script has parsed its
arguments with streaming on (its ``sys.path`` set up as it wants, nothing built
yet), and an unpatched tree is refused. Also refused: the flag given but
dropped by Megatron's parsing (``--yaml-cfg`` replaces the command line);
Megatron's training loop starting without an optimizer built through
``setup_model_and_optimizer``; a script that never parses its arguments
through ``megatron.training`` (when it ends). A script with its own training
loop and its own optimizer is beyond the launcher: it should call
:func:`setup_optimizer_state_streaming` itself.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import os
import runpy
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

USAGE = """usage: python -m miles_plugins.launch SCRIPT.py [script args]
       torchrun [torchrun args] -m miles_plugins.launch SCRIPT.py [script args]

Runs a Megatron-LM training script (pretrain_gpt.py and its siblings) unmodified,
with the optimizer-state streaming flags added to Megatron's argument parser and
streaming set up right after the optimizer is built. Turn it on with
--stream-optimizer-state-to-disk (docs/megatron.md lists every flag)."""

STREAM_FLAG = "--stream-optimizer-state-to-disk"
# How much of a script is read to tell a binary file (NUL bytes) from source code.
_BINARY_PROBE_BYTES = 1 << 16


class LaunchError(RuntimeError):
    """The script cannot be run with streaming as asked; the message says why."""


class _Hooks:
    """What the wrapped Megatron names saw during this run of a script."""

    def __init__(self, script_args: list[str]) -> None:
        self.flag_given = STREAM_FLAG in script_args
        self.parse_called = False
        self.parsed: argparse.Namespace | None = None
        self.optimizers = 0

    @property
    def streaming(self) -> bool:
        return bool(getattr(self.parsed, "stream_optimizer_state_to_disk", False))


# The run in progress: the wrappers report to it (installed once per process, they
# serve every run of it).
_current = _Hooks([])


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callbacks[name](module)`` right after module ``name``'s code has run:
    the module is complete, and nothing has imported names from it yet."""

    def __init__(self, callbacks: dict[str, Callable[[ModuleType], None]]) -> None:
        self.callbacks = callbacks
        self._searching: set[str] = set()  # another such finder asks all the others, this one too

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        callback = self.callbacks.get(name)
        if callback is None or name in self._searching:
            return None
        self._searching.add(name)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _CallbackLoader(spec.loader, lambda module: self._ran(name, module))
                    return spec
            return None
        finally:
            self._searching.discard(name)

    def _ran(self, name: str, module: ModuleType) -> None:
        """The module's code ran to the end: wrap it, once (a spec found by a mere
        probe, or a module whose code raised, leaves the callback armed)."""
        callback = self.callbacks.pop(name, None)
        if callback is not None:
            callback(module)


class _CallbackLoader(importlib.abc.Loader):
    """``loader``, with ``callback(module)`` after it executed the module."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self._loader, self._callback = loader, callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self._loader, name)


# The launcher's own finder: one per process, whatever the number of runs.
_finder = _AfterImport({})


def install() -> None:
    """Wrap the Megatron names. The modules are not imported here: the script
    imports them when it would anyway, and each is wrapped right after its code
    has run (see :class:`_AfterImport`), or at once when it was imported already."""
    callbacks = {"megatron.training.arguments": _hook_arguments, "megatron.training.training": _hook_training}
    for name, callback in callbacks.items():
        if name in sys.modules:
            callback(sys.modules[name])
        else:
            _finder.callbacks[name] = callback
    if _finder.callbacks and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _hook_arguments(arguments: ModuleType) -> None:
    arguments.parse_args = _mark(_wrap_parse(arguments.parse_args), arguments.parse_args)


def _hook_training(training: ModuleType) -> None:
    training.get_megatron_optimizer = _mark(
        _wrap_build(training.get_megatron_optimizer), training.get_megatron_optimizer
    )
    training.train = _mark(_wrap_train(training.train), training.train)


def _wrap_parse(original: Callable) -> Callable:
    def parse_args(extra_args_provider=None, *args: Any, **kwargs: Any) -> argparse.Namespace:
        from miles_plugins.optimizers.megatron.args import add_arguments

        def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return add_arguments(parser)

        hooks = _current
        hooks.parse_called = True
        # Before anything is built: training must be wrapped by now, even if its
        # import went around the finder (another finder resolved it first, say).
        training = sys.modules.get("megatron.training.training")
        if training is not None and not getattr(training.get_megatron_optimizer, "_miles_launch", False):
            _hook_training(training)
        hooks.parsed = original(provider, *args, **kwargs)  # --help exits in here, as it should
        if hooks.flag_given and not hooks.streaming:
            raise LaunchError(
                f"{STREAM_FLAG} is on the command line, but Megatron's parsed arguments have it off: "
                "--yaml-cfg replaces the command line with the file's arguments; set "
                "stream_optimizer_state_to_disk (and the other streaming settings) in the yaml"
            )
        if hooks.streaming:
            # Before the script spends minutes building its model (streaming turned on
            # from the command line or a yaml): an unpatched tree would save checkpoints
            # without the streamed state.
            from megatron_hooks.checkpoint import HooksNotInstalledError, check_patched

            try:
                check_patched()
            except HooksNotInstalledError as exc:
                raise LaunchError(str(exc)) from exc
        # The streaming settings are checked when the optimizer is about to be built, on the arguments
        # Megatron's own validate_args left (it turns settings on and off; --use-checkpoint-args
        # replaces them): here they would be refused wrongly.
        return hooks.parsed

    return parse_args


def _wrap_build(original: Callable) -> Callable:
    def get_megatron_optimizer(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        from megatron_hooks.checkpoint import HooksNotInstalledError
        from megatron_hooks.fingerprint import DriftError
        from miles_plugins.optimizers.errors import StreamConfigError
        from miles_plugins.optimizers.nvme_stream import build_without_mains, setup_optimizer_state_streaming

        try:
            with build_without_mains(get_args()):
                optimizer = original(*args, **kwargs)
            setup_optimizer_state_streaming(get_args(), optimizer)
        except (StreamConfigError, DriftError, HooksNotInstalledError) as exc:
            # What only the built optimizer (or the live Megatron) shows; a message, not a traceback.
            raise LaunchError(str(exc)) from exc
        _current.optimizers += 1
        return optimizer

    return get_megatron_optimizer


def _wrap_train(original: Callable) -> Callable:
    def train(*args: Any, **kwargs: Any) -> Any:
        if _current.streaming and not _current.optimizers:
            from megatron.training import get_args

            from miles_plugins.optimizers.megatron.refusals import refusals_of_args

            reasons = refusals_of_args(get_args())
            if reasons:  # e.g. --optimizer muon, built by a function of its own
                raise LaunchError(f"{STREAM_FLAG} cannot be used with:\n  - " + "\n  - ".join(reasons))
            raise LaunchError(
                f"{STREAM_FLAG} is on, but the training loop started without an optimizer built by "
                "megatron.training's setup_model_and_optimizer (get_megatron_optimizer), so nothing would "
                "stream. The launcher serves scripts that train through megatron.training.pretrain; "
                "elsewhere call setup_optimizer_state_streaming(args, optimizer) right after building "
                "the optimizer"
            )
        return original(*args, **kwargs)

    return train


def _mark(wrapper: Callable, original: Callable) -> Callable:
    """``wrapper``, unless ``original`` is one already (a second run in one process)."""
    if getattr(original, "_miles_launch", False):
        return original
    wrapper._miles_launch = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def run(script: str, script_args: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``script_args``, hooks installed."""
    # As `python SCRIPT.py`: the script's real directory, not the working directory, comes first.
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    # This project's packages stay importable when run from an uninstalled checkout (the
    # working directory just left the path); last, so nothing of the script's is shadowed.
    project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if project not in sys.path:
        sys.path.append(project)
    global _current
    hooks = _current = _Hooks(script_args)
    install()
    sys.argv = [script, *script_args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    if hooks.streaming and not hooks.optimizers and not _streamed_elsewhere():
        # An evaluation-only run builds no optimizer, and that is fine; a script with
        # its own optimizer that never streamed looks the same from here: say so.
        print(
            f"miles_plugins.launch: warning: {STREAM_FLAG} was on, but {script} built no optimizer through "
            "megatron.training's setup_model_and_optimizer, so no optimizer state streamed. A script that builds "
            "its own optimizer must call setup_optimizer_state_streaming(args, optimizer) itself",
            file=sys.stderr,
        )
    if hooks.flag_given and not hooks.parse_called:
        raise LaunchError(
            f"{script} never parsed its arguments through megatron.training.arguments.parse_args, so "
            f"{STREAM_FLAG} was never seen and nothing streamed. The launcher serves scripts that go through "
            "megatron.training (pretrain_gpt.py and its siblings)"
        )


def _streamed_elsewhere() -> bool:
    """Whether the script called setup_optimizer_state_streaming itself (and it streamed)."""
    nvme_stream = sys.modules.get("miles_plugins.optimizers.nvme_stream")
    return bool(nvme_stream is not None and nvme_stream.streamed_optimizers)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    script, script_args = argv[0], argv[1:]
    if not os.path.isfile(script):
        why = "is not a file" if os.path.exists(script) else "does not exist"
        print(f"miles_plugins.launch: the script {script} {why}\n\n{USAGE}", file=sys.stderr)
        return 2
    with open(script, "rb") as f:
        binary = b"\0" in f.read(_BINARY_PROBE_BYTES)
    if binary:  # Python refuses NUL bytes with a ValueError (3.11) or a SyntaxError (3.12)
        print(
            f"miles_plugins.launch: {script} is not a Python script (it holds NUL bytes: a binary file?); give "
            "the training script (pretrain_gpt.py or a sibling)",
            file=sys.stderr,
        )
        return 2
    try:
        run(script, script_args)
    except LaunchError as exc:
        print(f"miles_plugins.launch: {exc}", file=sys.stderr)
        return 1
    except SyntaxError as exc:
        if exc.filename is None or os.path.abspath(exc.filename) != os.path.abspath(script):
            raise  # a module the script imports: its traceback says where
        print(
            f"miles_plugins.launch: {script} is not a Python script (line {exc.lineno}: {exc.msg}); give the "
            "training script (pretrain_gpt.py or a sibling)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
