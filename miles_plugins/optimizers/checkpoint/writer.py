"""The save of one store's checkpoint: every file into a partial directory, fsynced,
the manifest last, then one replace of the previous save (``persistence.py`` shows
the directories). One saver per name and directory at a time (a lock), and a
failure leaves the previous save as it was.

A save runs in two parts. :meth:`CheckpointWriter.begin` (the caller's thread, between
steps) takes the lock, makes the partial directory and a :class:`Snapshot`: the small
state (step counts, per-param state, remainder exceptions, group options, the resident
moments' bytes) copied as it is, and the backing's token for the bucket bytes, which a
step overwrites only after their export (``background.py`` orders that). Then
:meth:`PendingWrite.run` writes and publishes, on the same thread (``save``) or on one
of its own while training goes on (a background save).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from miles_plugins.optimizers.checkpoint.group_options import options_to_json
from miles_plugins.optimizers.checkpoint.manifest import CRC_BLOCK_BYTES, RESIDENT_FILE, Manifest
from miles_plugins.optimizers.checkpoint.partials import new_partial_path, remove_stale_partials
from miles_plugins.optimizers.checkpoint.persistence import Persistence, refuse_live_scratch
from miles_plugins.optimizers.homes.dir_replace import replace_dir
from miles_plugins.optimizers.homes.file_io import BlockCrc, pwrite_full
from miles_plugins.optimizers.homes.fs import (
    create_file,
    dir_identity,
    fsync,
    fsync_dir,
    make_dirs,
    make_private_dir,
    remove_private_dir,
    require_free_space,
)
from miles_plugins.optimizers.homes.host_memory import HostMemory
from miles_plugins.optimizers.homes.locks import lock_writer, unlock_file

logger = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """A store's state as a save writes it, taken at one instant between steps.

    ``fields``: the manifest's state fields (step counts and the rest, copied);
    ``resident``: the resident moments' bytes; ``bucket_bytes``: the backing's
    token for the bucket bytes (``Backing.snapshot``); ``ready``: on CUDA, an event
    after every device operation queued before the snapshot (the last step's
    updates of the gpu home), which a copy of device bytes waits for first.
    """

    fields: dict
    resident: bytes | None
    bucket_bytes: object
    ready: torch.cuda.Event | None


class CheckpointWriter:
    """Saves the state of one store (its :class:`Persistence` parts)."""

    def __init__(self, persistence: Persistence) -> None:
        self.parts = persistence

    def save(self, base_dir: str, steps_taken: int) -> None:
        """Save the full state under ``base_dir/<name>`` now, replacing any previous
        save in one step (:meth:`begin`, then :meth:`PendingWrite.run` on this thread)."""
        self.begin(base_dir, steps_taken).run()

    def begin(self, base_dir: str, steps_taken: int, buffer: HostMemory | None = None) -> PendingWrite:
        """Make ready a save under ``base_dir/<name>`` of the state as it is now: checks
        that ``base_dir/<name>`` is clear of every live scratch (:func:`refuse_live_scratch`),
        takes the lock ``base_dir/.<name>.partial.lock`` (held until the save is
        published or abandoned; a second saver of the name is refused, naming the
        holder), removes what cut-off saves left, makes sure ``base_dir`` has room for
        the whole save, creates a partial directory of its own (``partials.py``) and
        takes the :class:`Snapshot`. ``buffer``: the host
        staging its copies go through (default: the engine's idle chunk, which only a
        save between steps may use). On a failure nothing is left but the previous save."""
        final = os.path.join(base_dir, self.parts.name)
        refuse_live_scratch(
            final,
            "save the optimizer state to",
            "the save would replace its live state, and closing it would delete the save",
        )
        make_dirs(base_dir)
        lock_path = os.path.join(base_dir, f".{self.parts.name}.partial.lock")
        lock = lock_writer(
            lock_path,
            f"a save of the optimizer state {self.parts.name} into {base_dir}",
            "let it finish, or stop that process (a second job on the same checkpoint directory?)",
            logger.warning,
        )
        try:
            remove_stale_partials(base_dir, self.parts.name, locked=lock is not None)
            partial = new_partial_path(base_dir, self.parts.name)
            needed = sum(b.file_size for b in self.parts.buckets) + self.parts.resident_bytes()
            require_free_space(base_dir, needed, "a save of the optimizer state", "; a previous save there is kept")
            make_private_dir(partial)
            ours = dir_identity(partial)
            try:
                snapshot = self._snapshot(steps_taken)
            except BaseException:
                with contextlib.suppress(OSError):
                    remove_private_dir(partial, only=ours)
                raise
        except BaseException:
            if lock is not None:
                unlock_file(lock_path, lock)
            raise
        return PendingWrite(
            self.parts, snapshot, final, partial, ours, (lock_path, lock), buffer or self.parts.buffer()
        )

    def _snapshot(self, steps_taken: int) -> Snapshot:
        parts = self.parts
        ready = None
        if torch.cuda.is_available():
            ready = torch.cuda.Event()
            ready.record()
        return Snapshot(
            fields={
                "steps_taken": steps_taken,
                "bucket_state": [o.export_state() for o in parts.bucket_optimizers],
                "resident_state": parts.resident_optimizer.export_state() if parts.resident_optimizer else None,
                "main_exceptions": parts.codec.export() if parts.remainder else None,
                "master_options": options_to_json(parts.master_groups) if parts.master_groups else None,
            },
            # Small (the store warns above resident_warn_elements): one CPU copy per moment.
            resident=b"".join(
                m.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                for m in parts.resident_moments()
            )
            if parts.resident_optimizer is not None
            else None,
            bucket_bytes=parts.backing.snapshot(),
            ready=ready,
        )


class PendingWrite:
    """A save :meth:`CheckpointWriter.begin` made ready: :meth:`run` writes it and
    publishes it in place of the previous one, or abandons it on a failure (the
    partial directory removed, the previous save as it was); either way the lock
    is released."""

    def __init__(
        self,
        parts: Persistence,
        snapshot: Snapshot,
        final: str,
        partial: str,
        ours: tuple[int, int],
        lock: tuple[str, int | None],
        buffer: HostMemory,
    ) -> None:
        self.parts, self.snapshot, self.final, self.partial = parts, snapshot, final, partial
        self._ours, self._lock, self._buffer = ours, lock, buffer

    def run(self, exported: Callable[[int], None] = lambda index: None) -> None:
        """Write every file, publish, release the lock; ``exported(index)`` is called once
        bucket ``index``'s bytes are copied (a step may overwrite them from then on)."""
        try:
            try:
                start = time.perf_counter()
                files = self._write(exported)
                replace_dir(self.partial, self.final)
            except BaseException:
                self._remove_partial()
                raise
        finally:
            self._unlock()
        seconds = time.perf_counter() - start
        nbytes = sum(f["size"] for f in files.values())
        logger.info(
            "saved streamed optimizer state %s (step %d): %.2f GB in %.2f s (%.2f GB/s) to %s",
            self.parts.name,
            self.snapshot.fields["steps_taken"],
            nbytes / 1e9,
            seconds,
            nbytes / 1e9 / max(seconds, 1e-9),
            self.final,
        )

    def abandon(self) -> None:
        """Give the save up before :meth:`run`: the partial directory removed, the lock released."""
        try:
            self._remove_partial()
        finally:
            self._unlock()

    def _remove_partial(self) -> None:
        with contextlib.suppress(OSError):
            # Never what a replace put at that name: the previous save.
            remove_private_dir(self.partial, only=self._ours)

    def _unlock(self) -> None:
        lock_path, lock = self._lock
        if lock is not None:
            unlock_file(lock_path, lock)

    def _write(self, exported: Callable[[int], None]) -> dict[str, dict]:
        """Every file of the save into the partial directory, each fsynced, the manifest
        last, then the directory's entries; returns the manifest's file table."""
        parts, snapshot, directory = self.parts, self.snapshot, self.partial
        if snapshot.ready is not None:
            snapshot.ready.synchronize()  # the device bytes as the snapshot saw them
        files = {}
        for bucket in parts.buckets:
            crc = BlockCrc(CRC_BLOCK_BYTES)
            with create_file(directory, bucket.file_name) as dst:
                path = os.path.join(directory, bucket.file_name)
                parts.backing.export(bucket, dst, path, self._buffer, crc, snapshot=snapshot.bucket_bytes)
                exported(bucket.index)
                fsync(dst, path)
            files[bucket.file_name] = {"size": bucket.file_size, "block_crc32": crc.blocks}
        if snapshot.resident is not None:
            files[RESIDENT_FILE] = _write_file(directory, RESIDENT_FILE, snapshot.resident)
        Manifest({**parts.description, **snapshot.fields, "files": files}).write(directory)
        fsync_dir(directory)
        return files


def _write_file(directory: str, name: str, data: bytes) -> dict[str, object]:
    """A new file of ``data``, fsynced; its manifest entry (size, block CRC-32s)."""
    crc = BlockCrc(CRC_BLOCK_BYTES)
    path = os.path.join(directory, name)
    with create_file(directory, name) as fd:
        pwrite_full(fd, path, 0, memoryview(data))
        crc.update(data)
        fsync(fd, path)
    return {"size": len(data), "block_crc32": crc.blocks}
