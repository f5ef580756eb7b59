"""The streamed step, one bucket at a time.

Owns the walk over the buckets with at most ``buckets_in_flight`` on the device
(``pipeline``), one bucket's trip between its home and the device (``mover``),
a bucket in flight and the count of the bytes it holds (``flight``), the
per-bucket optimizers that reproduce the master optimizer's update exactly
(``adam``) with the small state each keeps (``bucket_optimizer``), the
conversion of each segment between its stored format and fp32 (``codec``, with
its CUDA graphs: ``graphs``), what a failed step can undo (``rollback``), the
entries the step runs over with its statistics (``entries``), the moves and
offload of the ``gpu`` home between steps (``gpu_home``) and the overlap window
that carries state across the step boundary (``overlap``). The store
(``miles_plugins.optimizers.store``) assembles these. May import
``miles_plugins.optimizers.errors``, ``.config``, ``.formats`` and ``.homes``;
never ``checkpoint``, ``megatron`` or the store.
"""
