"""Host memory for the state and for staging: exactly sized, page-aligned, pinned on request.

Every host buffer the homes and engines use is a :class:`HostMemory`: the host
home's bucket buffers, the engines' staging chunks, an offloaded device home.
"""

from __future__ import annotations

import errno
import mmap
import weakref

import torch

from miles_plugins.optimizers.errors import StreamIOError

# cudaHostRegisterPortable: pinned for every CUDA context, as torch's pinned memory is.
_HOST_REGISTER_PORTABLE = 1
# Linux only; elsewhere (no fork-time copy of pinned pages to avoid) None.
_MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", None)


class HostMemory:
    """``nbytes`` of host memory, exactly that size and page-aligned (direct I/O
    needs the alignment): an anonymous private mapping, page-locked when ``pin``
    so host<->device copies run as DMA. The pinning is ``cudaHostRegister`` on
    the mapping, not torch's pinned allocator, which rounds every size up to a
    power of two (up to twice the host memory asked for). ``release()`` unpins.

    The mapping is left out of forked children (``MADV_DONTFORK``): Linux copies
    the DMA-pinned pages of a private mapping into the child at fork time, so
    every DataLoader worker Megatron forks after setup would otherwise double the
    host home. A child never touches the state; where it forks and execs
    (subprocess), nothing changes."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        try:
            # Private: a shared anonymous mapping would be shmem, counted as page cache.
            self._mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            raise StreamIOError(
                f"cannot allocate {nbytes} bytes of host memory: {exc.strerror}", "<host memory>", 0, exc.errno
            ) from exc
        if _MADV_DONTFORK is not None:
            self._mapping.madvise(_MADV_DONTFORK)  # before pinning: the pages must never reach a child
        self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)[:nbytes]
        self.view = memoryview(self._mapping)[:nbytes]  # for os.preadv / os.pwritev
        self._pinned = False
        if pin and nbytes:
            err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
            if err:
                raise StreamIOError(
                    f"cannot page-lock {nbytes} bytes of host memory (cudaHostRegister error {err}); "
                    "raise the locked-memory limit (ulimit -l) or give the process more memory",
                    "<host memory>",
                    0,
                    errno.ENOMEM,
                )
            self._pinned = True
            # Unpinned when dropped unreleased too (a store never closed), before its mapping
            # can go: an address range unmapped while registered fails the next registration
            # that lands on it. Not at interpreter exit, which frees both.
            self._unpin = weakref.finalize(self, _unregister, self.tensor.data_ptr())
            self._unpin.atexit = False

    @property
    def pinned(self) -> bool:
        """Whether the memory is page-locked (device copies to and from it are DMA)."""
        return self._pinned

    def release(self) -> None:
        """Unpin the memory (the mapping itself goes with the last reference to it)."""
        if self._pinned:
            self._unpin()
            self._pinned = False


def _unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)
