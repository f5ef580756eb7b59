"""The save of one store's checkpoint: every file into a partial directory, fsynced,
the manifest last, then one replace of the previous save (``persistence.py`` shows
the directories). One saver per name and directory at a time (a lock), and a
failure leaves the previous save as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from miles_plugins.optimizers.checkpoint.group_options import options_to_json
from miles_plugins.optimizers.checkpoint.manifest import CRC_BLOCK_BYTES, RESIDENT_FILE, Manifest
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
from miles_plugins.optimizers.homes.locks import lock_writer, unlock_file

logger = logging.getLogger(__name__)


class CheckpointWriter:
    """Saves the state of one store (its :class:`Persistence` parts)."""

    def __init__(self, persistence: Persistence) -> None:
        self.parts = persistence

    def save(self, base_dir: str, steps_taken: int) -> None:
        """Save the full state under ``base_dir/<name>``, replacing any previous save
        in one step (see the module docstring). Checks first that ``base_dir/<name>``
        is clear of every live scratch (:func:`refuse_live_scratch`) and that
        ``base_dir`` has room for the whole save; a failure leaves the previous
        save as it was. Saves of one name into one directory are exclusive: the
        lock ``base_dir/.<name>.partial.lock`` is held from the partial directory's
        creation to the publish, and a second saver is refused naming the holder."""
        start = time.perf_counter()
        final = os.path.join(base_dir, self.parts.name)
        refuse_live_scratch(
            final,
            "save the optimizer state to",
            "the save would replace its live state, and closing it would delete the save",
        )
        partial = os.path.join(base_dir, f".{self.parts.name}.partial")
        make_dirs(base_dir)
        lock_path = f"{partial}.lock"
        lock = lock_writer(
            lock_path,
            f"a save of the optimizer state {self.parts.name} into {base_dir}",
            "let it finish, or stop that process (a second job on the same checkpoint directory?)",
            logger.warning,
        )
        try:
            remove_private_dir(partial)  # left by a save that was cut off (its lock is gone with it)
            needed = sum(b.file_size for b in self.parts.buckets) + self.parts.resident_bytes()
            require_free_space(base_dir, needed, "a save of the optimizer state", "; a previous save there is kept")
            make_private_dir(partial)
            ours = dir_identity(partial)
            try:
                files = self._write(partial, steps_taken)
                replace_dir(partial, final)
            except BaseException:
                with contextlib.suppress(OSError):
                    # Never what a replace put at that name: the previous save.
                    remove_private_dir(partial, only=ours)
                raise
        finally:
            if lock is not None:
                unlock_file(lock_path, lock)
        seconds = time.perf_counter() - start
        nbytes = sum(f["size"] for f in files.values())
        logger.info(
            "saved streamed optimizer state %s (step %d): %.2f GB in %.2f s (%.2f GB/s) to %s",
            self.parts.name,
            steps_taken,
            nbytes / 1e9,
            seconds,
            nbytes / 1e9 / max(seconds, 1e-9),
            final,
        )

    def _write(self, directory: str, steps_taken: int) -> dict[str, dict]:
        """Write every file of a save into ``directory``, each fsynced, the manifest
        last, then the directory's entries; returns the manifest's file table."""
        parts = self.parts
        files = {}
        for bucket in parts.buckets:
            crc = BlockCrc(CRC_BLOCK_BYTES)
            with create_file(directory, bucket.file_name) as dst:
                path = os.path.join(directory, bucket.file_name)
                parts.backing.export(bucket, dst, path, parts.buffer(), crc)
                fsync(dst, path)
            files[bucket.file_name] = {"size": bucket.file_size, "block_crc32": crc.blocks}
        if parts.resident_optimizer is not None:
            files[RESIDENT_FILE] = self._save_resident(directory)
        Manifest(
            {
                **parts.description,
                "steps_taken": steps_taken,
                "bucket_state": [o.export_state() for o in parts.bucket_optimizers],
                "resident_state": parts.resident_optimizer.export_state() if parts.resident_optimizer else None,
                "main_exceptions": parts.codec.export() if parts.remainder else None,
                "master_options": options_to_json(parts.master_groups) if parts.master_groups else None,
                "files": files,
            }
        ).write(directory)
        fsync_dir(directory)
        return files

    def _save_resident(self, directory: str) -> dict[str, int]:
        # Small (the store warns above resident_warn_elements): one CPU copy per moment.
        crc, size = BlockCrc(CRC_BLOCK_BYTES), 0
        path = os.path.join(directory, RESIDENT_FILE)
        with create_file(directory, RESIDENT_FILE) as fd:
            for moment in self.parts.resident_moments():
                data = moment.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                pwrite_full(fd, path, size, memoryview(data))
                crc.update(data)
                size += len(data)
            fsync(fd, path)
        return {"size": size, "block_crc32": crc.blocks}
