"""The plain-PyTorch front end: stream the state of an ordinary torch Adam/AdamW."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from miles_plugins.optimizers.checkpoint.background import BackgroundSave
from miles_plugins.optimizers.config import StreamConfig
from miles_plugins.optimizers.errors import StreamConfigError
from miles_plugins.optimizers.step.adam import backend_for, bind_master, is_streamed
from miles_plugins.optimizers.step.entries import Entry, StepStats
from miles_plugins.optimizers.store.streaming_store import StreamingStore


def _fp32_grad(entry: Entry) -> torch.Tensor | None:
    grad = entry.param.grad
    return None if grad is None else grad.float()


def _copy_main_to_param(entry: Entry) -> None:
    entry.param.copy_(entry.main)


def _copy_param_to_main(param: torch.Tensor, main: torch.Tensor) -> None:
    main.copy_(param)


class StreamedOptimizer:
    """Runs a ``torch.optim.Adam``/``AdamW`` with its state streamed through files.

    Build the torch optimizer over the model's params as usual (param groups,
    lr, weight decay, ...), then wrap it before its first step::

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        streamed = StreamedOptimizer(opt, StreamConfig(directory="/nvme/opt"))
        sched = torch.optim.lr_scheduler.StepLR(opt, 10)   # schedulers drive `opt`
        ...
        loss.backward(); opt.step(); opt.zero_grad(); sched.step()

    For bf16/fp16 params, ``StreamedOptimizer`` keeps fp32 mains (in the
    files) and copies the updated mains into the params after each update: the
    usual mixed-precision recipe, bit for bit. fp32 params are their own
    mains, which stay in the model; their moments stream too, in buckets of
    their own (``StreamConfig.fp32_param_moments``).

    The wrapped optimizer is the *master*: its own update never runs and it
    holds no state, but its param groups are read at every step, so schedulers
    and manual lr/weight-decay changes take effect as they would unstreamed.
    On that instance only, ``step`` is rebound to the streamed step (so
    ``opt.step()`` and ``streamed.step()`` are the same call, and an LR
    scheduler sees it), and ``state_dict`` / ``load_state_dict`` refuse: the
    master holds none of the state they would claim to carry.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: StreamConfig) -> None:
        if is_streamed(optimizer):
            raise StreamConfigError("this optimizer is streamed already: wrap it once, and keep that StreamedOptimizer")
        if any(optimizer.state.values()):
            raise StreamConfigError(
                "the optimizer already holds state (it has stepped): wrap it before its "
                "first step, or its resident moments would stay allocated beside the stream"
            )
        self.optimizer = optimizer
        entries = []
        for group_index, group in enumerate(optimizer.param_groups):
            for index, param in enumerate(group["params"]):
                if param.dtype == torch.float32:
                    main = param
                else:
                    # An fp32 main with no storage yet: the store fills it from the
                    # param one bucket at a time, so all mains never exist at once.
                    main = torch.empty(param.shape, dtype=torch.float32, device=param.device)
                    main.untyped_storage().resize_(0)
                entries.append(Entry(param=param, main=main, group_index=group_index, name=f"{group_index}.{index}"))
        self.store = StreamingStore(
            entries,
            backend_for(optimizer),
            config,
            grad_fn=_fp32_grad,
            copy_to_model=_copy_main_to_param,
            init_main=_copy_param_to_main,
            # _fp32_grad widens each non-fp32 grad of the bucket being updated.
            grad_bytes_per_element=4 if any(e.param.dtype != torch.float32 for e in entries) else 0,
            # The master's state_dict refuses, so the store carries its group options.
            checkpoint_master_options=True,
        )
        bind_master(optimizer, self.store.step, checkpoint_with="StreamedOptimizer.save_to(dir) / load_from(dir)")

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self) -> StepStats:
        """One optimizer step; returns what it moved. Same as the master's ``step()``."""
        return self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def progress(self) -> None:
        """With an overlap window (``config.overlap_bytes``): move the state's transfers
        along between steps without waiting (``StreamingStore.progress``). Call it
        during forward and backward, e.g. from the model's forward pre-hook; a step
        or a save lands what is left. A no-op without a window."""
        self.store.progress()

    def iter_state(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Yield (param, main, exp_avg, exp_avg_sq) as CPU copies, bucket by bucket."""
        for index, main, exp_avg, exp_avg_sq in self.store.iter_state():
            yield self.store.entries[index].param, main, exp_avg, exp_avg_sq

    def save_to(self, directory: str, *, asynchronous: bool = False) -> BackgroundSave | None:
        """Save the optimizer state (mains, moments, step counts, and the param
        groups' options: lr as a scheduler left it, weight decay, ...) under
        ``directory/<config.name>``, replacing any previous save in one step.
        The params and the LR scheduler's own state are the caller's to save,
        as without streaming. ``asynchronous``: return once the state is
        snapshotted and write it while training goes on; ``wait()`` on the
        returned handle says when it is complete (``StreamingStore.save_to``)."""
        return self.store.save_to(directory, asynchronous=asynchronous)

    def load_from(self, directory: str) -> bool:
        """Restore what :meth:`save_to` wrote under ``directory/<config.name>``
        (the same ``directory`` given to ``save_to``); False, with a warning, when
        there is nothing there. Load the model params and the scheduler beside
        it. Refuses, saying why and changing nothing, a state that does not match."""
        return self.store.load_from(directory)

    def close(self) -> None:
        """Delete the scratch files; the optimizer cannot step afterwards."""
        self.store.close()

    def __enter__(self) -> StreamedOptimizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
