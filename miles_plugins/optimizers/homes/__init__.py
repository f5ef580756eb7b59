"""Where the state's bytes live and how they move between there and the device.

Owns the homes (pinned host memory, bucket files, device buffers), the engines
that schedule chunked transfers (synchronous, or reader/writer threads), the
placement of buckets on the gpu / host / disk homes and the ``auto`` budgets
measured from free memory, the per-process scratch directory and its purge, and
the private-file operations everything on disk goes through. It moves bytes; it
does not decide what a step computes. May import
``miles_plugins.optimizers.errors``, ``.config`` and ``.formats``, never
``step``, ``checkpoint`` or ``megatron``.

The modules, bottom up:

- ``fs``, ``locks``, ``dir_replace``: private files and directories, lock files,
  replacing a directory with no moment where neither is there;
- ``scratch``, ``scratch_purge``: the per-process scratch directory, and the
  command that removes what killed runs left;
- ``host_memory``, ``file_io``: exactly sized (pinned) host memory; reads and
  writes that finish, block checksums;
- ``protocols``: the contracts (``Engine``, ``Backing``, ``Handle``,
  ``DmaHandle``, ``PendingTransfers``) the step and the checkpoints are written against;
- ``backings``, ``device_backing``, ``placed_backing``: the disk and host homes'
  backings, the gpu home's, and the one that routes each bucket to its home's;
- ``transfer_batch``, ``engines``: the engines and the pending transfers they give back;
- ``placement``, ``device_home_moves``: where each bucket lives (policy), and
  which buckets an auto GPU budget moves in and out of the gpu home;
- ``memory_probes``, ``auto_budget``: what the host and the device have free,
  and the budgets decided from it.

This ``__init__`` imports nothing, so that the purge command (``fs``, ``locks``,
``scratch``, ``scratch_purge``) stays torch-free.
"""
