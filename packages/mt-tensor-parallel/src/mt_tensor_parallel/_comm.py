"""Raw (non-autograd) collectives over a tensor-parallel group, along any tensor dimension.

``group=None`` means "no tensor parallelism" (a group of one rank), so every layer also runs
in a plain single process without ``torch.distributed`` being initialised. Collectives that
torch offers both as ``*_single`` (newer name) and ``*_tensor`` / ``*_into_tensor`` (older)
are looked up once per call by name so the package runs on either torch generation; when a
backend lacks both, the list-based collective is used instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "group_rank",
    "group_size",
    "all_reduce",
    "all_gather_along",
    "reduce_scatter_along",
    "split_along",
]


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (1 when ``group`` is None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside ``group`` (0 when ``group`` is None)."""
    return 0 if group is None else dist.get_rank(group)


def _collective(*names: str):  # noqa: ANN202 - returns a torch.distributed function
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    return None


def all_reduce(x: torch.Tensor, group: ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM
               ) -> torch.Tensor:
    """Sum (or ``op``) of ``x`` over the group, returned as a new tensor (``x`` untouched).

    The copy matters: autograd may hand the same gradient tensor to several consumers (a
    residual branch and the layer), so reducing it in place would corrupt the others.
    """
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, op=op, group=group)
    return out


def all_gather_along(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (same shape on every rank)."""
    size = group_size(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    # The flat collective concatenates along dim 0: gather [size, *shape], then move the
    # rank axis next to ``dim`` and merge the two.
    # Flat 1-D buffers: the one layout every backend accepts (gloo rejects the stacked form).
    flat = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    gather = _collective("all_gather_single", "all_gather_into_tensor")
    if gather is not None:
        gather(flat, x.contiguous().view(-1), group=group)
    else:
        dist.all_gather(list(flat.chunk(size)), x.contiguous().view(-1), group=group)
    stacked = flat.view(size, *x.shape)
    if dim == 0:
        return stacked.reshape(size * x.shape[0], *x.shape[1:])
    merged = stacked.movedim(0, dim)  # [..., size, x.shape[dim], ...]
    shape = list(x.shape)
    shape[dim] *= size
    return merged.reshape(shape)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Sum over ranks, keeping this rank's contiguous slice of ``dim``."""
    size = group_size(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % size != 0:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by {size}")
    piece = x.shape[dim] // size
    # [..., size * piece, ...] -> [size, ..., piece, ...]: rank i's slice is block i.
    split_shape = [*x.shape[:dim], size, piece, *x.shape[dim + 1:]]
    blocks = x.reshape(split_shape).movedim(dim, 0).contiguous()
    out_shape = list(x.shape)
    out_shape[dim] = piece
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    scatter = _collective("reduce_scatter_single", "reduce_scatter_tensor")
    if scatter is not None:
        scatter(out.view(-1), blocks.view(-1), group=group)
    else:
        dist.reduce_scatter(out.view(-1), list(blocks.view(-1).chunk(size)), group=group)
    return out


def split_along(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous slice of ``dim`` (no communication)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size != 0:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by {size}")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()
