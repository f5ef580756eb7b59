"""A save that runs on a thread of its own while training goes on.

The save's :class:`~miles_plugins.optimizers.checkpoint.writer.Snapshot` names the
bucket bytes as they were when it was taken; the steps that run meanwhile must not
change them before they are copied. :meth:`BackgroundSave.before_overwrite` is the
guard the store's walk calls before it fetches a bucket: where that step's writes
would land on bytes the save has not copied yet (a bucket written in place, or a
disk bucket's slot at its second step after the save), it waits for that bucket's
export. So a step after a background save costs at most the save's remaining time,
bucket by bucket, and no memory: on the disk tier the first step after the save
writes the spare slots and waits for nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from miles_plugins.optimizers.checkpoint.writer import CheckpointWriter, PendingWrite
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.host_memory import HostMemory

logger = logging.getLogger(__name__)


class BackgroundSave:
    """One save written by a thread of its own (``save_to(..., asynchronous=True)``).

    :meth:`wait` returns once the save is complete and in place (raising its error
    where it failed: the previous save is then as it was); :meth:`done` says whether
    it has ended. The thread is not a daemon: the interpreter's exit waits for it.
    """

    def __init__(
        self, write: PendingWrite, buckets: Sequence[BucketLayout], on_end: Callable[[], None] = lambda: None
    ) -> None:
        """``write``: the save :meth:`CheckpointWriter.begin` made ready; ``on_end`` runs
        on the save's thread once it has ended (it releases the save's own staging)."""
        self._write, self._buckets, self._on_end = write, buckets, on_end
        self._exported: set[int] = set()
        self._ended = False
        self._state = "new"  # then "running" (by the thread) or "abandoned" (by start), whichever first
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        # What the save cost the steps that ran beside it (accounting, for the bench and the log).
        self.waited_buckets, self.waited_s = 0, 0.0
        self._thread = threading.Thread(target=self._run, name=f"save {write.parts.name}")

    @classmethod
    def begin(
        cls, writer: CheckpointWriter, base_dir: str, steps_taken: int, staging_bytes: int, buckets
    ) -> BackgroundSave:
        """A save by ``writer`` into ``base_dir``, snapshotted, ready to :meth:`start`, staging
        through host memory of its own (``staging_bytes``, released when it ends). Where this
        fails (an interrupt included), nothing of the save is left."""
        buffer = HostMemory(staging_bytes, pin=torch.cuda.is_available())
        pending = None
        try:
            pending = writer.begin(base_dir, steps_taken, buffer)
            return cls(pending, buckets, buffer.release)
        except BaseException:
            try:
                if pending is not None:
                    pending.abandon()
            finally:
                buffer.release()
            raise

    def start(self) -> None:
        """Start the thread; where it cannot start, the save is abandoned (nothing of it
        is left but the previous save) and the error raised. An interrupt that arrives
        once the thread runs is raised too, the save going on (:meth:`done` tells which)."""
        try:
            self._thread.start()
        except BaseException:
            if self._claim("abandoned"):  # the thread never ran, and now never will
                try:
                    self._write.abandon()
                finally:
                    self._end()
            raise

    def _claim(self, state: str) -> bool:
        """Move from "new" to ``state`` ("running" or "abandoned"); False where the other came first."""
        with self._changed:
            if self._state != "new":
                return False
            self._state = state
            return True

    def _run(self) -> None:
        if not self._claim("running"):
            return  # abandoned by a start() that was interrupted before this thread ran
        try:
            self._write.run(exported=self._mark_exported)
        except BaseException as exc:
            self._error = exc
            logger.error("the background save of %s to %s failed: %s", self._write.parts.name, self._write.final, exc)
        finally:
            self._end()

    def _end(self) -> None:
        try:
            self._on_end()
        finally:
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def _mark_exported(self, index: int) -> None:
        with self._changed:
            self._exported.add(index)
            self._changed.notify_all()

    def before_overwrite(self, index: int) -> None:
        """Before a step fetches bucket ``index``: wait, if its writes would land on bytes
        the save still has to copy, until they are copied (or the save has ended)."""
        if self._ended or index in self._exported:
            return
        backing, snapshot = self._write.parts.backing, self._write.snapshot.bucket_bytes
        if not backing.overwrites(self._buckets[index], snapshot):
            return
        start = time.perf_counter()
        with self._changed:
            while not self._ended and index not in self._exported:
                self._changed.wait()
        self.waited_buckets += 1
        self.waited_s += time.perf_counter() - start

    def done(self) -> bool:
        """Whether the save has ended, complete or failed."""
        return self._ended

    def wait(self, timeout_s: float | None = None) -> None:
        """Return once the save is complete and in place; raise its error where it
        failed, or :class:`TimeoutError` where it is still running after ``timeout_s``."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the background save of {self._write.parts.name} is still running")
        if self._error is not None:
            raise self._error
