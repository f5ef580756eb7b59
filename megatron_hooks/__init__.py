"""The out-of-tree half of the Megatron-LM checkpoint hooks.

The patch series in ``patches/`` adds two call sites to Megatron-LM's
``megatron/training/checkpointing.py``; everything those lines call lives here,
so it can change without re-patching Megatron. This package must stay importable
without torch: the patch tooling and the drift check run where torch is absent.
"""
