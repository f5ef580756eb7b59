"""Megatron-LM dev's chunked optimizer-state offload (NVIDIA/Megatron-LM PR #6244, seen at
dev d48bd6be): the peer the suite runs beside our modes, from a dev checkout named by
``$MEGATRON_DEV_DIR`` (its ``pretrain_gpt.py``, its ``megatron``).
"""

from __future__ import annotations

import os

DEV_DIR_ENV = "MEGATRON_DEV_DIR"
# How a checkout is told to have the feature: the offloader's module, and the config field
# that turns it on.
DEV_OFFLOADER_FILE = "megatron/core/optimizer/cpu_offloading/chunked_optimizer_state_offload.py"
DEV_CONFIG_FILE = "megatron/core/optimizer/optimizer_config.py"
DEV_CONFIG_FIELD = "chunked_optimizer_state_offload"
# --optimizer-state-offload-chunk-size-mb: the dev README's example. The flag's default, 0,
# restores all selected moments at once, so the GPU window is not bounded at all.
DEV_CHUNK_MB = 256


def checkout_missing() -> str | None:
    """Why ``$MEGATRON_DEV_DIR`` is no checkout with dev's chunked offload, or None. Read,
    not imported: each run imports the ``megatron`` of its own tree."""
    root = os.environ.get(DEV_DIR_ENV)
    if not root:
        return f"needs {DEV_DIR_ENV}: a Megatron-LM dev checkout with chunked optimizer-state offload (PR #6244)"
    try:
        with open(os.path.join(root, DEV_CONFIG_FILE)) as f:
            config = f.read()
    except OSError:
        return f"{DEV_DIR_ENV}={root} has no {DEV_CONFIG_FILE}: not a Megatron-LM checkout"
    if DEV_CONFIG_FIELD not in config or not os.path.isfile(os.path.join(root, DEV_OFFLOADER_FILE)):
        return f"{DEV_DIR_ENV}={root} lacks chunked optimizer-state offload (PR #6244: {DEV_OFFLOADER_FILE})"
    return None


def dev_flags(fraction: float) -> list[str]:
    """Dev's flags for offloading ``fraction`` of the optimizer state."""
    return [
        "--chunked-optimizer-state-offload",
        "--optimizer-state-offload-fraction",
        f"{fraction:g}",
        "--optimizer-state-offload-chunk-size-mb",
        str(DEV_CHUNK_MB),
    ]
