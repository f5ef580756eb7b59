"""Checkpoints of one store's state: ``save`` and a transactional ``load``.

A saved store is one directory (see ``manifest.py`` for its files)::

    <base_dir>/<name>/             the complete save
    <base_dir>/.<name>.partial/    a save being written (never read)
    <base_dir>/.<name>.partial.lock held (flock) by the process writing it
    <base_dir>/.<name>.previous/   the previous save, while a replace without
                                   RENAME_EXCHANGE is under way (dir_replace.replace_dir)

``save`` writes everything into the partial directory, fsynced, manifest last,
and then replaces the previous save in one step (``dir_replace.replace_dir``).

``load`` is a transaction. Before the live state changes it verifies
everything: the manifest (its own checksum, format, every field compared with
this store), every file's presence and size, every piece of small state (step
counts, per-param state, remainder exceptions) against the live optimizers,
the resident moments' checksum, and every bucket file's checksum. On the disk
tier the bucket files are copied into the spare slot while they are checked,
and the slot is committed only after all checks pass; the host tier has no
spare, so its files are checked in a first read and copied in a second. A load
refused before the commit leaves the store exactly as it was; a failure after
it (an I/O error or a checksum that changed between the two host-tier reads)
marks the store damaged, so it refuses to step.

When this store has no save of its own under ``base_dir``, or its save differs
only in the data-parallel sharding, ``load`` rebuilds the state from its peers'
saves instead (``reshard_load.py``): the same checks, the same commit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from miles_plugins.optimizers.checkpoint.manifest import (
    CRC_BLOCK_BYTES,
    RESIDENT_FILE,
    Manifest,
    crc_mismatch,
    differences,
)
from miles_plugins.optimizers.checkpoint.reshard_load import ReshardedLoad
from miles_plugins.optimizers.checkpoint.reshard_peers import can_reshard_from, find_peers
from miles_plugins.optimizers.errors import CheckpointMismatchError, StreamConfigError
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.dir_replace import previous_path, replace_dir
from miles_plugins.optimizers.homes.file_io import BlockCrc, copy_file_crc32, pwrite_full
from miles_plugins.optimizers.homes.fs import (
    check_plain_dir,
    create_file,
    dir_identity,
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
from miles_plugins.optimizers.homes.scratch import live_scratch_overlap
from miles_plugins.optimizers.step.adam import BucketOptimizer
from miles_plugins.optimizers.step.codec import Codec

logger = logging.getLogger(__name__)


class Persistence:
    """Saves and loads the state of one store.

    Args:
        name: the store's name: its directory under a checkpoint's base directory.
        description: the manifest fields a load must match (``manifest.COMPARED_FIELDS``).
        buckets, backing, bucket_optimizers: the layout, where the bucket bytes
            live, and each bucket's optimizer (its step counts).
        buffer: returns a host buffer free for the caller (the engine's idle staging).
        codec: the storage formats (``remainder``: its exceptions are state).
        resident_optimizer, resident_mains: the fp32-native entries' optimizer
            and mains (their moments are saved as one file), or None and [].
        master_groups: the master optimizer's param groups, when their options
            (lr as a scheduler left it, weight decay, ...) are saved and restored
            here; None where the caller's own checkpoint carries them (Megatron's
            optimizer state dict).
    """

    def __init__(
        self,
        name: str,
        description: dict,
        buckets: Sequence[BucketLayout],
        backing,
        bucket_optimizers: Sequence[BucketOptimizer],
        buffer: Callable[[], HostMemory],
        codec: Codec,
        remainder: bool,
        resident_optimizer: BucketOptimizer | None,
        resident_mains: Sequence[torch.Tensor],
        master_groups: list[dict] | None = None,
    ) -> None:
        self.name, self.description = name, description
        self.master_groups = master_groups
        self.buckets, self.backing, self.bucket_optimizers = buckets, backing, bucket_optimizers
        self.buffer, self.codec, self.remainder = buffer, codec, remainder
        self.resident_optimizer, self.resident_mains = resident_optimizer, list(resident_mains)

    # ---- save --------------------------------------------------------------------

    def save(self, base_dir: str, steps_taken: int) -> None:
        """Save the full state under ``base_dir/<name>``, replacing any previous save
        in one step (see the module docstring). Checks first that ``base_dir/<name>``
        is clear of every live scratch (:func:`_refuse_live_scratch`) and that
        ``base_dir`` has room for the whole save; a failure leaves the previous
        save as it was. Saves of one name into one directory are exclusive: the
        lock ``base_dir/.<name>.partial.lock`` is held from the partial directory's
        creation to the publish, and a second saver is refused naming the holder."""
        start = time.perf_counter()
        final = os.path.join(base_dir, self.name)
        _refuse_live_scratch(
            final,
            "save the optimizer state to",
            "the save would replace its live state, and closing it would delete the save",
        )
        partial = os.path.join(base_dir, f".{self.name}.partial")
        make_dirs(base_dir)
        lock_path = f"{partial}.lock"
        lock = lock_writer(
            lock_path,
            f"a save of the optimizer state {self.name} into {base_dir}",
            "let it finish, or stop that process (a second job on the same checkpoint directory?)",
            logger.warning,
        )
        try:
            remove_private_dir(partial)  # left by a save that was cut off (its lock is gone with it)
            needed = sum(b.file_size for b in self.buckets) + self._resident_bytes()
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
            self.name,
            steps_taken,
            nbytes / 1e9,
            seconds,
            nbytes / 1e9 / max(seconds, 1e-9),
            final,
        )

    def _write(self, directory: str, steps_taken: int) -> dict[str, dict]:
        """Write every file of a save into ``directory``, each fsynced, the manifest
        last, then the directory's entries; returns the manifest's file table."""
        files = {}
        for bucket in self.buckets:
            crc = BlockCrc(CRC_BLOCK_BYTES)
            with create_file(directory, bucket.file_name) as dst:
                path = os.path.join(directory, bucket.file_name)
                self.backing.export(bucket, dst, path, self.buffer(), crc)
                fsync(dst, path)
            files[bucket.file_name] = {"size": bucket.file_size, "block_crc32": crc.blocks}
        if self.resident_optimizer is not None:
            files[RESIDENT_FILE] = self._save_resident(directory)
        Manifest(
            {
                **self.description,
                "steps_taken": steps_taken,
                "bucket_state": [o.export_state() for o in self.bucket_optimizers],
                "resident_state": self.resident_optimizer.export_state() if self.resident_optimizer else None,
                "main_exceptions": self.codec.export() if self.remainder else None,
                "master_options": _options_to_json(self.master_groups) if self.master_groups else None,
                "files": files,
            }
        ).write(directory)
        fsync_dir(directory)
        return files

    def _resident_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self._resident_moments())

    def _resident_moments(self) -> Iterator[torch.Tensor]:
        for main in self.resident_mains:
            yield from self.resident_optimizer.moments(main) or ()

    def _save_resident(self, directory: str) -> dict[str, int]:
        # Small (the store warns above resident_warn_elements): one CPU copy per moment.
        crc, size = BlockCrc(CRC_BLOCK_BYTES), 0
        path = os.path.join(directory, RESIDENT_FILE)
        with create_file(directory, RESIDENT_FILE) as fd:
            for moment in self._resident_moments():
                data = moment.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                pwrite_full(fd, path, size, memoryview(data))
                crc.update(data)
                size += len(data)
            fsync(fd, path)
        return {"size": size, "block_crc32": crc.blocks}

    # ---- load --------------------------------------------------------------------

    def load(self, base_dir: str, mark_damaged: Callable[[str], None], expected_steps: int | None = None) -> int | None:
        """Restore the state :meth:`save` left under ``base_dir``; returns its step
        count, or None when there is none. Raises :class:`CheckpointMismatchError`
        (every problem found, at once) for a state that does not fit, or whose
        step count is not ``expected_steps``, before anything live changed.
        ``mark_damaged(reason)`` is called when a failure comes after the live
        state began to change. ``base_dir/<name>`` must be clear of every live
        scratch (:func:`_refuse_live_scratch`)."""
        _refuse_live_scratch(
            os.path.join(base_dir, self.name),
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
            differences(manifest.data, self.description) and can_reshard_from(manifest.data, self.description)
        ):
            # Saved under another data-parallel sharding (or by other ranks only).
            peers = find_peers(base_dir, self.name, self.description)
            if peers:
                return self._load_resharded(peers, mark_damaged, expected_steps)
        if manifest is None:
            logger.warning(
                "no saved optimizer state for %s in %s (looked for %s): nothing loaded",
                self.name,
                base_dir,
                os.path.join(base_dir, self.name),
            )
            return None
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
            data["resident_state"] if self.resident_optimizer is not None else None,
            self._read_resident(source, manifest) if self.resident_optimizer is not None else None,
            data["main_exceptions"] if self.remainder else None,
            data.get("master_options"),
            f"loading {source}",
            mark_damaged,
        )
        logger.info(
            "loaded streamed optimizer state %s (step %d) from %s in %.2f s",
            self.name,
            manifest.data["steps_taken"],
            source,
            time.perf_counter() - start,
        )
        return manifest.data["steps_taken"]

    def _load_resharded(self, peers, mark_damaged: Callable[[str], None], expected_steps: int | None) -> int:
        """:meth:`load` from the saves of this optimizer's peers under another
        data-parallel sharding (``reshard_load.py``); the same transaction."""
        start = time.perf_counter()
        load = ReshardedLoad(self, peers)
        problems = []
        if expected_steps is not None and load.steps != expected_steps:
            problems.append(
                f"the saved stores hold the state after step {load.steps}, the checkpoint's optimizer state dict "
                f"was saved after step {expected_steps}: they come from different saves"
            )
        states = load.bucket_states()
        for bucket, optimizer, state in zip(self.buckets, self.bucket_optimizers, states, strict=True):
            problems += [f"bucket {bucket.index}: {p}" for p in optimizer.check_state(state)]
        resident_state = load.resident_state() if self.resident_optimizer is not None else None
        if resident_state is not None:
            problems += [f"resident params: {p}" for p in self.resident_optimizer.check_state(resident_state)]
        exceptions = load.exceptions() if self.remainder else None
        if exceptions is not None:
            problems += self.codec.check(exceptions, self.buckets)
        options = peers[0].data.get("master_options")
        if self.master_groups and options is not None:
            problems += _check_options(options, self.master_groups)
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
            self.name,
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
        in_place = [b for b in self.buckets if not self.backing.keeps_previous_state_of(b)]
        fill([b for b in self.buckets if b not in in_place], True)
        fill(in_place, False)
        try:
            # The commit: from here on the live state changes.
            fill(in_place, True)
            self.backing.commit()
            for optimizer, saved in zip(self.bucket_optimizers, bucket_states, strict=True):
                optimizer.import_state(saved, materialize=False)
            if resident_state is not None:
                self._restore_resident(resident_state, resident)
            if exceptions is not None:
                self.codec.restore(exceptions)
            if self.master_groups and options is not None:
                _restore_options(options, self.master_groups)
        except BaseException as exc:
            mark_damaged(f"{what} failed after the live state began to change ({exc})")
            raise

    def _source(self, base_dir: str) -> str | None:
        """The saved directory to load: ``<name>``, or the previous save a replace
        without RENAME_EXCHANGE had moved aside when it was cut off."""
        final = os.path.join(base_dir, self.name)
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
        problems = differences(data, self.description)
        if problems:
            return problems  # another layout or format: nothing below can be compared
        expected = {b.file_name for b in self.buckets} | ({RESIDENT_FILE} if self.resident_optimizer else set())
        if set(manifest.files) != expected:
            return [f"the manifest lists files {sorted(manifest.files)}, this store needs {sorted(expected)}"]
        problems += manifest.file_problems(source).values()
        problems += [
            f"{b.file_name}: the file table says {manifest.files[b.file_name]['size']} bytes, the layout {b.file_size}"
            for b in self.buckets
            if manifest.files[b.file_name]["size"] != b.file_size
        ]
        steps = data.get("steps_taken")
        if type(steps) is not int or steps < 0:
            problems.append(f"steps_taken is {steps!r}, not a step count")
        saved = data.get("bucket_state")
        if not isinstance(saved, list) or len(saved) != len(self.buckets):
            problems.append(f"the bucket optimizer state is not a list of {len(self.buckets)} (one per bucket)")
        else:
            for bucket, optimizer, state in zip(self.buckets, self.bucket_optimizers, saved, strict=True):
                problems += [f"bucket {bucket.index}: {p}" for p in optimizer.check_state(state)]
        if self.resident_optimizer is not None:
            problems += [
                f"resident params: {p}" for p in self.resident_optimizer.check_state(data.get("resident_state"))
            ]
        if self.remainder:
            problems += self.codec.check(data.get("main_exceptions"), self.buckets)
        if self.master_groups and data.get("master_options") is not None:
            problems += _check_options(data["master_options"], self.master_groups)
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
                    self.backing.restore(bucket, fd, path, self.buffer(), crc)
                else:
                    copy_file_crc32(fd, path, None, "", bucket.file_size, self.buffer().view, crc)
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
        groups = self.resident_optimizer.optimizer.param_groups
        has_state = {
            id(p): scalars is not None
            for group, saved_params in zip(groups, saved["params"], strict=True)
            for p, scalars in zip(group["params"], saved_params, strict=True)
        }
        return sum(2 * 4 * main.numel() for main in self.resident_mains if has_state[id(main)])

    def _restore_resident(self, saved: dict, data: bytes) -> None:
        self.resident_optimizer.import_state(saved, materialize=True)
        offset = 0
        for moment in self._resident_moments():
            n = moment.numel() * moment.element_size()
            moment.view(-1).view(torch.uint8).copy_(
                torch.frombuffer(bytearray(data[offset : offset + n]), dtype=torch.uint8)
            )
            offset += n


def _refuse_live_scratch(path: str, what: str, consequence: str) -> None:
    """Refuse a save or load at ``path`` (a checkpoint's ``base_dir/<name>``) that is,
    holds or lies inside the scratch of a live store of this process, any store's:
    e.g. ``save_to(d)`` with ``d`` the store's own ``StreamConfig.directory``. A save
    there would swap the live bucket files out (the next step fails), and closing
    the store, or a restart's purge, would delete the save."""
    overlap = live_scratch_overlap(path)
    if overlap is not None:
        raise StreamConfigError(
            f"cannot {what} {path}: it {overlap} of a live optimizer-state store of this process ({consequence}); "
            "give save_to / load_from a checkpoint directory apart from every StreamConfig.directory (e.g. the "
            "training checkpoint's own directory)"
        )


def _check_crc(path: str, crc: BlockCrc, manifest: Manifest, name: str) -> None:
    mismatch = crc_mismatch(crc.blocks, manifest.crcs(name), manifest.block_bytes)
    if mismatch:
        raise CheckpointMismatchError(f"{path}: {mismatch}: the checkpoint is corrupt")


# ---- the master's param-group options ---------------------------------------------

_JSON_SCALARS = (bool, int, float, str, type(None))
_NO_JSON = object()  # an option without a JSON form: neither saved nor restored


def _option_to_json(value):
    """An option as JSON (tensor scalars, e.g. a capturable lr, as numbers), or _NO_JSON."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else _NO_JSON
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        items = [_option_to_json(v) for v in value]
        return _NO_JSON if any(item is _NO_JSON or isinstance(item, list) for item in items) else items
    return _NO_JSON


def _options_to_json(groups: list[dict]) -> list[dict]:
    return [
        {k: j for k, v in group.items() if k != "params" and (j := _option_to_json(v)) is not _NO_JSON}
        for group in groups
    ]


def _check_options(saved: object, groups: list[dict]) -> list[str]:
    if not isinstance(saved, list) or len(saved) != len(groups) or not all(isinstance(g, dict) for g in saved):
        return [f"the saved param-group options do not describe {len(groups)} groups"]
    bad = sorted({k for g in saved for k, v in g.items() if k == "params" or _option_to_json(v) is _NO_JSON})
    return [f"unreadable param-group options: {bad}"] if bad else []


def _restore_options(saved: list[dict], groups: list[dict]) -> None:
    """Set each group's options to the saved ones, in the live values' own forms
    (a tuple stays a tuple; a tensor is filled in place)."""
    for group, options in zip(groups, saved, strict=True):
        for key, value in options.items():
            live = group.get(key)
            if isinstance(live, torch.Tensor):
                live.fill_(value)
            elif isinstance(live, tuple) and isinstance(value, list):
                group[key] = tuple(
                    old.new_tensor(v) if isinstance(old, torch.Tensor) else v
                    for old, v in zip(live, value, strict=False)
                )
            else:
                group[key] = value
