"""``ckpt reshard``: rewrite a saved streamed state for another data-parallel size, offline.

For each optimizer of the chain (``.opt<i>``), the new ranks' entries are
Megatron's sharding at the new size, computed from what the saves recorded
(``param_layout``: every param's place in its DDP bucket, the padding rule)
as ``DistributedOptimizer`` computes it: each bucket padded to a multiple of
``lcm(dp, 128)`` (``lcm(dp, 128, 2**16)`` with padding for NCCL bus
bandwidth) and cut into ``dp`` equal ranges; a rank's entries follow the
master's param groups, each group in bucket order, bf16 params before fp32
ones; its streaming buckets follow the saved bucket cap. Each new store is
then filled by the same :class:`~miles_plugins.optimizers.checkpoint.reshard_load.ReshardedLoad`
a resharded load uses (the same plan, verified reads and requantization),
writing files instead of a live store's slots, and saved with its manifest.

A store written here that does not match what a run builds (another bucket
cap, another DDP bucket size: Megatron's default grows with DP above 40, which
is warned about; a Megatron whose padding differs) still loads: that run
reshards it again at startup. Host memory: one new entry's segment at a time
(plus its fp32 values for 8-bit moments), as in a resharded load. Only a world of data parallelism alone can be rewritten (the new
stores are named by global rank, which equals the DP rank only without TP, PP
or EP); elsewhere resume at the new size directly.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
from dataclasses import dataclass

import torch

from miles_plugins.optimizers.checkpoint.manifest import (
    CHECKSUM_KEY,
    CRC_BLOCK_BYTES,
    RESIDENT_FILE,
    Manifest,
    differences,
    removed_moment_dtype,
)
from miles_plugins.optimizers.checkpoint.reshard_load import Peer, ReshardedLoad, chain_position
from miles_plugins.optimizers.checkpoint.reshard_plan import Piece
from miles_plugins.optimizers.config import BLOCKWISE_MOMENT_DTYPES, MOMENT_DTYPES
from miles_plugins.optimizers.errors import CheckpointMismatchError, StreamIOError
from miles_plugins.optimizers.formats import remainder
from miles_plugins.optimizers.formats.layout import MAIN_DTYPE, BucketLayout, layout_store
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
from miles_plugins.optimizers.homes.locks import lock_writer, unlock_file

STAGING_BYTES = 16 << 20


def megatron_pieces(param_layout: dict, dp: int, rank: int) -> list[tuple[tuple[int, int], Piece]]:
    """(DDP bucket key, piece) of every param range DP rank ``rank`` of ``dp`` owns,
    in the order Megatron's range maps list them."""
    extra = 2**16 if param_layout.get("pad_for_high_nccl_busbw") else 1
    divisor = math.lcm(dp, 128, extra)
    out = []
    for bucket in param_layout["buckets"]:
        shard = -(-bucket["size"] // divisor) * divisor // dp
        lo, hi = rank * shard, (rank + 1) * shard
        for name, start, numel in bucket["params"]:
            first, last = max(lo, start), min(hi, start + numel)
            if last > first:
                out.append((tuple(bucket["key"]), Piece(name, first - start, last - first)))
    return out


@dataclass
class _Entry:
    piece: Piece
    group: int
    key: tuple[int, int]


class _Target:
    """What :class:`ReshardedLoad` needs of a live store, for a store written to
    ``directory``: its description, buckets, resident sizes, and a backing whose
    handles write into the new bucket files."""

    def __init__(self, directory: str, description: dict, buckets: list[BucketLayout], resident: list[int]) -> None:
        self.directory, self.description, self.buckets = directory, description, buckets
        self.resident_mains = [torch.empty(n, device="meta") for n in resident]
        self.backing = self  # its own backing: open() below gives the write handles

    def buffer(self) -> _Staging:
        return _STAGING

    def open(self, bucket: BucketLayout) -> _FileHandle:
        return _FileHandle(os.path.join(self.directory, bucket.file_name), bucket.file_size)


class _Staging:
    """Stands in for a store's staging buffer: its length is the size of each write
    (the file handles below write straight from the bytes they are given)."""

    def __init__(self, nbytes: int) -> None:
        self.view = range(nbytes)  # only len() is read


_STAGING = _Staging(STAGING_BYTES)


class _FileHandle:
    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.fd = open_file(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, size)  # the layout's padding reads as zeros

    def write(self, offset: int, src: torch.Tensor, staging) -> None:
        pwrite_full(self.fd, self.path, offset, memoryview(src.numpy()).cast("B"))

    def close(self) -> None:
        fsync(self.fd, self.path)
        os.close(self.fd)


def reshard(stores: list[tuple[str, str]], dp: int, out_dir: str, log=print) -> None:
    """Write the saved ``stores`` ((name, directory) pairs: one checkpoint's) as
    ``dp`` ranks' stores in ``out_dir``, which must not exist: everything goes to
    ``<out_dir>.partial`` first and is renamed into place at the end, so a failure
    leaves no half-written state. ``<out_dir>.lock`` is held meanwhile: a second
    reshard into the same place is refused (a partial left by one that died is
    removed). Raises :class:`CheckpointMismatchError` naming what keeps the
    checkpoint from it, :class:`StreamIOError` for the output."""
    if os.path.lexists(out_dir):
        raise CheckpointMismatchError(f"{out_dir} exists already: give a new directory")
    by_optimizer: dict[str, list[Peer]] = {}
    for name, directory in stores:
        by_optimizer.setdefault(chain_position(name), []).append(Peer(directory, Manifest.read(directory)))
    for position, peers in sorted(by_optimizer.items()):
        _check(position, peers)
    first = next(iter(by_optimizer.values()))[0].data
    saved_dp, size = first["topology"].get("dp_size"), first["param_layout"].get("ddp_bucket_size")
    if size is not None and size == _default_ddp_bucket_size(saved_dp) != _default_ddp_bucket_size(dp):
        log(
            f"warning: the save used Megatron's default DDP bucket size at DP {saved_dp} ({size:,} elements); at DP "
            f"{dp} that default is {_default_ddp_bucket_size(dp):,}, so a run at DP {dp} without --ddp-bucket-size "
            f"{size} buckets its params differently and reshards these stores again when it loads them "
            "(correct, but this rewrite does not spare it that)"
        )
    partial = f"{out_dir}.partial"
    # Every new store's layout first (no I/O): what the output needs on its drive.
    targets = [
        (peers, _target(os.path.join(partial, f"rank{rank}.{position}"), f"rank{rank}.{position}", peers, dp, rank))
        for position, peers in sorted(by_optimizer.items())
        for rank in range(dp)
    ]
    needed = sum(b.file_size for _, t in targets for b in t.buckets)
    needed += sum(3 * 4 * m.numel() for _, t in targets for m in t.resident_mains)  # at most main + moments
    needed += _MANIFEST_ALLOWANCE * len(targets)
    parent = os.path.dirname(os.path.abspath(out_dir))
    created, path = [], parent  # the parents made here (deepest first), removed again on a failure
    while not os.path.lexists(path):
        created.append(path)
        path = os.path.dirname(path)
    lock_path = f"{out_dir}.lock"
    lock, owned, renamed = None, False, False  # owned: the partial output is this run's to remove
    try:
        make_dirs(parent)
        lock = lock_writer(
            lock_path,
            f"a reshard into {out_dir}",
            "let it finish, or give another --out",
            lambda message: log(f"warning: {message}"),
        )
        owned = True
        if os.path.lexists(out_dir):  # written by a run that held the lock before us
            raise CheckpointMismatchError(f"{out_dir} exists already: give a new directory")
        remove_private_dir(partial)  # left by a run that was cut off (its lock is gone with it)
        require_free_space(parent, needed, "the resharded state")
        make_private_dir(partial)
        for peers, target in targets:
            make_private_dir(target.directory)
            load = ReshardedLoad(target, peers)
            load.write_buckets(target.buckets, write=True)
            _finish(target, load, peers)
            elements = sum(b.numel for b in target.buckets)
            name = target.description["store"]
            log(f"{name}: {len(target.buckets)} bucket(s), {elements:,} streamed elements, step {load.steps}")
        fsync_dir(partial)
        os.rename(partial, out_dir)
        renamed = True
        fsync_dir(parent)  # the rename
        for directory in created:  # each directory made here, in its own parent
            fsync_dir(os.path.dirname(directory))
    except BaseException as exc:
        if renamed:  # complete and in place
            if isinstance(exc, Exception):  # only making that durable failed
                raise StreamIOError(
                    f"{out_dir} is complete and in place, but syncing its directory entries failed ({exc}): "
                    "it may not survive a power loss until the filesystem is synced",
                    out_dir,
                ) from exc
            raise  # an interrupt: the caller finds the output in place
        # The failure that got here is the one to report: cleaning up stays quiet, and a
        # second interrupt waits until it is done.
        with _signals_deferred():
            if owned:
                with contextlib.suppress(OSError):
                    remove_private_dir(partial)
            if lock is not None:
                unlock_file(lock_path, lock)
                lock = None
            for directory in created:
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
        raise
    finally:
        if lock is not None:
            unlock_file(lock_path, lock)


# Bytes allowed per new store beyond its bucket and resident files: its manifest (layout,
# pieces, remainder exceptions), and the filesystem's rounding of each file.
_MANIFEST_ALLOWANCE = 1 << 20


@contextlib.contextmanager
def _signals_deferred():
    """SIGINT and SIGTERM held back (in this thread) until the block is done."""
    signals = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _default_ddp_bucket_size(dp: int | None) -> int | None:
    """Megatron's DDP bucket size when --ddp-bucket-size is not given (DistributedDataParallel)."""
    return None if dp is None else max(40_000_000, 1_000_000 * dp)


def _check(position: str, peers: list[Peer]) -> None:
    first = peers[0].data
    peers_of = (first.get("topology") or {}).get("shard_peers")
    problems = []
    for peer in peers[1:]:
        problems += [f"{os.path.basename(peer.directory)}: {p}" for p in differences(peer.data, first, sharding=False)]
    if removed := removed_moment_dtype(first):
        problems.append(removed)  # the moments' format is unknown to the layout below
    elif first.get("moment_dtype") not in MOMENT_DTYPES:
        problems.append(
            f"its moments are stored as {first.get('moment_dtype')!r}, which this version does not know "
            f"(it reads {', '.join(MOMENT_DTYPES)}): reshard it with the version that wrote it"
        )
    elif peers_of is None:
        problems.append(
            "its saves record no parallel topology: a plain-PyTorch save (StreamedOptimizer, no data "
            "parallelism to reshard), or one from before checkpoints recorded param ranges (format 3)"
        )
    elif first.get("pieces") is None:
        problems.append("it was saved before checkpoints recorded param ranges (format 3)")
    elif any(p.data.get("param_layout") is None for p in peers):
        problems.append("its saves record no DDP bucket layout (not a Megatron DistributedOptimizer's state)")
    elif any(v != 1 for k, v in peers_of.items() if k.endswith("_size")) or any(
        p.data["topology"].get("world_size", p.data["topology"].get("dp_size")) != p.data["topology"].get("dp_size")
        for p in peers
    ):
        sizes = ", ".join(
            f"{k} {v}" for k, v in sorted({**peers_of, **first["topology"]}.items()) if k.endswith("_size")
        )
        problems.append(
            f"it was saved with {sizes}: new stores are named by global rank, known here only for data "
            "parallelism alone; resume at the new size directly (the load reshards)"
        )
    saved_dp = (first.get("topology") or {}).get("dp_size")
    if not problems and type(saved_dp) is int:
        present = {(p.data.get("topology") or {}).get("dp_rank") for p in peers}
        if absent := [rank for rank in range(saved_dp) if rank not in present]:
            problems.append(
                f"it was saved by {saved_dp} ranks, and the store of rank(s) {absent} is missing "
                f"({', '.join(f'rank{r}.{position}' for r in absent[:4])}{', ...' if len(absent) > 4 else ''})"
            )
    if problems:
        raise CheckpointMismatchError(f"cannot reshard the {position} stores offline: " + "; ".join(problems))


def _target(directory: str, name: str, peers: list[Peer], dp: int, rank: int) -> _Target:
    """The description and layout of DP rank ``rank`` of ``dp``'s new store."""
    first = peers[0].data
    groups, fp32 = {}, set()
    for peer in peers:
        for bucket, pieces in zip(peer.data["layout"], peer.data["pieces"], strict=True):
            groups.update({n: g for n, _, g in pieces})
            if bucket.get("main") is False:  # a bucket of fp32 params' moments
                fp32.update(n for n, _, _ in pieces)
        groups.update({n: g for n, _, g in peer.data["resident_pieces"]})
        fp32.update(n for n, _, _ in peer.data["resident_pieces"])
    ranges = megatron_pieces(first["param_layout"], dp, rank)  # (DDP bucket key, piece) this rank owns
    if lost := sorted({p.key for _, p in ranges if p.key not in groups}):
        raise CheckpointMismatchError(
            f"cannot reshard into {name}: param(s) {lost[:4]} of the saved DDP layout are in no saved store "
            "(a store of the checkpoint is missing)"
        )
    owned = [_Entry(p, groups[p.key], key) for key, p in ranges]
    # The master's groups in order, each in bucket order; bf16 params before fp32 ones (the binding's
    # order); the fp32 params' moments in buckets of their own after the others, as the store lays them out.
    by_group = sorted(owned, key=lambda e: e.group)
    moments_streamed = first.get("fp32_param_moments", "resident") == "streamed"
    resident = [] if moments_streamed else [e for e in by_group if e.piece.key in fp32]
    streamed = [e for e in by_group if moments_streamed or e.piece.key not in fp32]
    buckets = layout_store(
        [(j, e.piece.numel, e.key, e.piece.key in fp32) for j, e in enumerate(streamed)],
        first["bucket_cap_elements"],
        MOMENT_DTYPES[first["moment_dtype"]],
        MAIN_DTYPE if first["main_dtype"] == "fp32" else remainder.STORAGE_DTYPE,
        first["moment_dtype"] in BLOCKWISE_MOMENT_DTYPES,
    )
    # Data parallelism alone (_check): the world is the DP group, the global rank the DP rank.
    topology = {**first["topology"], "dp_size": dp, "dp_rank": rank}
    if "world_size" in topology:
        topology["world_size"] = dp
    description = {
        # Every field of the saved description (formats, optimizer, the recorded layout; fields
        # added later included), then this rank's sharding in place of the saved one.
        **{k: v for k, v in first.items() if k not in _NOT_DESCRIPTION},
        "store": name,
        "topology": topology,
        "layout": [b.description() for b in buckets],
        "resident_numels": [e.piece.numel for e in resident],
        "pieces": [
            [[streamed[j].piece.key, streamed[j].piece.start, streamed[j].group] for j in b.entry_indices]
            for b in buckets
        ],
        "resident_pieces": [[e.piece.key, e.piece.start, e.group] for e in resident],
    }
    return _Target(directory, description, buckets, [e.piece.numel for e in resident])


# A manifest's fields that are not its store's description: the saved state, and what
# Manifest.write adds.
_NOT_DESCRIPTION = frozenset(
    {"steps_taken", "bucket_state", "resident_state", "main_exceptions", "master_options", "files"}
    | {"format", "format_version", "crc_block_bytes", CHECKSUM_KEY}
)


def _finish(target: _Target, load: ReshardedLoad, peers: list[Peer]) -> None:
    """The resident moments, the checksums and the manifest of a filled store."""
    data = peers[0].data
    resident_state = load.resident_state() if target.resident_mains else None
    files = {}
    if resident_state is not None:
        with create_file(target.directory, RESIDENT_FILE) as fd:
            path = os.path.join(target.directory, RESIDENT_FILE)
            pwrite_full(fd, path, 0, memoryview(load.resident_bytes(resident_state)))
            fsync(fd, path)
    for name in sorted(os.listdir(target.directory)):
        size = os.path.getsize(os.path.join(target.directory, name))
        files[name] = {
            "size": size,
            "block_crc32": file_crcs(os.path.join(target.directory, name), size, CRC_BLOCK_BYTES),
        }
    remainder_mains = data["main_dtype"] != "fp32"
    Manifest(
        {
            **target.description,
            "steps_taken": load.steps,
            "bucket_state": load.bucket_states(),
            "resident_state": resident_state,
            "main_exceptions": load.exceptions() if remainder_mains else None,
            "master_options": data.get("master_options"),
            "files": files,
        }
    ).write(target.directory)
    fsync_dir(target.directory)
