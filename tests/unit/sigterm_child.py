"""A training process for the SIGTERM tests (``test_signals.py``).

    python -m tests.unit.sigterm_child --work DIR --handler none|launcher

``none``: trains with streamed state under ``DIR/scratch``; the fault harness
stalls a write of the 3rd step and writes ``DIR/stalled`` first; the parent
then sends SIGTERM, mid-step, and the process must end as SIGTERM ends it.

``launcher``: first installs a SIGTERM handler of its own, as Megatron's
``--exit-signal-handler`` does (it records the signal; the training loop saves
a checkpoint and exits at the next step boundary), writes ``DIR/ready`` and
trains until that handler fired; then it saves to ``DIR/ckpt`` and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from tests.faults import FaultPlan
from tests.helpers import fresh, train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--handler", choices=["none", "launcher"], required=True)
    args = parser.parse_args()
    work = Path(args.work)
    received = []
    if args.handler == "launcher":
        signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    model, optimizer, scheduler, streamed = fresh(work, "rank0")
    if args.handler == "none":
        train(model, optimizer, scheduler, range(2))
        with FaultPlan(
            work / "scratch",
            "write",
            nth=2,
            fault="hang",
            hang_s=3600.0,
            on_fault=lambda: (work / "stalled").write_text(""),
        ):
            train(model, optimizer, scheduler, range(2, 3))
        time.sleep(3600)  # not reached: SIGTERM ends the process mid-step
        sys.exit(3)
    (work / "ready").write_text("")
    step = 0
    deadline = time.monotonic() + 60
    while not received and time.monotonic() < deadline:
        train(model, optimizer, scheduler, range(step, step + 1))
        step += 1
    (work / "handled").write_text(f"{received} after {step} steps")
    streamed.save_to(str(work / "ckpt"))  # needs the scratch: it must still be there
    sys.exit(0 if received else 4)


if __name__ == "__main__":
    main()
