"""What an engine gives back for transfers submitted together: pending transfers to wait on.

:class:`TransferBatch` satisfies :class:`~miles_plugins.optimizers.homes.protocols.PendingTransfers`.
"""

from __future__ import annotations

import concurrent.futures
import errno
import time
from collections.abc import Sequence

import torch

from miles_plugins.optimizers.errors import StreamIOTimeout

# How often a wait on queued device copies checks them: a poll, not a blocking
# synchronize, so that a wait keeps its timeout; a bucket's copies take milliseconds.
_EVENT_POLL_S = 50e-6


class TransferBatch:
    """Transfers submitted together; ``wait()`` returns when all are done and
    raises the first failure (after every transfer has stopped touching memory),
    or :class:`StreamIOTimeout` when they are not all done within ``timeout_s``
    (or the ``timeout_s`` given to that wait: an abort after a failure waits
    only for what is left of its own deadline). A transfer is a thread's request
    (a future) or copies queued on a device stream (a CUDA event recorded after them).
    With none, the transfers ran before the batch was made."""

    def __init__(
        self,
        *,
        futures: Sequence[concurrent.futures.Future] = (),
        name: str = "",
        timeout_s: float | None = None,
        events: Sequence[torch.cuda.Event] = (),
    ) -> None:
        self._futures = list(futures)
        self._events = list(events)
        self._count = len(self._futures) + len(self._events)
        self._name = name
        self._timeout_s = timeout_s

    def done(self) -> bool:
        """Whether every transfer has finished (successfully or not); never blocks."""
        return all(future.done() for future in self._futures) and all(event.query() for event in self._events)

    def wait(self, timeout_s: float | None = None) -> None:
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        _, pending = concurrent.futures.wait(self._futures, timeout=timeout_s)
        while self._events and not pending:
            if self._events[0].query():
                self._events.pop(0)
            elif deadline is not None and time.monotonic() >= deadline:
                pending = self._events
            else:
                time.sleep(_EVENT_POLL_S)
        if pending:
            raise StreamIOTimeout(
                f"I/O on {self._name} did not complete within {timeout_s:g} s: {len(pending)} of "
                f"{self._count} requests still pending (a hung drive, or device work that does not finish?)",
                self._name,
                0,
                errno.ETIMEDOUT,
            )
        first = None
        for future in self._futures:
            if future.exception() is not None:
                first = first or future.exception()
        self._futures.clear()
        if first is not None:
            raise first
