"""The output of an offline reshard: new stores written as files, published all or nothing.

Each new store (:class:`~miles_plugins.optimizers.checkpoint.reshard_targets.NewStore`)
is filled by the same :class:`~miles_plugins.optimizers.checkpoint.reshard_load.ReshardedLoad`
a resharded load uses (the same plan, verified reads and requantization),
writing bucket files instead of a live store's slots, then its resident
moments, checksums and manifest (:func:`write_store`). All of them go into one
partial directory that :class:`OutputDirectory` renames into place when complete.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import torch

from miles_plugins.optimizers.checkpoint.manifest import CRC_BLOCK_BYTES, RESIDENT_FILE, Manifest
from miles_plugins.optimizers.checkpoint.reshard_load import ReshardedLoad
from miles_plugins.optimizers.checkpoint.reshard_peers import Peer
from miles_plugins.optimizers.checkpoint.reshard_targets import NewStore
from miles_plugins.optimizers.errors import CheckpointMismatchError, StreamIOError
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.file_io import file_crcs, pwrite_full
from miles_plugins.optimizers.homes.fs import (
    create_file,
    fsync,
    fsync_dir,
    make_dirs,
    make_private_dir,
    open_file,
    remove_private_dir,
    require_free_space,
)
from miles_plugins.optimizers.homes.host_memory import HostMemory
from miles_plugins.optimizers.homes.locks import lock_writer, unlock_file

# The size of each write into a new bucket file.
STAGING_BYTES = 16 << 20


def write_store(store: NewStore, directory: str, peers: Sequence[Peer], by_key: bool = False) -> int:
    """Write ``store`` into ``directory`` (made here) from one optimizer's saves
    ``peers`` (``by_key``: from every save of the checkpoint, matched by key and
    global box): its bucket files, resident moments and manifest, each fsynced, the
    manifest last. Returns the step count of the state written."""
    make_private_dir(directory)
    # The file handles write straight from the bytes they are given: the staging
    # buffer only sets the size of each write, and its pages are never touched.
    staging = HostMemory(STAGING_BYTES, pin=False)
    target = _FileTarget(
        description=store.description,
        buckets=store.buckets,
        resident_mains=[torch.empty(n, device="meta") for n in store.resident_numels],
        backing=_NewBucketFiles(directory),
        buffer=lambda: staging,
    )
    load = ReshardedLoad(target, peers, by_key)
    load.write_buckets(store.buckets, write=True)
    resident_state = load.resident_state() if store.resident_numels else None
    if resident_state is not None:
        _write_file(directory, RESIDENT_FILE, load.resident_bytes(resident_state))
    data = peers[0].data
    Manifest.of_save(
        store.description,
        steps_taken=load.steps,
        bucket_state=load.bucket_states(),
        resident_state=resident_state,
        main_exceptions=load.exceptions() if data["main_dtype"] != "fp32" else None,
        master_options=data.get("master_options"),
        files=_file_table(directory),
    ).write(directory)
    fsync_dir(directory)
    return load.steps


@dataclass
class _FileTarget:
    """A new store as the :class:`~miles_plugins.optimizers.checkpoint.reshard_load.ReshardTarget`
    a resharded load fills."""

    description: dict
    buckets: list[BucketLayout]
    resident_mains: list[torch.Tensor]
    backing: _NewBucketFiles
    buffer: Callable[[], HostMemory]


class _NewBucketFiles:
    """The backing of a new store: each bucket a new file of its layout's size in ``directory``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def open(self, bucket: BucketLayout) -> _NewFileHandle:
        return _NewFileHandle(os.path.join(self.directory, bucket.file_name), bucket.file_size)


class _NewFileHandle:
    """Writes into a new bucket file; closing it makes it durable."""

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.fd = open_file(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, size)  # the layout's padding reads as zeros

    def write(self, offset: int, src: torch.Tensor, staging: HostMemory) -> None:
        pwrite_full(self.fd, self.path, offset, memoryview(src.numpy()).cast("B"))

    def close(self) -> None:
        fsync(self.fd, self.path)
        os.close(self.fd)


def _write_file(directory: str, name: str, data: bytes) -> None:
    """A new file ``name`` in ``directory`` holding ``data``, fsynced."""
    with create_file(directory, name) as fd:
        path = os.path.join(directory, name)
        pwrite_full(fd, path, 0, memoryview(data))
        fsync(fd, path)


def _file_table(directory: str) -> dict[str, dict]:
    """The manifest's file table of every file in ``directory``: its size and block CRC-32s."""
    files = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        files[name] = {"size": size, "block_crc32": file_crcs(path, size, CRC_BLOCK_BYTES)}
    return files


class OutputDirectory:
    """``out_dir``, written all or nothing, as a context manager around the writing.

    :meth:`prepare` takes the lock ``<out_dir>.lock`` (a second reshard into the
    same place is refused) and starts ``<out_dir>.partial``, where the new stores
    go; :meth:`publish` renames it into place. Leaving the block releases the
    lock. A failure or an interrupt before the rename removes the partial output,
    the lock and the parent directories made for it, with SIGINT and SIGTERM
    deferred until that is done, and propagates; after the rename the output
    stays, and a failure to sync its directory entries is raised as
    :class:`StreamIOError`.
    """

    def __init__(self, out_dir: str, log: Callable[[str], None]) -> None:
        self.out_dir, self.partial, self.lock_path = out_dir, f"{out_dir}.partial", f"{out_dir}.lock"
        self.parent = os.path.dirname(os.path.abspath(out_dir))
        self._log = log
        self._created = _missing_dirs(self.parent)  # made by prepare, removed again on a failure
        self._lock: int | None = None
        self._owns_partial = False  # the partial output is this run's to remove
        self.published = False

    def __enter__(self) -> OutputDirectory:
        return self

    def prepare(self, needed: int) -> None:
        """Make the parent directories, take the lock, check that ``out_dir`` is still
        free and its drive has ``needed`` bytes, and start an empty partial directory."""
        make_dirs(self.parent)
        self._lock = lock_writer(
            self.lock_path,
            f"a reshard into {self.out_dir}",
            "let it finish, or give another --out",
            lambda message: self._log(f"warning: {message}"),
        )
        self._owns_partial = True
        if os.path.lexists(self.out_dir):  # written by a run that held the lock before us
            raise CheckpointMismatchError(f"{self.out_dir} exists already: give a new directory")
        remove_private_dir(self.partial)  # left by a run that was cut off (its lock is gone with it)
        require_free_space(self.parent, needed, "the resharded state")
        make_private_dir(self.partial)

    def publish(self) -> None:
        """Rename the complete partial directory into place, durably."""
        fsync_dir(self.partial)
        os.rename(self.partial, self.out_dir)
        self.published = True
        fsync_dir(self.parent)  # the rename
        for directory in self._created:  # each directory made here, in its own parent
            fsync_dir(os.path.dirname(directory))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        try:
            if exc is None:
                return
            if self.published:  # complete and in place
                if isinstance(exc, Exception):  # only making that durable failed
                    raise StreamIOError(
                        f"{self.out_dir} is complete and in place, but syncing its directory entries failed ({exc}): "
                        "it may not survive a power loss until the filesystem is synced",
                        self.out_dir,
                    ) from exc
                return  # an interrupt: the caller finds the output in place
            # The failure that got here is the one to report: cleaning up stays quiet, and a
            # second interrupt waits until it is done.
            with _signals_deferred():
                self._remove_partial_output()
        finally:
            self._release_lock()

    def _remove_partial_output(self) -> None:
        """The partial directory (when this run owns it), the lock, then the parents made for them."""
        if self._owns_partial:
            with contextlib.suppress(OSError):
                remove_private_dir(self.partial)
        self._release_lock()
        for directory in self._created:
            with contextlib.suppress(OSError):
                os.rmdir(directory)

    def _release_lock(self) -> None:
        if self._lock is not None:
            unlock_file(self.lock_path, self._lock)
            self._lock = None


def _missing_dirs(path: str) -> list[str]:
    """``path`` and each of its parents that does not exist yet, deepest first."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back (in this thread) until the block is done."""
    signals = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
