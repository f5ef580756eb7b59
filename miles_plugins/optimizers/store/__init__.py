"""The streamed optimizer state of one optimizer and its step:
:class:`~miles_plugins.optimizers.store.streaming_store.StreamingStore`.

Between steps every streamed fp32 main and Adam moment has its storage released
(the tensor keeps its shape; its storage has 0 bytes); the bytes live in the
backing (two slots of files per bucket, or pinned host memory). ``step()`` walks
the buckets through the pipeline (``step/pipeline.py``): each bucket is fetched,
updated by the master optimizer's exact math (``step/adam.py``), its mains copied
into the model params, and written back, with at most ``buckets_in_flight``
buckets on the device at once. On the disk tier a step reads one slot of each
bucket and writes the other, and commits only after the last write: a step that
fails part way is rolled back.

With an overlap window (``config.overlap_bytes``) the step leaves its last
buckets' writes to ``StreamingStore.progress``, which the caller runs during
the next forward and backward; as they land it reads the next step's first
buckets into the room they leave.

The store's own modules: the store and its operations (``streaming_store``), its
parts held by name with their sizes (``assembled``), the factory that builds the
parts (``parts``) over what the entries become (``plan``), its health: usable,
damaged or closed (``health``), the step and the rewrite of the mains
(``step_runner``), the transfers between steps (``between_steps``), the device
memory a step may add (``bounds``) and the step's log lines (``log``). The parts
it is made of live below: where bytes live and how they move (``homes/``), the
walk, the gpu home and the overlap window (``step/``), the storage formats
(``step/codec.py``, ``formats/``), checkpoints (``checkpoint/``). May import all
of those; never ``megatron`` or the front ends.
"""
