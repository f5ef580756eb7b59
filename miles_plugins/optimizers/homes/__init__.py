"""Where the state's bytes live and how they move between there and the device.

Owns the homes (pinned host memory, bucket files, device buffers), the engines
that schedule chunked transfers (synchronous, or reader/writer threads), the
placement of buckets on the gpu / host / disk homes and the ``auto`` budgets
measured from free memory, the per-process scratch directory and its purge, and
the private-file operations everything on disk goes through (``fs``). It moves
bytes; it does not decide what a step computes. May import
``miles_plugins.optimizers.errors``, ``.config`` and ``.formats``, never
``step``, ``checkpoint`` or ``megatron``. This ``__init__`` imports nothing, so
that the purge command (``fs`` and ``scratch`` only) stays torch-free.
"""
