"""The saved stores a rank's state can be resharded from: its *peers*.

A rank's peers are the saved stores of the same optimizer (the ``.opt<i>`` of
the chain) whose topology names the same ``shard_peers`` (TP, PP and EP sizes
and the ranks that select the same params): together they hold every element
of this rank's params, sharded over another data-parallel group. A saved store
serves only when its manifest records each entry's param range (format 3) and
differs from the live store in nothing but the sharding (:func:`can_reshard_from`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from miles_plugins.optimizers.checkpoint.manifest import MANIFEST_NAME, START_FRESH, Manifest, differences
from miles_plugins.optimizers.errors import CheckpointMismatchError
from miles_plugins.optimizers.homes.dir_replace import saved_dirs
from miles_plugins.optimizers.homes.fs import check_plain_dir


@dataclass
class Peer:
    """One saved store a rank's state is rebuilt from."""

    directory: str
    manifest: Manifest

    @property
    def data(self) -> dict:
        return self.manifest.data


def chain_position(name: str) -> str:
    """``opt<i>`` of a store named ``rank<k>.opt<i>`` (the optimizer it belongs to)."""
    return name.rsplit(".", 1)[-1]


def can_reshard_from(saved: dict, live: dict) -> bool:
    """Whether ``saved`` (a manifest's data) differs from ``live`` (a store's
    description) only in its sharding, and records what a remap needs."""
    peers = (live.get("topology") or {}).get("shard_peers")
    return (
        peers is not None
        and (saved.get("topology") or {}).get("shard_peers") == peers
        and saved.get("pieces") is not None
        and not differences(saved, live, sharding=False)
    )


def find_peers(base_dir: str, name: str, live: dict) -> list[Peer]:
    """Every saved store under ``base_dir`` of this store's optimizer and shard
    peers; [] when there is none. Raises when this optimizer's saves exist but
    none can serve, saying why: written before checkpoints recorded param ranges,
    another TP/PP/EP size, or another storage format or optimizer."""
    ours = (live.get("topology") or {}).get("shard_peers")
    if ours is None:
        return []  # a store that records no peers (no data parallelism) is never resharded
    try:
        stores = sorted(saved_dirs(base_dir).items())  # a cut-off replace's previous save included
    except FileNotFoundError:
        return []
    peers, unfit, without_ranges, other_sizes = [], [], [], set()
    for other, path in stores:
        if chain_position(other) != chain_position(name):
            continue
        check_plain_dir(path)  # as a load of its own save refuses a symlink
        if not os.path.lexists(os.path.join(path, MANIFEST_NAME)):
            continue
        manifest = Manifest.read(path)
        theirs = (manifest.data.get("topology") or {}).get("shard_peers")
        if theirs is None or manifest.data.get("pieces") is None:
            without_ranges.append(other)
        elif theirs == ours:
            (peers if can_reshard_from(manifest.data, live) else unfit).append(Peer(path, manifest))
        elif _parallel_sizes(theirs) != _parallel_sizes(ours):
            other_sizes.add(", ".join(f"{k} {theirs.get(k)} -> {ours.get(k)}" for k in sorted(_parallel_sizes(ours))))
        # else: another TP/PP/EP coordinate of the same sizes, whose params are not this rank's
    if unfit:
        raise CheckpointMismatchError(
            f"cannot reshard the streamed optimizer state from {', '.join(p.directory for p in unfit)}: "
            + "; ".join(differences(unfit[0].data, live, sharding=False))
        )
    if not peers and without_ranges:
        listed = ", ".join(without_ranges[:4]) + (" ..." if len(without_ranges) > 4 else "")
        raise CheckpointMismatchError(
            f"{base_dir} holds streamed optimizer state ({listed}) saved before checkpoints recorded each entry's "
            "param range, or at another sharding than this run's: it loads only at the data-parallel size it was "
            f"saved at. Resume at that size, or {START_FRESH}"
        )
    if not peers and other_sizes:
        raise CheckpointMismatchError(
            f"the streamed optimizer state in {base_dir} was saved with other parallel sizes ({'; '.join(other_sizes)}"
            f"): only the data-parallel size may change. Resume with the saved TP, PP and EP sizes, or {START_FRESH}"
        )
    return peers


def _parallel_sizes(shard_peers: dict) -> dict:
    """The TP, PP and EP sizes of a ``shard_peers`` record (its ``*_size`` fields)."""
    return {k: v for k, v in shard_peers.items() if k.endswith("_size")}
