"""Optimizer-state streaming: keep fp32 mains and Adam moments off the accelerator.

Public entry points:

- :class:`StreamConfig`: the settings.
- :class:`StreamingStore`: the bucket lifecycle (step, refresh, save, load).
- :class:`StreamedOptimizer`: the plain-PyTorch front end over a
  ``torch.optim.Adam``/``AdamW``.
"""

from miles_plugins.optimizers.config import StreamConfig, StreamConfigError
from miles_plugins.optimizers.io import StreamIOError
from miles_plugins.optimizers.store import StepStats, StreamingStore
from miles_plugins.optimizers.torch_front import StreamedOptimizer

__all__ = [
    "StepStats",
    "StreamConfig",
    "StreamConfigError",
    "StreamIOError",
    "StreamedOptimizer",
    "StreamingStore",
]
