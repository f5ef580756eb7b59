"""The saved stores a rank's state can be resharded from: its *peers*.

At the saved TP, PP and EP sizes, a rank's peers are the saved stores of the
same optimizer (the ``.opt<i>`` of the chain) whose topology names the same
``shard_peers`` (TP, PP and EP sizes and the ranks that select the same params):
together they hold every element of this rank's params, sharded over another
data-parallel group, and entries are matched by param name.

At other TP, PP or EP sizes every saved store of the checkpoint is a peer,
whatever its chain position (an expert optimizer of EP 2 becomes part of the
dense one at EP 1), and entries are matched by the keys and global boxes
Megatron checkpoints params by (``reshard_keys``): every save and this run must
record them (format 4, ``param_facts``), and only the first distributed-optimizer
instance's saves are read (each instance holds a whole copy). A saved store
serves only when it differs from the live store in nothing but its sharding and
layout: the same storage formats and optimizer.
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
    name: str = ""  # the store's name (its directory may be the previous save kept aside)

    def __post_init__(self) -> None:
        self.name = self.name or os.path.basename(self.directory)

    @property
    def data(self) -> dict:
        return self.manifest.data


def chain_position(name: str) -> str:
    """``opt<i>`` of a store named ``rank<k>.opt<i>`` (the optimizer it belongs to)."""
    return name.rsplit(".", 1)[-1]


def layout_sizes(data: dict) -> dict:
    """The TP, PP and EP sizes a store's description (or manifest data) records."""
    topology = data.get("topology") or {}
    sizes = {k: topology.get(k) for k in ("tp_size", "pp_size", "ep_size")}
    sizes.update(_parallel_sizes(topology.get("shard_peers") or {}))
    return sizes


def by_keys(peers: list[Peer], live: dict) -> bool:
    """Whether ``peers`` were saved at other TP, PP or EP sizes than ``live``'s (their
    entries are then matched by key and box, not by param name)."""
    ours = (live.get("topology") or {}).get("shard_peers")
    return any((p.data.get("topology") or {}).get("shard_peers") != ours for p in peers)


def can_reshard_from(saved: dict, live: dict) -> bool:
    """Whether a load should look for ``saved``'s (a manifest's data) peers instead of
    loading it as this store's own: it differs from ``live`` (a store's description)
    only in its data-parallel sharding and records what a remap needs, or it was saved
    at other TP, PP or EP sizes (:func:`find_peers` then reads or refuses)."""
    peers = (live.get("topology") or {}).get("shard_peers")
    if peers is None:
        return False
    if _at_other_sizes(saved, live):
        return True
    return (
        (saved.get("topology") or {}).get("shard_peers") == peers
        and saved.get("pieces") is not None
        and not differences(saved, live, sharding=False)
    )


def _at_other_sizes(saved: dict, live: dict) -> bool:
    """Whether ``saved`` records TP, PP or EP sizes, and others than ``live``'s."""
    mine, theirs = layout_sizes(live), layout_sizes(saved)
    return any(theirs[k] is not None and theirs[k] != mine[k] for k in mine.keys() & theirs.keys())


def find_peers(base_dir: str, name: str, live: dict) -> list[Peer]:
    """Every saved store under ``base_dir`` this store's state is rebuilt from; []
    when there is none. Raises, in one line, when saves exist but none can serve:
    written before checkpoints recorded param ranges (or, at other TP, PP or EP
    sizes, the params' global boxes), another storage format or optimizer."""
    ours = (live.get("topology") or {}).get("shard_peers")
    if ours is None:
        return []  # a store that records no peers (no data parallelism) is never resharded
    saved = _saved_stores(base_dir)
    peers, unfit, without_ranges = [], [], []
    for peer in saved:
        theirs = (peer.data.get("topology") or {}).get("shard_peers")
        if chain_position(peer.name) != chain_position(name):
            continue
        if theirs is None or peer.data.get("pieces") is None:
            without_ranges.append(peer.name)
        elif theirs == ours:
            fits = peer.data.get("pieces") is not None and not differences(peer.data, live, sharding=False)
            (peers if fits else unfit).append(peer)
        # else: another TP/PP/EP coordinate or size, whose params are not this rank's
    if unfit:
        raise CheckpointMismatchError(
            f"cannot reshard the streamed optimizer state from {', '.join(p.directory for p in unfit)}: "
            + "; ".join(differences(unfit[0].data, live, sharding=False))
        )
    if peers and _names(live) <= set().union(*(_names(p.data) for p in peers)):
        return peers
    if any(_at_other_sizes(peer.data, live) for peer in saved) or (peers and _facts_everywhere(saved, live)):
        # Other sizes, or params the same sizes' saves do not name (e.g. a rewrite that could not
        # rebuild a tied embedding's copy): by key and box from every save.
        return _keyed_peers(base_dir, saved, live)
    if peers:
        return peers  # their plan names the params no save holds
    if without_ranges:
        listed = ", ".join(without_ranges[:4]) + (" ..." if len(without_ranges) > 4 else "")
        raise CheckpointMismatchError(
            f"{base_dir} holds streamed optimizer state ({listed}) saved before checkpoints recorded each entry's "
            "param range, or at another sharding than this run's: it loads only at the data-parallel size it was "
            f"saved at. Resume at that size, or {START_FRESH}"
        )
    return []


def _names(data: dict) -> set[str]:
    """The params a store's (or a manifest's) entries hold ranges of."""
    pieces = [p for bucket in data.get("pieces") or [] for p in bucket] + list(data.get("resident_pieces") or [])
    return {name for name, _, _ in pieces}


def _facts_everywhere(saved: list[Peer], live: dict) -> bool:
    return bool((live.get("param_facts") or {}).get("params")) and all(
        (p.data.get("param_facts") or {}).get("params") for p in saved
    )


def _saved_stores(base_dir: str) -> list[Peer]:
    """Every complete saved store under ``base_dir`` (a cut-off replace's previous save included)."""
    try:
        stores = sorted(saved_dirs(base_dir).items())
    except FileNotFoundError:
        return []
    saved = []
    for name, path in stores:
        check_plain_dir(path)  # as a load of its own save refuses a symlink
        if os.path.lexists(os.path.join(path, MANIFEST_NAME)):
            saved.append(Peer(path, Manifest.read(path), name))
    return saved


def _keyed_peers(base_dir: str, saved: list[Peer], live: dict) -> list[Peer]:
    """The saves of another TP, PP or EP layout this store reads by key and box (the
    first optimizer instance's, every chain position); refused in one line when the
    saves or this run lack the facts, or the saves differ in more than their layout."""
    sizes = ", ".join(f"{k} {v}" for k, v in sorted(layout_sizes(saved[0].data).items()) if v is not None)
    mine = ", ".join(f"{k} {v}" for k, v in sorted(layout_sizes(live).items()) if v is not None)
    where = f"the streamed optimizer state in {base_dir} was saved with {sizes} (this run: {mine})"
    lacking = [p.name for p in saved if not (p.data.get("param_facts") or {}).get("params")]
    if lacking:
        raise CheckpointMismatchError(
            f"{where}, and {', '.join(lacking[:4])}{' ...' if len(lacking) > 4 else ''} record(s) no param keys and "
            "global boxes (saved before format 4, or not by Megatron's binding): it loads only at the TP, PP and EP "
            f"sizes it was saved at. Resume with those, or {START_FRESH}"
        )
    if not (live.get("param_facts") or {}).get("params"):
        raise CheckpointMismatchError(
            f"{where}, and this run records no param keys and global boxes (Megatron's sharded_state_dict does not "
            f"place every param: see the warning at setup): resume with the saved TP, PP and EP sizes, or {START_FRESH}"
        )
    problems = [f"{p.name}: {d}" for p in saved for d in differences(p.data, live, sharding=False)]
    flags = [
        p.data["param_facts"].get("metadata")
        for p in saved
        if p.data["param_facts"].get("metadata") != live["param_facts"].get("metadata")
    ]
    problems += [f"its param keys were taken with other sharded_state_dict metadata ({flags[0]})"] if flags else []
    worlds = {tuple((p.data.get("topology") or {}).get(k) for k in _WORLD) for p in saved}
    problems += [f"the directory mixes saves of different layouts ({sorted(worlds)[:2]})"] if len(worlds) > 1 else []
    if problems:
        raise CheckpointMismatchError(f"{where}; it cannot be resharded: " + "; ".join(problems[:4]))
    return [p for p in saved if (p.data.get("topology") or {}).get("optimizer_instance", 0) == 0]


# What every store of one save records alike.
_WORLD = ("world_size", "tp_size", "pp_size", "ep_size")


def _parallel_sizes(shard_peers: dict) -> dict:
    """The TP, PP and EP sizes of a ``shard_peers`` record (its ``*_size`` fields)."""
    return {k: v for k, v in shard_peers.items() if k.endswith("_size")}
