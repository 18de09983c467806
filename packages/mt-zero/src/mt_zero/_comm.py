"""Thin wrappers over torch.distributed collectives used by mt-zero.

A ``None`` group means "no data parallelism": size 1, rank 0, every collective a local copy.
That lets the same code run in a plain single process (reference runs, unit tests).

On gloo the flat all-gather and reduce-scatter are built from an all-reduce, which gloo
does several times faster (measured on 2 CPU ranks, 44.8M fp32 elements: all-reduce
0.18 s, all-gather 0.55 s, reduce-scatter 0.9 s). The results are exact: an all-gather sums
each rank's shard with zeros, and a reduce-scatter keeps its slice of the full sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "Handle",
    "all_gather_flat",
    "all_reduce_over",
    "all_reduce_sum",
    "broadcast_from_first",
    "group_rank",
    "group_size",
    "reduce_scatter_flat",
]

# torch 2.13 renamed the flat collectives; older releases only have the *_tensor names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """An async collective (or nothing, when the work was local) to wait on once.

    ``then`` runs once, right after the collective finished (e.g. copying a result out).
    """

    def __init__(
        self, work: dist.Work | None = None, then: Callable[[], object] | None = None
    ) -> None:
        self._work = work
        self._then = then

    def wait(self) -> None:
        """Block until the collective finished (idempotent)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's index in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def _via_all_reduce(group: ProcessGroup) -> bool:
    """Emulate all-gather / reduce-scatter with an all-reduce (see the module docstring)."""
    return dist.get_backend(group) == dist.Backend.GLOO


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None) -> Handle:
    """Start gathering every rank's ``shard`` into ``out`` (rank order, equal sizes).

    ``shard`` may be this rank's own slice of ``out``.
    """
    if group_size(group) == 1:
        out.copy_(shard)
        return Handle()
    assert group is not None
    if _via_all_reduce(group):
        lo = group_rank(group) * shard.numel()
        hi = lo + shard.numel()
        out[:lo].zero_()
        out[hi:].zero_()
        if out[lo:hi].data_ptr() != shard.data_ptr():
            out[lo:hi].copy_(shard)
        return Handle(dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group, async_op=True))
    return Handle(_ALL_GATHER(out, shard, group=group, async_op=True))


def reduce_scatter_flat(
    out: torch.Tensor, full: torch.Tensor, group: ProcessGroup | None
) -> Handle:
    """Start summing ``full`` over ranks and leaving this rank's slice of the sum in ``out``.

    ``full`` is scratch: on gloo it is overwritten by the full sum.
    """
    if group_size(group) == 1:
        out.copy_(full)
        return Handle()
    assert group is not None
    if _via_all_reduce(group):
        lo = group_rank(group) * out.numel()
        work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return Handle(work, then=lambda: out.copy_(full[lo : lo + out.numel()]))
    return Handle(_REDUCE_SCATTER(out, full, op=dist.ReduceOp.SUM, group=group, async_op=True))


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup | None) -> Handle:
    """Start an in-place sum of ``tensor`` over ``group``."""
    if group_size(group) == 1:
        return Handle()
    return Handle(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True))


def all_reduce_over(tensor: torch.Tensor, groups: Sequence[ProcessGroup | None]) -> torch.Tensor:
    """Sum ``tensor`` in place over each group in turn (blocking) and return it.

    For orthogonal groups of a grid (e.g. tensor, pipeline and data parallel groups of one
    topology) this yields the sum over the whole grid.
    """
    for group in groups:
        all_reduce_sum(tensor, group).wait()
    return tensor


def broadcast_from_first(tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """Overwrite ``tensor`` with group rank 0's copy (blocking)."""
    if group_size(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
