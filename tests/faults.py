"""Deterministic fault injection at the I/O boundary.

Every byte the store moves to or from a file goes through ``os.preadv`` /
``os.pwritev`` (``io.pread_full`` / ``io.pwrite_full``), and files are sized
with ``os.posix_fallocate``. :class:`FaultPlan` wraps those three calls for
files under one directory, counts them, and makes the *n*-th one (and,
with ``times``, the ones after it) misbehave:

- ``"eio"`` / ``"enospc"``: raise ``OSError`` with that errno (a dying drive, a full disk);
- ``"short"``: move half the bytes and return that count (legal, and the
  caller must go on); on a direct-I/O file, whole 4096-byte blocks only, as the
  kernel does there (a transfer of one block then completes);
- ``"eof"``: return 0 (a read past the end of a truncated file; a write that
  makes no progress);
- ``"hang"``: block for ``hang_s`` seconds first (a stalled drive), then do the call;
- ``"late-eio"``: block for ``hang_s`` seconds, then raise ``EIO`` (a failure found late).

Calls on any other file pass straight through, so the rest of the process
(pytest, torch) is untouched. ``on_fault`` runs when a fault fires (a child
process uses it to tell its parent where it is before it is killed).
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable

FAULTS = ("eio", "enospc", "short", "eof", "hang", "late-eio")
BLOCK = 4096  # the logical block size direct I/O transfers in
OPS = ("read", "write", "fallocate")


class FaultPlan:
    def __init__(
        self,
        directory: str | os.PathLike,
        op: str,
        nth: int,
        fault: str,
        times: int | None = 1,
        hang_s: float = 0.0,
        on_fault: Callable[[], None] | None = None,
    ) -> None:
        if op not in OPS or fault not in FAULTS or nth < 1:
            raise ValueError(f"bad fault plan: {op=} {nth=} {fault=}")
        self.directory = os.path.realpath(directory)
        self.op, self.nth, self.fault, self.times = op, nth, fault, times
        self.hang_s = hang_s
        self.on_fault = on_fault
        self.calls = 0  # matching calls seen
        self.fired = 0  # faults injected
        self.paths: list[str] = []  # the files the faults hit
        self.shortened = 0  # "short" faults that really moved fewer bytes
        self._lock = threading.Lock()
        self._saved = {}

    # ---- the wrapped calls -------------------------------------------------

    def _ours(self, fd: int) -> str | None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        return path if path.startswith(self.directory + os.sep) else None

    def _should_fire(self, fd: int) -> str | None:
        path = self._ours(fd)
        if path is None:
            return None
        with self._lock:
            self.calls += 1
            last = None if self.times is None else self.nth + self.times - 1
            if self.calls < self.nth or (last is not None and self.calls > last):
                return None
            self.fired += 1
            self.paths.append(path)
        if self.on_fault is not None:
            self.on_fault()
        return path

    def _error(self, path: str) -> OSError:
        code = errno.EIO if self.fault in ("eio", "late-eio") else errno.ENOSPC
        return OSError(code, os.strerror(code), path)

    def _transfer(self, real, op: str):
        def wrapped(fd, buffers, offset, *args):
            path = self._should_fire(fd) if self.op == op else None
            if path is None:
                return real(fd, buffers, offset, *args)
            if self.fault == "late-eio":
                time.sleep(self.hang_s)
            if self.fault in ("eio", "enospc", "late-eio"):
                raise self._error(path)
            if self.fault == "eof":
                return 0
            if self.fault == "short":
                (buffer,) = buffers
                half = len(buffer) // 2
                if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                    half -= half % BLOCK
                if half == 0:
                    return real(fd, buffers, offset, *args)
                with self._lock:
                    self.shortened += 1
                return real(fd, [memoryview(buffer)[:half]], offset, *args)
            time.sleep(self.hang_s)
            return real(fd, buffers, offset, *args)

        return wrapped

    def _fallocate(self, real):
        def wrapped(fd, offset, length):
            path = self._should_fire(fd) if self.op == "fallocate" else None
            if path is not None:
                raise self._error(path)
            return real(fd, offset, length)

        return wrapped

    # ---- install / remove ----------------------------------------------------

    def __enter__(self) -> FaultPlan:
        self._saved = {name: getattr(os, name) for name in ("preadv", "pwritev", "posix_fallocate")}
        os.preadv = self._transfer(self._saved["preadv"], "read")
        os.pwritev = self._transfer(self._saved["pwritev"], "write")
        os.posix_fallocate = self._fallocate(self._saved["posix_fallocate"])
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            setattr(os, name, real)
