"""Adam's hyperparameters as checkpoints record them: per parameter group, and from there
per parameter.

A reader gives the settings that apply to one canonical parameter
(:meth:`~mt_formats.canonical.CheckpointReader.optimizer_settings`): the keys of
:data:`SETTINGS` its source records (``lr`` as of the last step, ``betas``, ``eps``,
``weight_decay``, and ``initial_lr``, the base rate a learning-rate scheduler scales). A
writer of a format that keeps param groups writes them with the moments: per parameter
(torch DCP's flattened optimizer state dict) or per group of matrices and group of the rest
(mt pretrain's two groups, megatron-core's ``wd_mult`` 1 and 0 groups: :func:`by_role`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mt_formats.errors import ConvertError
from mt_zero import decays as zero_decays

__all__ = ["SETTINGS", "adam_step", "adamw_group", "by_role", "decays", "settings_of",
           "two_groups"]

#: The hyperparameters carried from one format to another.
SETTINGS = ("lr", "betas", "eps", "weight_decay", "initial_lr")


def decays(shape: Sequence[int]) -> bool:
    """Whether a parameter of ``shape`` is in the weight-decay role (``mt_zero.decays``:
    matrices are, biases and norm weights are not, as in Megatron-LM and
    Megatron-DeepSpeed)."""
    return zero_decays(torch.empty(tuple(shape), device="meta"))


def adam_step(value: Any, where: str) -> float:
    """Adam's step count from a stored ``value`` (a number or a one-element tensor), or a
    :class:`ConvertError` naming ``where``: a count is a whole number >= 0 (a NaN or a
    negative step would reach the bias correction of the next update)."""
    number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not (
            math.isfinite(number) and number >= 0 and number == int(number)):
        what = (f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor)
                and value.numel() != 1 else repr(number))
        raise ConvertError(f"{where}: Adam's step is {what}, not a whole number >= 0")
    return float(number)


def settings_of(group: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The keys of :data:`SETTINGS` that param group ``group`` holds, as floats (``betas``
    a pair of floats); a value that is not a finite number in torch AdamW's range (lr, eps,
    weight decay >= 0; each beta in [0, 1)) is a :class:`ConvertError` naming ``where``."""
    out: dict[str, Any] = {}
    for key in SETTINGS:
        if key not in group:
            continue
        value = group[key]
        try:
            out[key] = (tuple(float(b) for b in value) if key == "betas" else float(value))
        except (TypeError, ValueError):
            raise ConvertError(f"{where}: param group {key} is {value!r}, not a number"
                               ) from None
        if key == "betas" and len(out[key]) != 2:
            raise ConvertError(f"{where}: param group betas is {value!r}, not a pair")
        numbers = out[key] if key == "betas" else (out[key],)
        high = 1.0 if key == "betas" else math.inf
        if not all(math.isfinite(n) and 0 <= n < high for n in numbers):
            span = "in [0, 1)" if key == "betas" else ">= 0"
            raise ConvertError(f"{where}: param group {key} is {value!r}, not a finite "
                               f"number {span}")
    return out


def adamw_group(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The keys of a torch AdamW param group (``params`` aside) at this torch version:
    torch's defaults, overridden by ``settings``."""
    defaults = torch.optim.AdamW([torch.zeros(1)]).param_groups[0]
    return {**{key: value for key, value in defaults.items() if key != "params"},
            **(settings or {})}


def by_role(settings: Mapping[str, Mapping[str, Any] | None],
            shapes: Mapping[str, Sequence[int]], where: str) -> dict[bool, dict[str, Any]]:
    """The settings of the matrices (``True``) and of the other parameters (``False``) from
    per-parameter ``settings`` (None: not recorded); a role none of whose parameters has
    settings is absent. Parameters of one role with different settings are a
    :class:`ConvertError` naming ``where`` and two of them: a format of two groups cannot
    hold them."""
    roles: dict[bool, tuple[str, dict[str, Any]]] = {}
    for name, found in settings.items():
        if found is None:
            continue
        role = decays(shapes[name])
        first = roles.setdefault(role, (name, dict(found)))
        if first[1] != dict(found):
            raise ConvertError(f"{where}: the source's optimizer settings of {first[0]!r} "
                               f"({first[1]}) and {name!r} ({dict(found)}) differ; the "
                               "target keeps one group of matrices and one of the other "
                               "parameters (give --drop-optimizer to convert the weights "
                               "alone)")
    return {role: found for role, (_, found) in roles.items()}


def two_groups(groups: Sequence[Mapping[str, Any]], where: str
               ) -> dict[bool, dict[str, Any]] | None:
    """The settings per role (as :func:`by_role`) of a checkpoint that records its param
    groups but not which parameters are in which: one group holds them all; of two
    groups, the one without weight decay holds the biases and norms and the other the
    matrices (how mt, Megatron-LM and Megatron-DeepSpeed group them). None for any other
    grouping."""
    found = [settings_of(group, where) for group in groups]
    if len(found) == 1:
        return {True: found[0], False: found[0]}
    if len(found) == 2:
        zero = [group.get("weight_decay") == 0.0 for group in found]
        if zero.count(True) == 1:
            return {True: found[zero.index(False)], False: found[zero.index(True)]}
    return None
