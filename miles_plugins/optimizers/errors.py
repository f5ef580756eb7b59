"""The errors optimizer-state streaming raises: one type per condition.

- :class:`StreamConfigError`: a setting, or a combination of settings, that
  cannot work (raised before anything is written).
- :class:`StreamIOError`: a file or directory operation that could not
  complete: a read, write, create or rename that failed or stopped short, a
  disk too full for what must be written (``errno.ENOSPC``, also when a
  free-space check refuses before writing), and a symlink or file found where
  a private directory belongs (``errno.ELOOP``: refused, never followed).
- :class:`StreamIOTimeout`: transfers that did not finish within
  ``io_timeout_s`` (a hung drive).
- :class:`CheckpointMismatchError`: a saved state that cannot be loaded into
  this store (damaged, tampered, or written for another layout or format).
- :class:`StoreUnusableError`: the store refuses to go on: it was closed, or a
  failure left it without a consistent state.

No torch here: the scratch purge command imports this module alone.
"""

from __future__ import annotations

import errno


class StreamConfigError(ValueError):
    """A streaming setting that cannot work; the message says which and why."""


class StreamIOError(OSError):
    """A file operation on the streamed state that could not complete.

    ``path`` and ``offset`` name where it failed; ``errno`` carries the OS
    error (``EIO`` when there was none, e.g. a short read at end of file).
    """

    def __init__(self, message: str, path: str, offset: int = 0, err: int | None = None) -> None:
        super().__init__(err if err is not None else errno.EIO, message)
        self.path = path
        self.offset = offset

    def __str__(self) -> str:
        return self.strerror


class StreamIOTimeout(StreamIOError):
    """Transfers that did not finish in time (a hung drive). They may still be
    running: the memory they target must not be reused."""


class CheckpointMismatchError(RuntimeError):
    """A saved streamed state that cannot be loaded into this store; the message says
    every way it differs (dtype, layout, topology, checksum, ...)."""


class StoreUnusableError(RuntimeError):
    """The store was closed, or holds no consistent state after a failure; the
    message says which and what to do."""
