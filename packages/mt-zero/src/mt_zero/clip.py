"""Global gradient norm over a TP x PP x DP grid, counting every parameter once.

Each rank sums the squares of the gradients it *counts*, the sums are all-reduced over the
given orthogonal groups, and the square root is the norm of the whole model's gradient.
A rank does not count a parameter whose identical copy is counted elsewhere:

- replicated across tensor parallelism (LayerNorm weights, row-parallel biases): only
  tensor-parallel rank 0 counts it;
- a tied duplicate across pipeline stages (the output embedding on the last stage, a copy
  of the input embedding on the first): only the designated owner counts it;
- under ZeRO the data-parallel shards are disjoint, so every rank counts its own shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from mt_dist.collectives import all_reduce_over

__all__ = [
    "clip_coefficient",
    "clip_grad_norm_",
    "counts_once",
    "global_norm",
    "sum_of_squares",
]

NamePredicate = Callable[[str, nn.Parameter], bool]


def counts_once(
    tp_rank: int,
    tp_replicated: NamePredicate | None = None,
    pp_duplicate: NamePredicate | None = None,
) -> NamePredicate:
    """A predicate ``(name, param) -> bool``: does this rank count the parameter in norms?

    Args:
        tp_rank: this rank's index in its tensor-parallel group.
        tp_replicated: true for parameters every tensor-parallel rank holds in full.
        pp_duplicate: true for parameters that are a tied copy of one counted on another
            pipeline stage.
    """

    def counted(name: str, param: nn.Parameter) -> bool:
        if pp_duplicate is not None and pp_duplicate(name, param):
            return False
        return not (tp_rank != 0 and tp_replicated is not None and tp_replicated(name, param))

    return counted


def global_norm(
    tensors: Iterable[torch.Tensor],
    groups: Sequence[ProcessGroup | None] = (),
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """L2 norm (fp32 scalar) of all ``tensors`` on all ranks of the orthogonal ``groups``.

    Collective over every group. ``tensors`` are the ones this rank counts (possibly none);
    ``device`` is where the sum lives when there are none (the collective's device).
    """
    return all_reduce_over(sum_of_squares(tensors, device), groups).sqrt()


def sum_of_squares(
    tensors: Iterable[torch.Tensor], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Sum of squared elements of ``tensors`` as an fp32 scalar (0 for none)."""
    # vector_norm accumulates in fp32 without a full-size squared temporary.
    sums = [torch.linalg.vector_norm(t.detach(), dtype=torch.float32).square() for t in tensors]
    if not sums:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(sums).sum()


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Factor to multiply gradients by so their norm is at most ``max_norm`` (<= 1)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def clip_grad_norm_(
    named_params: Iterable[tuple[str, nn.Parameter]],
    max_norm: float,
    groups: Sequence[ProcessGroup | None] = (),
    counted: NamePredicate | None = None,
) -> torch.Tensor:
    """Clip ``.grad`` of ``named_params`` in place to a global norm; return the norm.

    For models whose gradients live in ``.grad`` (no ZeRO, or ZeRO stage 0-1 after
    reduction, with ``groups`` excluding the data-parallel group there since every DP rank
    holds the same full gradient). The ZeRO optimizer clips its shards itself.
    """
    named = [(n, p) for n, p in named_params if p.grad is not None]
    device = named[0][1].device if named else "cpu"
    grads = [p.grad for n, p in named if counted is None or counted(n, p)]
    norm = global_norm(grads, groups, device)  # type: ignore[arg-type]
    coef = clip_coefficient(float(norm), max_norm)
    if coef < 1.0:
        for _, p in named:
            p.grad.mul_(coef)  # type: ignore[union-attr]
    return norm
