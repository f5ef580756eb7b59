"""The transactional load of one store's checkpoint.

Before the live state changes it verifies everything: the manifest (its own
checksum, format, every field compared with this store), every file's presence
and size, every piece of small state (step counts, per-param state, remainder
exceptions) against the live optimizers, the resident moments' checksum, and
every bucket file's checksum. On the disk tier the bucket files are copied into
the spare slot while they are checked, and the slot is committed only after all
checks pass; the host tier has no spare, so its files are checked in a first
read and copied in a second. A load refused before the commit leaves the store
exactly as it was; a failure after it (an I/O error or a checksum that changed
between the two host-tier reads) marks the store damaged, so it refuses to step.

When this store has no save of its own under ``base_dir``, or its save differs
in the data-parallel sharding or in its TP, PP or EP sizes, the state is rebuilt
from its peers' saves instead (``reshard_load.py``): the same checks, the same commit.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import torch

from miles_plugins.optimizers.checkpoint.group_options import check_options, restore_options
from miles_plugins.optimizers.checkpoint.manifest import RESIDENT_FILE, Manifest, crc_mismatch, differences
from miles_plugins.optimizers.checkpoint.persistence import Persistence, refuse_live_scratch
from miles_plugins.optimizers.checkpoint.reshard_load import ReshardedLoad
from miles_plugins.optimizers.checkpoint.reshard_peers import can_reshard_from, find_peers
from miles_plugins.optimizers.errors import CheckpointMismatchError, StreamConfigError
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.dir_replace import previous_path
from miles_plugins.optimizers.homes.file_io import BlockCrc, copy_file_crc32
from miles_plugins.optimizers.homes.fs import check_plain_dir, open_file

logger = logging.getLogger(__name__)


class CheckpointReader:
    """Loads a saved state into one store (its :class:`Persistence` parts)."""

    def __init__(self, persistence: Persistence) -> None:
        self.parts = persistence

    def load(self, base_dir: str, mark_damaged: Callable[[str], None], expected_steps: int | None = None) -> int | None:
        """Restore the state :meth:`CheckpointWriter.save` left under ``base_dir``; returns its step
        count, or None when there is none. Raises :class:`CheckpointMismatchError`
        (every problem found, at once) for a state that does not fit, or whose
        step count is not ``expected_steps``, before anything live changed.
        ``mark_damaged(reason)`` is called when a failure comes after the live
        state began to change. ``base_dir/<name>`` must be clear of every live
        scratch (:func:`refuse_live_scratch`)."""
        refuse_live_scratch(
            os.path.join(base_dir, self.parts.name),
            "load the optimizer state from",
            "it holds that store's live state, not a save",
        )
        if os.path.lexists(base_dir) and not os.path.isdir(base_dir):
            raise StreamConfigError(
                f"cannot load the optimizer state from {base_dir}: it is not a directory; give load_from the "
                "directory save_to was given"
            )
        source = self._source(base_dir)
        manifest = Manifest.read(source) if source is not None else None
        if manifest is None or (
            differences(manifest.data, self.parts.description)
            and can_reshard_from(manifest.data, self.parts.description)
        ):
            # Saved under another data-parallel sharding (or by other ranks only).
            peers = find_peers(base_dir, self.parts.name, self.parts.description)
            if peers:
                return self._load_resharded(peers, mark_damaged, expected_steps)
        if manifest is None:
            logger.warning(
                "no saved optimizer state for %s in %s (looked for %s): nothing loaded",
                self.parts.name,
                base_dir,
                os.path.join(base_dir, self.parts.name),
            )
            return None
        return self._load_own(source, manifest, mark_damaged, expected_steps)

    def _load_own(
        self, source: str, manifest: Manifest, mark_damaged: Callable[[str], None], expected_steps: int | None
    ) -> int:
        """:meth:`load` from this store's own save in ``source``."""
        parts = self.parts
        start = time.perf_counter()
        problems = self._problems(source, manifest)
        steps = manifest.data.get("steps_taken")
        if not problems and expected_steps is not None and steps != expected_steps:
            problems.append(
                f"it holds the state after step {steps}, the checkpoint's optimizer state dict was saved after "
                f"step {expected_steps}: they come from different saves"
            )
        if problems:
            raise CheckpointMismatchError(
                f"cannot load the streamed optimizer state in {source}:\n  - " + "\n  - ".join(problems)
            )
        data = manifest.data
        self._commit(
            lambda buckets, write: self._read_buckets(source, manifest, buckets, copy=write),
            data["bucket_state"],
            data["resident_state"] if parts.resident_optimizer is not None else None,
            self._read_resident(source, manifest) if parts.resident_optimizer is not None else None,
            data["main_exceptions"] if parts.remainder else None,
            data.get("master_options"),
            f"loading {source}",
            mark_damaged,
        )
        logger.info(
            "loaded streamed optimizer state %s (step %d) from %s in %.2f s",
            parts.name,
            manifest.data["steps_taken"],
            source,
            time.perf_counter() - start,
        )
        return manifest.data["steps_taken"]

    def _load_resharded(self, peers, mark_damaged: Callable[[str], None], expected_steps: int | None) -> int:
        """:meth:`load` from the saves of this optimizer's peers under another
        sharding or layout (``reshard_load.py``); the same transaction."""
        start = time.perf_counter()
        load = ReshardedLoad(self.parts, peers)
        problems = []
        if expected_steps is not None and load.steps != expected_steps:
            problems.append(
                f"the saved stores hold the state after step {load.steps}, the checkpoint's optimizer state dict "
                f"was saved after step {expected_steps}: they come from different saves"
            )
        states = load.bucket_states()
        for bucket, optimizer, state in zip(self.parts.buckets, self.parts.bucket_optimizers, states, strict=True):
            problems += [f"bucket {bucket.index}: {p}" for p in optimizer.check_state(state)]
        resident_state = load.resident_state() if self.parts.resident_optimizer is not None else None
        if resident_state is not None:
            problems += [f"resident params: {p}" for p in self.parts.resident_optimizer.check_state(resident_state)]
        exceptions = load.exceptions() if self.parts.remainder else None
        if exceptions is not None:
            problems += self.parts.codec.check(exceptions, self.parts.buckets)
        options = peers[0].data.get("master_options")
        if self.parts.master_groups and options is not None:
            problems += check_options(options, self.parts.master_groups)
        if problems:
            raise CheckpointMismatchError(
                f"cannot reshard the streamed optimizer state from {len(peers)} saved stores:\n  - "
                + "\n  - ".join(problems)
            )
        self._commit(
            load.write_buckets,
            states,
            resident_state,
            load.resident_bytes(resident_state) if resident_state is not None else None,
            exceptions,
            options,
            f"resharding from {len(peers)} saved stores",
            mark_damaged,
        )
        logger.info(
            "resharded the streamed optimizer state %s (step %d) from %d saved stores (%s) in %.2f s",
            self.parts.name,
            load.steps,
            len(peers),
            ", ".join(os.path.basename(p.directory) for p in peers),
            time.perf_counter() - start,
        )
        return load.steps

    def _commit(
        self,
        fill: Callable[[bool], None],
        bucket_states: list,
        resident_state: dict | None,
        resident: bytes | None,
        exceptions: list | None,
        options: list | None,
        what: str,
        mark_damaged: Callable[[str], None],
    ) -> None:
        """The end of a load, everything checked: ``fill(buckets, write)`` brings
        those buckets' bytes in (``write`` False: only reads and verifies them).
        Disk buckets fill their spare slots before anything live changes; buckets
        in host or device memory, with no spare, are verified first and filled
        after the point of no return."""
        in_place = [b for b in self.parts.buckets if not self.parts.backing.keeps_previous_state_of(b)]
        fill([b for b in self.parts.buckets if b not in in_place], True)
        fill(in_place, False)
        try:
            # The commit: from here on the live state changes.
            fill(in_place, True)
            self.parts.backing.commit()
            for optimizer, saved in zip(self.parts.bucket_optimizers, bucket_states, strict=True):
                optimizer.import_state(saved, materialize=False)
            if resident_state is not None:
                self._restore_resident(resident_state, resident)
            if exceptions is not None:
                self.parts.codec.restore(exceptions)
            if self.parts.master_groups and options is not None:
                restore_options(options, self.parts.master_groups)
        except BaseException as exc:
            mark_damaged(f"{what} failed after the live state began to change ({exc})")
            raise

    def _source(self, base_dir: str) -> str | None:
        """The saved directory to load: ``<name>``, or the previous save a replace
        without RENAME_EXCHANGE had moved aside when it was cut off."""
        final = os.path.join(base_dir, self.parts.name)
        if os.path.lexists(final):
            check_plain_dir(final)
            return final
        backup = previous_path(final)
        if os.path.lexists(backup):
            check_plain_dir(backup)
            logger.warning(
                "%s is missing but %s holds the previous save: a save that was replacing it was cut off; "
                "loading the previous save",
                final,
                backup,
            )
            return backup
        return None

    def _problems(self, source: str, manifest: Manifest) -> list[str]:
        """Everything that keeps ``manifest`` from loading into this store; no file
        content is read."""
        data = manifest.data
        problems = differences(data, self.parts.description)
        if problems:
            return problems  # another layout or format: nothing below can be compared
        expected = {b.file_name for b in self.parts.buckets} | (
            {RESIDENT_FILE} if self.parts.resident_optimizer else set()
        )
        if set(manifest.files) != expected:
            return [f"the manifest lists files {sorted(manifest.files)}, this store needs {sorted(expected)}"]
        problems += manifest.file_problems(source).values()
        problems += [
            f"{b.file_name}: the file table says {manifest.files[b.file_name]['size']} bytes, the layout {b.file_size}"
            for b in self.parts.buckets
            if manifest.files[b.file_name]["size"] != b.file_size
        ]
        steps = data.get("steps_taken")
        if type(steps) is not int or steps < 0:
            problems.append(f"steps_taken is {steps!r}, not a step count")
        saved = data.get("bucket_state")
        if not isinstance(saved, list) or len(saved) != len(self.parts.buckets):
            problems.append(f"the bucket optimizer state is not a list of {len(self.parts.buckets)} (one per bucket)")
        else:
            for bucket, optimizer, state in zip(self.parts.buckets, self.parts.bucket_optimizers, saved, strict=True):
                problems += [f"bucket {bucket.index}: {p}" for p in optimizer.check_state(state)]
        if self.parts.resident_optimizer is not None:
            problems += [
                f"resident params: {p}" for p in self.parts.resident_optimizer.check_state(data.get("resident_state"))
            ]
        if self.parts.remainder:
            problems += self.parts.codec.check(data.get("main_exceptions"), self.parts.buckets)
        if self.parts.master_groups and data.get("master_options") is not None:
            problems += check_options(data["master_options"], self.parts.master_groups)
        return problems

    def _read_buckets(self, source: str, manifest: Manifest, buckets: Sequence[BucketLayout], copy: bool) -> None:
        """Read the buckets' files once, checking their checksums; with ``copy``, into
        the backing (``backing.restore``), else nothing is kept (a verify pass)."""
        for bucket in buckets:
            path = os.path.join(source, bucket.file_name)
            crc = BlockCrc(manifest.block_bytes)
            fd = open_file(path, os.O_RDONLY)
            try:
                if copy:
                    self.parts.backing.restore(bucket, fd, path, self.parts.buffer(), crc)
                else:
                    copy_file_crc32(fd, path, None, "", bucket.file_size, self.parts.buffer().view, crc)
            finally:
                os.close(fd)
            _check_crc(path, crc, manifest, bucket.file_name)

    def _read_resident(self, source: str, manifest: Manifest) -> bytes:
        path = os.path.join(source, RESIDENT_FILE)
        with os.fdopen(open_file(path, os.O_RDONLY), "rb") as f:
            data = f.read()
        crc = BlockCrc(manifest.block_bytes)
        crc.update(data)
        _check_crc(path, crc, manifest, RESIDENT_FILE)
        if len(data) != self._resident_bytes_after(manifest.data["resident_state"]):
            raise CheckpointMismatchError(f"{path} holds {len(data)} bytes, not the moments its state describes")
        return data

    def _resident_bytes_after(self, saved: dict) -> int:
        """Bytes of the resident moments ``saved`` describes: two fp32 moments per
        param with state (its layout was checked by ``check_state``)."""
        groups = self.parts.resident_optimizer.optimizer.param_groups
        has_state = {
            id(p): scalars is not None
            for group, saved_params in zip(groups, saved["params"], strict=True)
            for p, scalars in zip(group["params"], saved_params, strict=True)
        }
        return sum(2 * 4 * main.numel() for main in self.parts.resident_mains if has_state[id(main)])

    def _restore_resident(self, saved: dict, data: bytes) -> None:
        self.parts.resident_optimizer.import_state(saved, materialize=True)
        offset = 0
        for moment in self.parts.resident_moments():
            n = moment.numel() * moment.element_size()
            moment.view(-1).view(torch.uint8).copy_(
                torch.frombuffer(bytearray(data[offset : offset + n]), dtype=torch.uint8)
            )
            offset += n


def _check_crc(path: str, crc: BlockCrc, manifest: Manifest, name: str) -> None:
    mismatch = crc_mismatch(crc.blocks, manifest.crcs(name), manifest.block_bytes)
    if mismatch:
        raise CheckpointMismatchError(f"{path}: {mismatch}: the checkpoint is corrupt")
