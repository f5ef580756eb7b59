"""Optimizer-state streaming: keep fp32 mains and Adam moments off the accelerator.

Public entry points:

- :class:`StreamConfig`: the settings.
- :class:`StreamingStore`: the bucket lifecycle (step, refresh, save, load).
- :class:`StreamedOptimizer`: the plain-PyTorch front end over a
  ``torch.optim.Adam``/``AdamW``.

They are imported on first use, so that ``miles_plugins.optimizers.megatron.pins`` (read
by the torch-free ``python -m megatron_hooks drift``) does not import torch.
"""

import importlib

_EXPORTS = {
    "CheckpointMismatchError": "miles_plugins.optimizers.errors",
    "StepStats": "miles_plugins.optimizers.step.entries",
    "StoreUnusableError": "miles_plugins.optimizers.errors",
    "StreamConfig": "miles_plugins.optimizers.config",
    "StreamConfigError": "miles_plugins.optimizers.errors",
    "StreamIOError": "miles_plugins.optimizers.errors",
    "StreamedOptimizer": "miles_plugins.optimizers.torch_front",
    "StreamingStore": "miles_plugins.optimizers.store.streaming_store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
