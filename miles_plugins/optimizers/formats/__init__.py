"""How the state's bytes are laid out and encoded, in memory and on disk.

Owns the bucket layout (segments, 4096-byte alignment, how entries are cut into
buckets: ``layout``) and the storage formats, encoded and decoded inside the fp32
tensors' own storage. Bottom up, each module importing only those before it:

- ``convert``: in-place dtype conversions (bf16) and the conversion chunks;
- ``quant8``: the 8-bit blockwise moments, their definition and reference;
- ``remainder``: the exact int16 remainder mains and their exceptions, definition and
  reference;
- ``fused``: the host side of the fused Triton kernels (``triton_kernels``) for the
  8-bit codec and the remainder decoder; ``fused_remainder``: the fused remainder
  encoder and its exception slots;
- ``kernel_self_test``: the kernels' bytes against the reference on a device;
- ``kernels``: the registry saying where the fused kernels serve (self-tested);
- ``entry_codecs``: what the store's codec calls: the fused kernels where the registry
  says they serve, the reference elsewhere.

Pure tensor arithmetic on given buffers: it moves no bytes and touches no files. May
import ``miles_plugins.optimizers.errors`` and torch, nothing else of the package: every
other subpackage builds on it.
"""
