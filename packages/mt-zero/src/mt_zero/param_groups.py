"""AdamW parameter groups: weight decay for matrices, none for biases and norm weights."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["decay_param_groups", "decays", "split_decay"]


def decays(param: torch.Tensor) -> bool:
    """Whether a parameter gets weight decay (as in GPT-2 / Megatron / MT-NLG training):
    matrices (linear weights, embeddings) do; biases and LayerNorm weights do not."""
    return param.dim() >= 2


def split_decay(
    named_params: Iterable[tuple[str, nn.Parameter]],
) -> tuple[list[str], list[str]]:
    """Names of parameters that get weight decay and of those that do not.

    The rule is :func:`decays`. Parameters that do not require gradients are left out.
    """
    decay, no_decay = [], []
    for name, param in named_params:
        if not param.requires_grad:
            continue
        (decay if decays(param) else no_decay).append(name)
    return decay, no_decay


def decay_param_groups(
    named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float
) -> list[dict[str, Any]]:
    """Two optimizer parameter groups: ``weight_decay`` for matrices, 0.0 for the rest.

    Groups are always both present (possibly empty) so that their indices are stable, which
    checkpoints rely on.
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    params = dict(named_params)
    decay, no_decay = split_decay(params.items())
    return [
        {"params": [params[n] for n in decay], "weight_decay": weight_decay},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]
