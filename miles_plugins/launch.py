"""Run a Megatron-LM training script with optimizer-state streaming available.

    python -m miles_plugins.launch SCRIPT.py [script args] [--stream-optimizer-state-to-disk ...]
    torchrun --nproc-per-node=8 -m miles_plugins.launch SCRIPT.py [script args] ...

For people who run Megatron-LM's own ``pretrain_gpt.py`` and its siblings and
have no launcher code to add two lines to. The script runs unmodified, as
``python SCRIPT.py`` would run it (as ``__main__``, its directory first on
``sys.path``, ``sys.argv`` = ``[SCRIPT.py, *args]``). Before it starts, two names
of Megatron-LM's training package are wrapped in memory (no patch hunks):

- ``megatron.training.arguments.parse_args`` (and any module that imported it by
  name): the script's ``extra_args_provider`` is followed by
  :func:`~miles_plugins.optimizers.args.add_arguments`, so Megatron's parser
  knows the streaming flags;
- ``megatron.training.training.get_megatron_optimizer``, which
  ``setup_model_and_optimizer`` calls: once it has built the optimizer,
  :func:`setup_optimizer_state_streaming` turns streaming on (a no-op without
  ``--stream-optimizer-state-to-disk``), before ``load_checkpoint`` runs.

Streaming still needs the checkpoint hooks of the patch series in the tree
(``make apply-patches``): with the flag on, an unpatched tree is refused before
the script starts. So is a script that trains without going through
``megatron.training`` (checked when its training loop starts, and at its end).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Callable
from typing import Any

USAGE = """usage: python -m miles_plugins.launch SCRIPT.py [script args]
       torchrun [torchrun args] -m miles_plugins.launch SCRIPT.py [script args]

Runs a Megatron-LM training script (pretrain_gpt.py and its siblings) unmodified,
with the optimizer-state streaming flags added to Megatron's argument parser and
streaming set up right after the optimizer is built. Turn it on with
--stream-optimizer-state-to-disk (see the README for the other flags)."""

STREAM_FLAG = "--stream-optimizer-state-to-disk"


class LaunchError(RuntimeError):
    """The script cannot be run with streaming as asked; the message says why."""


class _Hooks:
    """What the wrapped Megatron names saw while the script ran."""

    def __init__(self) -> None:
        self.parsed: argparse.Namespace | None = None
        self.optimizers = 0

    @property
    def streaming(self) -> bool:
        return bool(getattr(self.parsed, "stream_optimizer_state_to_disk", False))

    def install(self) -> None:
        import megatron.training.arguments as arguments
        import megatron.training.training as training

        original_parse = arguments.parse_args
        self._rebind("parse_args", original_parse, self._wrap_parse(original_parse))
        original_build = training.get_megatron_optimizer
        training.get_megatron_optimizer = self._wrap_build(original_build)
        training.train = self._wrap_train(training.train)

    @staticmethod
    def _rebind(name: str, original: Callable, wrapper: Callable) -> None:
        """Replace ``original`` under ``name`` in every loaded ``megatron.training`` module
        that holds it (older trees import ``parse_args`` by name into ``initialize``)."""
        for module_name, module in list(sys.modules.items()):
            if module_name.startswith("megatron.training") and getattr(module, name, None) is original:
                setattr(module, name, wrapper)

    def _wrap_parse(self, original: Callable) -> Callable:
        from miles_plugins.optimizers.args import add_arguments

        def parse_args(extra_args_provider=None, *args: Any, **kwargs: Any) -> argparse.Namespace:
            def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
                if extra_args_provider is not None:
                    parser = extra_args_provider(parser)
                return add_arguments(parser)

            self.parsed = original(provider, *args, **kwargs)
            return self.parsed

        return parse_args

    def _wrap_build(self, original: Callable) -> Callable:
        from miles_plugins.optimizers.nvme_stream import setup_optimizer_state_streaming

        def get_megatron_optimizer(*args: Any, **kwargs: Any) -> Any:
            from megatron.training import get_args

            optimizer = original(*args, **kwargs)
            setup_optimizer_state_streaming(get_args(), optimizer)
            self.optimizers += 1
            return optimizer

        return get_megatron_optimizer

    def _wrap_train(self, original: Callable) -> Callable:
        def train(*args: Any, **kwargs: Any) -> Any:
            self.check_set_up("its training loop started")
            return original(*args, **kwargs)

        return train

    def check_set_up(self, when: str) -> None:
        """Refuse a run that asked for streaming but whose optimizer never went
        through ``setup_model_and_optimizer``: it would train with the state resident."""
        if self.streaming and not self.optimizers:
            raise LaunchError(
                f"{STREAM_FLAG} is on, but {when} without an optimizer built by megatron.training's "
                "setup_model_and_optimizer (get_megatron_optimizer), so nothing streams. The launcher serves "
                "scripts that train through megatron.training.pretrain; elsewhere call "
                "setup_optimizer_state_streaming(args, optimizer) right after building the optimizer"
            )


def _import_megatron_training(script: str) -> None:
    try:
        import megatron.training.arguments  # noqa: F401
        import megatron.training.training  # noqa: F401
    except ImportError as exc:
        raise LaunchError(
            f"cannot import Megatron-LM's training package ({exc}): run {script} from a Megatron-LM checkout "
            "(the launcher puts the script's directory first on sys.path, as python does) or put one on "
            "PYTHONPATH"
        ) from exc


def run(script: str, script_args: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``script_args``, hooks installed."""
    from megatron_hooks.checkpoint import HooksNotInstalledError, check_patched

    # As `python SCRIPT.py`: the script's directory, not the working directory, comes first.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    _import_megatron_training(script)
    if STREAM_FLAG in script_args:
        try:
            check_patched()
        except HooksNotInstalledError as exc:
            raise LaunchError(str(exc)) from exc
    hooks = _Hooks()
    hooks.install()
    sys.argv = [script, *script_args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    if STREAM_FLAG in script_args and hooks.parsed is None:
        raise LaunchError(
            f"{script} never parsed its arguments through megatron.training.arguments.parse_args, so "
            f"{STREAM_FLAG} was never seen and nothing streamed. The launcher serves scripts that go through "
            "megatron.training (pretrain_gpt.py and its siblings)"
        )
    hooks.check_set_up(f"{script} finished")


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
        print(f"miles_plugins.launch: no such script: {script}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        run(script, script_args)
    except LaunchError as exc:
        print(f"miles_plugins.launch: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
