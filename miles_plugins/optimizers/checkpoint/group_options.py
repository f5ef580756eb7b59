"""The master optimizer's param-group options in a checkpoint (lr as a scheduler left
it, weight decay, betas, ...): saved as JSON, checked, and restored in the live
values' own forms. Only options with a JSON form travel; the others are neither
saved nor restored.
"""

from __future__ import annotations

import torch

_JSON_SCALARS = (bool, int, float, str, type(None))
_NO_JSON = object()  # an option without a JSON form: neither saved nor restored


def _option_to_json(value):
    """An option as JSON (tensor scalars, e.g. a capturable lr, as numbers), or _NO_JSON."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else _NO_JSON
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        items = [_option_to_json(v) for v in value]
        return _NO_JSON if any(item is _NO_JSON or isinstance(item, list) for item in items) else items
    return _NO_JSON


def options_to_json(groups: list[dict]) -> list[dict]:
    """Each group's options that have a JSON form (never its params)."""
    return [
        {k: j for k, v in group.items() if k != "params" and (j := _option_to_json(v)) is not _NO_JSON}
        for group in groups
    ]


def check_options(saved: object, groups: list[dict]) -> list[str]:
    """What keeps ``saved`` (:func:`options_to_json`'s output) from restoring into
    ``groups``; empty when it fits."""
    if not isinstance(saved, list) or len(saved) != len(groups) or not all(isinstance(g, dict) for g in saved):
        return [f"the saved param-group options do not describe {len(groups)} groups"]
    bad = sorted({k for g in saved for k, v in g.items() if k == "params" or _option_to_json(v) is _NO_JSON})
    return [f"unreadable param-group options: {bad}"] if bad else []


def restore_options(saved: list[dict], groups: list[dict]) -> None:
    """Set each group's options to the saved ones, in the live values' own forms
    (a tuple stays a tuple; a tensor is filled in place)."""
    for group, options in zip(groups, saved, strict=True):
        for key, value in options.items():
            live = group.get(key)
            if isinstance(live, torch.Tensor):
                live.fill_(value)
            elif isinstance(live, tuple) and isinstance(value, list):
                group[key] = tuple(
                    old.new_tensor(v) if isinstance(old, torch.Tensor) else v
                    for old, v in zip(live, value, strict=False)
                )
            else:
                group[key] = value
