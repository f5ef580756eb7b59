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


def install(out: str) -> None:
    import megatron.training.training as training

    original = training.train_step

    def train_step(forward_step_func, data_iterator, model, *args, **kwargs):
        result = original(forward_step_func, data_iterator, model, *args, **kwargs)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            losses = {k: float(v).hex() for k, v in result[0].items()}
            with open(out, "a") as f:
                f.write(
                    json.dumps({"iteration": kwargs.get("iteration"), "losses": losses, "params": _params_hash(model)})
                    + "\n"
                )
        return result

    training.train_step = train_step


def main() -> int:
    from miles_plugins import launch

    argv = sys.argv[1:]
    if argv and os.path.isfile(argv[0]):
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        install(os.environ["PRETRAIN_PROBE_OUT"])
    return launch.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
