"""Communication as autograd functions, named after the maths of tensor slicing.

Megatron's paper calls the two basic operators ``f`` (identity forward, all-reduce backward)
and ``g`` (all-reduce forward, identity backward); here they are :func:`copy_to_tp` and
:func:`reduce_from_tp`. Each function takes the tensor-parallel ``group`` explicitly
(``None`` = a single rank: every function is then the identity).

Sequence-parallel functions work on dimension 1 (activations are batch-first [b, s, h]):

================================  ==========================  ==========================
function                          forward                     backward
================================  ==========================  ==========================
``copy_to_tp``                    identity                    all-reduce
``reduce_from_tp``                all-reduce                  identity
``scatter_to_tp``                 split last dim              all-gather last dim
``gather_from_tp``                all-gather last dim         split last dim
``scatter_to_sequence``           split dim 1                 all-gather dim 1
``gather_from_sequence``          all-gather dim 1            reduce-scatter dim 1 (or split)
``reduce_scatter_to_sequence``    reduce-scatter dim 1        all-gather dim 1
================================  ==========================  ==========================
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from mt_dist.collectives import (
    all_gather_along,
    all_reduce,
    reduce_scatter_along,
    split_along,
)

__all__ = [
    "copy_to_tp",
    "partial_use",
    "reduce_from_tp",
    "scatter_to_tp",
    "gather_from_tp",
    "scatter_to_sequence",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
]

SEQUENCE_DIM = 1


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        out = all_reduce(x, group)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Split(torch.autograd.Function):
    """Split forward, all-gather backward, along ``dim``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup | None
                ) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        out = split_along(x, dim, group)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    """All-gather forward; backward either splits (the consumer is replicated) or
    reduce-scatters (the consumer is a sharded op whose gradients are partial sums)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup | None,
                reduce_grads: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.reduce_grads = dim, group, reduce_grads
        out = all_gather_along(x, dim, group)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce_grads:
            return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None, None
        return split_along(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter forward, all-gather backward, along ``dim``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup | None
                ) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        out = reduce_scatter_along(x, dim, group)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``f``: identity forward, all-reduce of the gradient backward.

    Put it where a replicated tensor enters a sharded computation (the input of a
    column-parallel layer, or a replicated parameter used on sharded data).
    """
    return _CopyToTP.apply(x, group)


def partial_use(param: torch.Tensor, group: ProcessGroup | None, deferred: bool
                ) -> torch.Tensor:
    """A replicated parameter used on this rank's share of the work, whose gradient here is
    therefore a partial sum: through :func:`copy_to_tp` (summed over ``group`` in every
    backward), or as it is when ``deferred`` (the gradients accumulate locally and whoever
    steps sums them once per step: :func:`~mt_tensor_parallel.defer_replicated_grads`)."""
    return param if deferred else copy_to_tp(param, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``g``: all-reduce forward, identity backward (partial sums -> replicated result)."""
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; backward all-gathers it."""
    return _Split.apply(x, -1, group)


def gather_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-gather the last dimension; backward keeps this rank's slice."""
    return _Gather.apply(x, -1, group, False)


def scatter_to_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """[b, s, ...] -> this rank's [b, s/tp, ...]; backward all-gathers the sequence."""
    return _Split.apply(x, SEQUENCE_DIM, group)


def gather_from_sequence(x: torch.Tensor, group: ProcessGroup | None,
                         reduce_grads: bool = True) -> torch.Tensor:
    """[b, s/tp, ...] -> [b, s, ...] by all-gather.

    With ``reduce_grads`` (the default, used in front of column-parallel layers whose input
    gradients are partial sums over ranks) the backward is a reduce-scatter, which both sums
    the partial gradients and keeps this rank's sequence slice. With ``reduce_grads=False``
    the backward only splits (for a replicated consumer).
    """
    return _Gather.apply(x, SEQUENCE_DIM, group, reduce_grads)


def reduce_scatter_to_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Partial sums [b, s, ...] -> summed [b, s/tp, ...]; backward all-gathers."""
    return _ReduceScatter.apply(x, SEQUENCE_DIM, group)
