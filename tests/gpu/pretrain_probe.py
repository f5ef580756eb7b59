"""GPU tier harness: a Megatron-LM script through the launcher, with a record of every iteration.

    torchrun --nproc-per-node=N -m tests.gpu.pretrain_probe pretrain_gpt.py [args]
    (PRETRAIN_PROBE_OUT=file.jsonl)

Wraps ``megatron.training.training.train_step`` (test instrumentation, not part
of the launcher): after each step, rank 0 appends one JSON line to
``$PRETRAIN_PROBE_OUT`` with the iteration's reduced losses (``float.hex``,
exact) and a SHA-256 of every model param's bytes. Then it runs
``miles_plugins.launch`` on the arguments, so the same harness serves the
resident run (no streaming flag) and the streamed one.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch


def _params_hash(model) -> str:
    digest = hashlib.sha256()
    for chunk in model:
        for param in chunk.parameters():
            digest.update(param.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _record_each_step(training, out: str) -> None:
    original = training.train_step

    def train_step(forward_step_func, data_iterator, model, *args, **kwargs):
        result = original(forward_step_func, data_iterator, model, *args, **kwargs)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            record = {
                "iteration": kwargs.get("iteration"),
                "losses": {k: float(v).hex() for k, v in result[0].items()},
                "params": _params_hash(model),
            }
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
        return result

    training.train_step = train_step


def main() -> int:
    from miles_plugins import launch

    out = os.environ["PRETRAIN_PROBE_OUT"]
    # Wrapped when the script imports it, as the launcher wraps its names: nothing
    # is imported ahead of the script here either.
    recorder = launch._AfterImport({"megatron.training.training": lambda m: _record_each_step(m, out)})
    sys.meta_path.insert(0, recorder)
    return launch.main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
