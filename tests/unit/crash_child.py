"""A training process for the kill tests (``test_crash.py``): it is SIGKILLed mid-way.

    python -m tests.unit.crash_child --work DIR --kill-in step|save|replace|background-save [--nth N]

Trains the reference model with streamed state under ``DIR/scratch`` (name
``rank0``), saves a checkpoint to ``DIR/ckpt`` after SAVE_AT steps, trains one
more step, and then either steps again or saves again into the same checkpoint
directory. In that last phase the fault harness stalls a write half way (the
6th of the step's bucket writes, or the 3rd bucket file of the save) and writes
``DIR/stalled`` first: the parent waits for that file and kills this process
while the step (or the save) is half done.

``background-save``: the second save runs in the background while the run trains
on; its ``--nth`` write to the checkpoint directory stalls and the parent kills the
process there (training goes on meanwhile, and a step may be waiting for the save).

``replace``: the second save runs where ``renameat2(RENAME_EXCHANGE)`` is
refused (EINVAL, as on NFS), and the process dies (``os._exit``: no cleanup
runs, as with SIGKILL) between the fallback's two renames: the previous save
moved aside, the new one not yet in its place.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from tests.faults import FaultPlan
from tests.helpers import SAVE_AT, save_run, train
from tests.unit.reference import loss_fn


def die_between_the_fallback_renames(streamed, ckpt: Path) -> None:
    import ctypes
    import errno

    from miles_plugins.optimizers.homes import dir_replace

    def no_exchange(*args):
        ctypes.set_errno(errno.EINVAL)
        return -1

    dir_replace._renameat2 = lambda: no_exchange
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(".rank0.partial-") and str(dst).endswith("/rank0"):
            os._exit(9)  # the previous save is at .rank0.previous, the new one still in its partial directory
        return real_rename(src, dst)

    os.rename = rename
    streamed.save_to(str(ckpt))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--kill-in", choices=["step", "save", "replace", "background-save"], required=True)
    parser.add_argument("--nth", type=int, default=None, help="the write that stalls (default: per --kill-in)")
    args = parser.parse_args()
    work = Path(args.work)
    model, optimizer, scheduler, streamed = save_run(work, work / "ckpt")
    train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + 1))
    if args.kill_in == "replace":
        die_between_the_fallback_renames(streamed, work / "ckpt")
    target = work / ("scratch" if args.kill_in == "step" else "ckpt")

    def tell_parent() -> None:
        (work / "stalled").write_text(str(os.getpid()))

    nth = args.nth or (6 if args.kill_in == "step" else 3)
    with FaultPlan(target, "write", nth=nth, fault="hang", hang_s=3600.0, on_fault=tell_parent):
        if args.kill_in == "step":
            loss_fn(model, SAVE_AT + 1).backward()
            optimizer.step()
        elif args.kill_in == "background-save":
            pending = streamed.save_to(str(work / "ckpt"), asynchronous=True)
            train(model, optimizer, scheduler, range(SAVE_AT + 1, SAVE_AT + 3))
            pending.wait()
        else:
            streamed.save_to(str(work / "ckpt"))
    time.sleep(3600)  # not reached: the parent kills this process while it is stalled
    torch.save(None, work / "not-killed")


if __name__ == "__main__":
    main()
