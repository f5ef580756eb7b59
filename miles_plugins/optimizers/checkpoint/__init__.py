"""Saved optimizer state: writing it, reading it back, and changing its shape.

Owns a store's checkpoints: the store's parts a checkpoint holds
(``persistence``), the save (``writer``) and the transactional load
(``reader``), the master's param-group options they carry (``group_options``),
the manifest each save writes and every load verifies (``manifest``), the
store's description the manifest records and a load compares (``description``),
resharding to another data-parallel, tensor, pipeline or expert parallel size,
and the operator's ``ckpt`` command (``cli``, run as ``python -m
miles_plugins.optimizers.ckpt``; its checks of a saved state without a live
store: ``inspection``). Resharding: the plan of which saved elements each new
rank takes (``reshard_plan`` by param name; at other TP, PP or EP sizes
``reshard_keys`` by key and global box, over the geometry of ``reshard_boxes``),
the saved stores a rank reads them from (``reshard_peers``), those ranges read
back verified (``saved_ranges``); done at load (``reshard_load``), or offline,
file to file (``reshard_offline``: the new ranks' stores planned by
``reshard_targets``, written and published by ``reshard_output``). May import
``miles_plugins.optimizers.errors``, ``.config``, ``.formats``, ``.homes`` and
``.step`` (the per-bucket optimizers and codec whose state a save holds);
never the store or ``megatron``.
"""
