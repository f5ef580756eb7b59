"""How the state's bytes are laid out and encoded, in memory and on disk.

Owns the bucket layout (segments, 4096-byte alignment, how entries are cut into
buckets: ``layout``), the in-place dtype conversions done in chunks
(``convert``), the exact int16 remainder mains (``remainder``) and the 8-bit
blockwise moments (``quant8``). Pure tensor arithmetic on given buffers: it
moves no bytes and touches no files. May import ``miles_plugins.optimizers.errors``
and torch, nothing else of the package: every other subpackage builds on it.
"""
