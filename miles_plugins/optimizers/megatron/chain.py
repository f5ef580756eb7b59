"""Which optimizers of a Megatron optimizer chain stream, and whether each can."""

from __future__ import annotations

from typing import Any

from megatron_hooks import fingerprint
from megatron_hooks.checkpoint import check_patched
from miles_plugins.optimizers.errors import StreamConfigError
from miles_plugins.optimizers.megatron.pins import PINS
from miles_plugins.optimizers.megatron.refusals import refusals_of_optimizer
from miles_plugins.optimizers.step.adam import backend_for


def _is_distributed_optimizer(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer)


def type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def chained_distributed_optimizers(optimizer: Any) -> list[tuple[int, Any]]:
    """(position in the chain, optimizer) for every non-stub ``DistributedOptimizer``.

    Walks ``optimizer.chained_optimizers`` (dense and expert optimizers) or takes
    ``optimizer`` itself. Stub optimizers (frozen sub-models, no params) are
    skipped. Anything else in the chain is refused, naming its type.
    """
    chain = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    found, refused = [], []
    for index, member in enumerate(chain):
        if getattr(member, "is_stub_optimizer", False):
            continue
        if _is_distributed_optimizer(member):
            found.append((index, member))
        else:
            refused.append(f"chain position {index}: {type_name(member)}")
    if refused:
        raise StreamConfigError(
            "optimizer-state streaming binds to Megatron's DistributedOptimizer only (it streams its "
            "fp32 main shards); got " + "; ".join(refused) + ". Build the optimizer with "
            "use_distributed_optimizer=True"
        )
    return found


def check_supported(dist_opt: Any) -> None:
    """Refuse (all reasons at once) a ``DistributedOptimizer`` streaming cannot serve:
    the refusals of ``refusals.REFUSALS`` that can be seen on a built optimizer, and an
    inner optimizer whose exact update no backend reproduces."""
    reasons = refusals_of_optimizer(dist_opt)
    try:
        backend_for(dist_opt.optimizer)
    except StreamConfigError as e:
        reasons.append(str(e))
    if reasons:
        raise StreamConfigError(
            f"cannot stream the state of this {type_name(dist_opt)}:\n  - " + "\n  - ".join(reasons)
        )


def check_upstream() -> None:
    """Refuse to stream on a Megatron this binding was not validated on: the
    checkpoint hooks must be in ``megatron/training/checkpointing.py`` at this
    ABI version, and every pinned upstream function must have a validated
    fingerprint (the tripwire; see ``pins.py``)."""
    check_patched()
    fingerprint.check_live(PINS)
