"""``ckpt reshard``: rewrite a saved streamed state for another parallel layout, offline.

The saves are checked for what an offline reshard needs (:func:`_check_saves`),
each new rank's store is planned as Megatron would build it at the new sizes
(``reshard_targets``), then filled from the saves and written
(``reshard_output``) into a partial directory that is renamed into place when
complete.

Another data-parallel size of a world of data parallelism alone is planned from
each optimizer's recorded DDP layout and read by param name. Any other layout
(other TP, PP or EP sizes, or another DP size beside them) is planned from the
model the saves record (``reshard_model``, ``reshard_layout``: stores named by
global rank in Megatron's rank order) and read by key and global box from every
save of the checkpoint; it needs saves that record their params' keys and boxes
(format 4).

A store written here that does not match what a run builds (another bucket
cap, another DDP bucket size: Megatron's default grows with DP above 40, which
is warned about; a Megatron whose padding or param order differs; a tied
embedding's copy the last stage keeps at PP > 1 when the save had one stage)
still loads: that run reshards it again at startup. Host memory: one new entry's
segment at a time (plus its fp32 values for 8-bit moments), as in a resharded load.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from miles_plugins.optimizers.checkpoint.manifest import Manifest, differences, removed_moment_dtype
from miles_plugins.optimizers.checkpoint.reshard_layout import Sizes
from miles_plugins.optimizers.checkpoint.reshard_output import OutputDirectory, write_store
from miles_plugins.optimizers.checkpoint.reshard_peers import Peer, chain_position, layout_sizes
from miles_plugins.optimizers.checkpoint.reshard_targets import (
    NewStore,
    default_ddp_bucket_size,
    layout_stores,
    new_store,
)
from miles_plugins.optimizers.config import MOMENT_DTYPES
from miles_plugins.optimizers.errors import CheckpointMismatchError

# Bytes allowed per new store beyond its bucket and resident files: its manifest (layout,
# pieces, remainder exceptions), and the filesystem's rounding of each file.
_MANIFEST_ALLOWANCE = 1 << 20


def reshard(
    stores: list[tuple[str, str]],
    dp: int | None,
    out_dir: str,
    log: Callable[[str], None] = print,
    layout: tuple[int | None, int | None, int | None] = (None, None, None),
) -> int:
    """Write the saved ``stores`` ((name, directory) pairs: one checkpoint's) as the
    stores of ``dp`` data-parallel ranks at TP, PP and EP sizes ``layout`` (None: the
    saved size; ``dp`` None: the saved world size kept) in ``out_dir``, which must
    not exist: everything goes to ``<out_dir>.partial`` first and is renamed into
    place at the end, so a failure leaves no half-written state. ``<out_dir>.lock``
    is held meanwhile: a second reshard into the same place is refused (a partial
    left by one that died is removed). Returns the new world size. Raises
    :class:`CheckpointMismatchError` naming what keeps the checkpoint from it,
    :class:`StreamIOError` for the output."""
    if os.path.lexists(out_dir):
        raise CheckpointMismatchError(f"{out_dir} exists already: give a new directory")
    by_optimizer = _saves_by_optimizer(stores)
    first = next(iter(by_optimizer.values()))[0].data
    saved = [(first.get("topology") or {}).get(k) for k in ("tp_size", "pp_size", "ep_size")]
    wanted = [w if w is not None else (s or 1) for w, s in zip(layout, saved, strict=True)]
    by_key = wanted != [1, 1, 1] or not all(_data_parallel_alone(p) for p in by_optimizer.values())
    for position, peers in sorted(by_optimizer.items()):
        _check_saves(position, peers, by_key)
    if by_key:
        sources = [p for peers in by_optimizer.values() for p in peers if p.data["topology"]["optimizer_instance"] == 0]
        world = first["topology"]["world_size"]
        sizes = Sizes(*wanted, dp if dp is not None else world // (wanted[0] * wanted[1]))
        planned = [(sources, store) for store in layout_stores(sources, sizes)]
        dp, world = sizes.dp, sizes.world
    else:
        if dp is None:
            raise CheckpointMismatchError("give the new data-parallel size (--dp), or other TP, PP or EP sizes")
        planned = [
            (peers, new_store(f"rank{rank}.{position}", peers, dp, rank))
            for position, peers in sorted(by_optimizer.items())
            for rank in range(dp)
        ]
        world = dp
    _warn_if_the_default_bucket_size_changes(first, dp, log)
    # Every new store's layout first (no I/O): what the output needs on its drive.
    with OutputDirectory(out_dir, log) as output:
        output.prepare(_bytes_needed([store for _, store in planned]))
        for peers, store in planned:
            steps = write_store(store, os.path.join(output.partial, store.name), peers, by_key)
            elements = sum(b.numel for b in store.buckets)
            log(f"{store.name}: {len(store.buckets)} bucket(s), {elements:,} streamed elements, step {steps}")
        output.publish()
    return world


def _saves_by_optimizer(stores: list[tuple[str, str]]) -> dict[str, list[Peer]]:
    """The saved stores of each optimizer of the chain (``opt<i>`` -> its ranks' saves)."""
    by_optimizer: dict[str, list[Peer]] = {}
    for name, directory in stores:
        by_optimizer.setdefault(chain_position(name), []).append(Peer(directory, Manifest.read(directory), name))
    return by_optimizer


def _bytes_needed(stores: Sequence[NewStore]) -> int:
    """What the new stores need on their drive, at most."""
    needed = sum(b.file_size for store in stores for b in store.buckets)
    needed += sum(3 * 4 * n for store in stores for n in store.resident_numels)  # at most main + moments
    return needed + _MANIFEST_ALLOWANCE * len(stores)


def _warn_if_the_default_bucket_size_changes(saved: dict, dp: int, log: Callable[[str], None]) -> None:
    """Warn when the save used Megatron's default DDP bucket size, which at ``dp``
    is another: a run there buckets its params differently and reshards again."""
    saved_dp, size = saved["topology"].get("dp_size"), saved["param_layout"].get("ddp_bucket_size")
    if size is not None and size == default_ddp_bucket_size(saved_dp) != default_ddp_bucket_size(dp):
        log(
            f"warning: the save used Megatron's default DDP bucket size at DP {saved_dp} ({size:,} elements); at DP "
            f"{dp} that default is {default_ddp_bucket_size(dp):,}, so a run at DP {dp} without --ddp-bucket-size "
            f"{size} buckets its params differently and reshards these stores again when it loads them "
            "(correct, but this rewrite does not spare it that)"
        )


def _check_saves(position: str, peers: list[Peer], by_key: bool) -> None:
    """Refuse, naming every reason, the saves of optimizer ``position`` that an
    offline reshard cannot rewrite: saves that differ in more than their sharding,
    an unknown moment format, no recorded topology, param ranges or DDP layout; by
    param name (``by_key`` False): a saved rank missing; by key and box: no
    recorded keys and boxes."""
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
    elif by_key and any(not (p.data.get("param_facts") or {}).get("params") for p in peers):
        sizes = ", ".join(f"{k} {v}" for k, v in sorted(layout_sizes(first).items()) if v is not None)
        problems.append(
            f"it was saved with {sizes} by a version (or from a model) that did not record each param's key and "
            "global boxes (format 4): it is rewritten only for another DP size of data parallelism alone, and loads "
            "only at its own TP, PP and EP sizes (at any DP size: resume there directly)"
        )
    if not problems and not by_key:
        problems += _missing_ranks(position, peers)
    if problems:
        raise CheckpointMismatchError(f"cannot reshard the {position} stores offline: " + "; ".join(problems))


def _data_parallel_alone(peers: list[Peer]) -> bool:
    """Whether the saves' TP, PP and EP sizes are 1 and every world is its DP group."""
    return all(
        all(v == 1 for v in layout_sizes(p.data).values() if v is not None)
        and p.data["topology"].get("world_size", p.data["topology"].get("dp_size")) == p.data["topology"].get("dp_size")
        for p in peers
    )


def _missing_ranks(position: str, peers: list[Peer]) -> list[str]:
    """The problem of a saved DP rank without a store, if any."""
    saved_dp = (peers[0].data.get("topology") or {}).get("dp_size")
    if type(saved_dp) is not int:
        return []
    present = {(p.data.get("topology") or {}).get("dp_rank") for p in peers}
    absent = [rank for rank in range(saved_dp) if rank not in present]
    if not absent:
        return []
    listed = ", ".join(f"rank{r}.{position}" for r in absent[:4]) + (", ..." if len(absent) > 4 else "")
    return [f"it was saved by {saved_dp} ranks, and the store of rank(s) {absent} is missing ({listed})"]
