"""The fused kernels' registry: whether they serve a tensor, and the kernels' module for
a device.

Triton takes a while to import and CPU hosts need none of it, so ``triton_kernels`` is
imported when the kernels are first wanted; they are then compiled and checked on each
device by their self-test (``kernel_self_test.py``) before they convert any state there.
Where Triton is not installed, or the kernels do not build on a device or store other
bytes than the reference there, the reference formulations serve (with a warning) for
the rest of the process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from types import ModuleType

import torch

from miles_plugins.optimizers.formats.kernel_self_test import self_test

logger = logging.getLogger(__name__)

# MILES_FUSED_CODEC=0 keeps the reference formulations on CUDA too (a kill switch; the
# codec bench also flips it to time both in one process).
enabled = os.environ.get("MILES_FUSED_CODEC", "1") != "0"


def for_device(device: torch.device | None = None) -> ModuleType | None:
    """The kernels' module for ``device`` (the current CUDA device when not given),
    imported, compiled and self-tested there on first use; None where they cannot serve
    it (see the module's docstring)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _checked(device)


@functools.cache
def _checked(device: torch.device) -> ModuleType | None:
    try:
        from miles_plugins.optimizers.formats import triton_kernels
    except ImportError:
        return None
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            self_test(triton_kernels, device)
    except Exception as exc:  # a compiler, cache directory or Triton version that fails here, not mid-step
        logger.warning(
            "fused codec kernels unavailable on %s (%s: %s); using the torch reference", device, type(exc).__name__, exc
        )
        return None
    return triton_kernels


def serve(t: torch.Tensor) -> bool:
    """Whether the fused kernels serve ``t``: a CUDA tensor, the kernels built and
    self-tested on its device (:func:`for_device`), not switched off (``enabled``)."""
    return enabled and t.is_cuda and for_device(t.device) is not None
