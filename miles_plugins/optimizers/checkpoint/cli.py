"""Operator's commands for saved streamed optimizer state; no GPU, no live store.

    python -m miles_plugins.optimizers.ckpt inspect DIR
    python -m miles_plugins.optimizers.ckpt reshard DIR [--tp T] [--pp P] [--ep E] [--dp N] --out NEW_ITER_DIR

``reshard`` rewrites the state for ``N`` data-parallel ranks at TP, PP and EP
sizes ``T``, ``P`` and ``E`` (each the saved size when not given; ``N`` the
saved world size over ``T x P`` when not given; ``reshard_offline.py``),
verifying every block it reads; exit status 1 on any
problem with the checkpoint or the output (nothing is left in ``--out`` then),
2 on bad usage, 130 on Ctrl-C and 143 on SIGTERM (the partial output removed).

``DIR`` is a checkpoint's iteration directory (its ``streamed_optimizer_state/``
is read), that directory itself, the directory given to
``StreamedOptimizer.save_to``, or one saved store. Entries no load reads (a
note copied in beside the stores) are listed as ignored. For every saved store
``inspect`` prints the topology, the storage formats, the layout and the step
count, and checks what a load would (``inspection.py``): the manifest's own
checksum, that it is the store its directory is named after, its file table
against its layout, and each file's presence, size and checksums (every byte is
read); a store whose replace was cut off is read from ``.<name>.previous`` as a
load does; a rank of the recorded world size without a store, a data-parallel
group with some of its stores of an optimizer missing, and stores of different
world sizes or (Megatron's) step counts, a directory that mixes saves, are
problems too. Exit status: 0 when everything verifies, 1 on any problem (each
one listed), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator

from megatron_hooks.checkpoint import STATE_DIRNAME
from miles_plugins.optimizers.checkpoint.inspection import (
    STORE_NAME,
    CrossStoreCheck,
    NotAStateDir,
    check_store,
    describe,
    not_plain_dir,
    stores_under,
)
from miles_plugins.optimizers.checkpoint.reshard_offline import reshard
from miles_plugins.optimizers.errors import CheckpointMismatchError, StreamIOError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m miles_plugins.optimizers.ckpt", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect_parser = commands.add_parser("inspect", help="describe and verify every saved store under DIR")
    inspect_parser.add_argument(
        "dir",
        metavar="DIR",
        help=f"a checkpoint's iteration directory (holding {STATE_DIRNAME}/), that {STATE_DIRNAME}/ directory, "
        "the directory given to StreamedOptimizer.save_to, or one saved store",
    )
    reshard_parser = commands.add_parser(
        "reshard", help="rewrite the saved state under DIR for another parallel layout, into --out"
    )
    reshard_parser.add_argument("dir", metavar="DIR")
    reshard_parser.add_argument("--dp", type=int, help="the new data-parallel size (default: the saved world kept)")
    for flag, what in (("--tp", "tensor"), ("--pp", "pipeline"), ("--ep", "expert")):
        reshard_parser.add_argument(flag, type=int, help=f"the new {what}-parallel size (default: the saved one)")
    reshard_parser.add_argument(
        "--out",
        required=True,
        help="the new checkpoint's iteration directory (its streamed_optimizer_state/ is written)",
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        parser.error(f"{args.dir} is not a directory")
    if args.command == "inspect":
        return inspect(args.dir)
    sizes = {"--dp": args.dp, "--tp": args.tp, "--pp": args.pp, "--ep": args.ep}
    for flag, size in sizes.items():
        if size is not None and size < 1:
            parser.error(f"{flag} {size}: it must be at least 1")
    if all(size is None for size in sizes.values()):
        parser.error("give the new layout: --dp, --tp, --pp and/or --ep")
    return reshard_command(args.dir, args.dp, args.out, (args.tp, args.pp, args.ep))


# ---- inspect ---------------------------------------------------------------------


def inspect(directory: str) -> int:
    """``ckpt inspect DIR``: describe and verify every saved store; 0 when all verify."""
    try:
        stores, ignored = stores_under(directory)
    except (NotAStateDir, OSError) as exc:
        print(exc, file=sys.stderr)
        return 1
    if not stores:
        print(f"no saved streamed optimizer state under {directory}", file=sys.stderr)
        return 1
    for note in ignored:
        print(f"note: {note}", flush=True)
    failed, recorded = 0, CrossStoreCheck()
    for name, path in stores:
        failed += not _inspect_store(name, path, recorded)
    problems = recorded.problems([name for name, _ in stores])
    for problem in problems:
        print(f"PROBLEM: {problem}", flush=True)
    print(f"{len(stores) - failed} of {len(stores)} saved stores verify", flush=True)
    return 1 if failed or problems else 0


def _inspect_store(name: str, path: str, recorded: CrossStoreCheck) -> bool:
    """Print one saved store's description and problems, add what its manifest
    records to ``recorded``; whether it verifies."""
    start = time.perf_counter()
    print(f"{path}:", flush=True)
    if os.path.basename(path) != name:
        print(f"  note: {name} is missing; a load reads the previous save, kept aside by a cut-off replace")
    try:
        problems, manifest = check_store(name, path)
        if manifest is not None:
            print("  " + describe(manifest), flush=True)
            recorded.add(name, manifest)
    except (CheckpointMismatchError, StreamIOError, OSError, TypeError, AttributeError) as exc:
        problems = [str(exc).splitlines()[0] if isinstance(exc, (TypeError, AttributeError)) else str(exc)]
    for problem in problems:
        print(f"  PROBLEM: {problem}", flush=True)
    if not problems:
        print(f"  OK: every file's size and CRC-32 match ({time.perf_counter() - start:.1f} s)", flush=True)
    return not problems


# ---- reshard ---------------------------------------------------------------------


def reshard_command(
    directory: str, dp: int | None, out: str, layout: tuple[int | None, int | None, int | None] = (None, None, None)
) -> int:
    """``ckpt reshard DIR [--tp T --pp P --ep E] [--dp N] --out OUT``: the exit status (see
    the module docstring); ``layout``: the new TP, PP and EP sizes (None: the saved one)."""
    if not out.strip():
        print("cannot reshard: --out is empty: give the new checkpoint's iteration directory", file=sys.stderr)
        return 2
    out = os.path.normpath(os.path.abspath(out))  # a trailing slash would put the partial output inside
    out_dir = out if os.path.basename(out) == STATE_DIRNAME else os.path.join(out, STATE_DIRNAME)
    iteration = os.path.basename(os.path.dirname(out_dir))
    if not re.fullmatch(r"iter_\d+|release", iteration):
        print(
            f"warning: --out {out} is not an iteration directory (iter_<N> or release): Megatron loads the "
            "state from <checkpoint>/iter_<N>/, so copy it there",
            flush=True,
        )
    start = time.perf_counter()
    with _sigterm_unwinds():
        try:
            stores = _stores_to_reshard(directory, out, out_dir)
            world = reshard(stores, dp, out_dir, log=lambda line: print(line, flush=True), layout=layout)
        except (NotAStateDir, CheckpointMismatchError, StreamIOError, OSError) as exc:
            print(f"cannot reshard {directory}: {exc}", file=sys.stderr)
            return 1
        except (KeyboardInterrupt, _Terminated) as exc:
            what = "terminated (SIGTERM)" if isinstance(exc, _Terminated) else "interrupted"
            done = (
                f"{out_dir} is complete and in place" if os.path.lexists(out_dir) else f"nothing was written to {out}"
            )
            print(f"reshard {what}: {done}", file=sys.stderr)
            return 143 if isinstance(exc, _Terminated) else 130
    print(f"wrote {world} rank(s) of streamed optimizer state to {out_dir} in {time.perf_counter() - start:.1f} s")
    return 0


def _stores_to_reshard(directory: str, out: str, out_dir: str) -> list[tuple[str, str]]:
    """The saved stores under ``directory``, exactly what a load would read; refused
    when a load would refuse one, when one is a stray copy beside a chain's stores,
    or when the output ``out_dir`` lies inside them."""
    stores, _ = stores_under(directory)
    if not stores:
        raise NotAStateDir(f"no saved streamed optimizer state under {directory}")
    for _, path in stores:  # what a load would read, and nothing else
        if not_plain := not_plain_dir(path):
            raise NotAStateDir(not_plain)
    strays = [name for name, _ in stores if not STORE_NAME.fullmatch(name)]
    if strays and len(strays) < len(stores):
        raise NotAStateDir(
            f"{', '.join(strays)}: not named as a Megatron chain's stores are (rank<N>.opt<M>); a copy? "
            "move it out of the state directory"
        )
    source = os.path.realpath(os.path.dirname(stores[0][1]))
    if os.path.commonpath([source, os.path.realpath(out_dir)]) == source:
        raise NotAStateDir(f"--out {out} lies inside the state it reads ({source}): give a directory outside it")
    return stores


class _Terminated(BaseException):
    """SIGTERM, raised where the reshard is, so its cleanup runs."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (a scheduler's cancel) unwinds like Ctrl-C inside the block, so the
    partial output is removed. Only the main thread may set a handler; one set
    from C is left alone."""
    previous = signal.getsignal(signal.SIGTERM)
    handle = previous is not None and threading.current_thread() is threading.main_thread()
    if handle:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        if handle:
            signal.signal(signal.SIGTERM, previous)
