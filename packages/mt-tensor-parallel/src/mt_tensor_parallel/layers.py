"""Column- and row-parallel Linear layers (Megatron tensor slicing of a matmul).

Column-parallel: Y = X A with A split by output columns, so each rank computes a slice of
Y's last dim. Row-parallel: A split by input rows; each rank multiplies its slice of X's
last dim and the partial products are summed across ranks. A column layer followed by a
row layer (attention qkv -> proj, MLP fc -> proj) needs one all-reduce forward and one
backward. With sequence parallelism the all-reduce becomes an all-gather of the sequence
in front of the column layer and a reduce-scatter of the sequence after the row layer.

A column layer's backward launches its input gradient's collective (the all-reduce, or the
reduce-scatter under sequence parallelism) as soon as that gradient exists and computes the
weight's gradient while it runs; under sequence parallelism it keeps only its sequence slice
of the input and gathers it again in backward under the input gradient's GEMM
(:class:`_ColumnLinear`), as Megatron-LM does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from mt_dist.collectives import (
    all_gather_along,
    group_rank,
    group_size,
    start_all_gather_along,
    start_reduce_scatter_along,
)
from mt_tensor_parallel.mappings import (
    SEQUENCE_DIM,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    partial_use,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)
from mt_tensor_parallel.sharding import shard_tensor

__all__ = ["ColumnParallelLinear", "ReplicatedKVLinear", "RowParallelLinear"]


def _empty_param(shape: tuple[int, ...], device: torch.device | str | None,
                 dtype: torch.dtype | None) -> nn.Parameter:
    data = torch.empty(shape, device=device, dtype=dtype)
    if not data.is_meta:
        data.zero_()  # deterministic until real weights are loaded
    return nn.Parameter(data)


class _ColumnLinear(torch.autograd.Function):
    """``F.linear`` of a column-parallel layer with its input's TP communication.

    Forward: the sequence all-gather (``sequence_parallel``) or nothing. Backward: the input
    gradient's reduce-scatter or all-reduce, launched once that gradient is computed and
    waited for once the weight's and bias's are, so the collective runs under the weight
    gradient's GEMM. Under sequence parallelism only this rank's slice of the input is kept
    (Korthikanti et al.'s activation memory): backward gathers it again, while the input
    gradient's GEMM runs. The gradients are autograd's for ``F.linear`` bit for bit (the
    same ``mm`` calls on the flattened tensors, the bias's a sum over rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        full = all_gather_along(x, SEQUENCE_DIM, group) if sequence_parallel else x
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gathering, full = None, (lambda: x)
        if need_w and ctx.sequence_parallel:
            gathering, full = start_all_gather_along(x, SEQUENCE_DIM, ctx.group)
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = rows.mm(weight).view(*grad.shape[:-1], weight.shape[1]) if need_x else None
        if gathering is not None:
            gathering.wait()
        work = None
        if need_x and ctx.sequence_parallel:
            work, grad_x = start_reduce_scatter_along(grad_x, SEQUENCE_DIM, ctx.group)
        elif need_x:
            # A fresh tensor: summed in place. (A raw work, as the reduce-scatter's: a
            # collective inside the model counts as a rank's work, mt_dist.stragglers.)
            work = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
        if need_w:
            inputs = full()
            grad_w = rows.t().mm(inputs.reshape(-1, inputs.shape[-1]))
        else:
            grad_w = None
        grad_b = rows.sum(0) if need_b else None
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None, None


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` whose output features are split over the
    TP group: this rank holds ``out_features / tp`` rows of the weight (and bias).

    ``fused_chunks=3`` is for a fused [q; k; v] projection: each of the 3 blocks is split
    separately so the local output is [q_local; k_local; v_local]. Input: replicated
    [b, s, in] (or [b, s/tp, in] with ``sequence_parallel``, gathered here). Output:
    [b, s, out/tp], or the full [b, s, out] with ``gather_output``.

    Parameters start at zero; fill them with :meth:`load_full_` or build the layer with
    :meth:`from_linear`.
    """

    def __init__(self, in_features: int, out_features: int, group: ProcessGroup | None,
                 bias: bool = True, *, fused_chunks: int = 1, sequence_parallel: bool = False,
                 gather_output: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group = group
        self.tp_size, self.tp_rank = group_size(group), group_rank(group)
        unit = fused_chunks * self.tp_size
        if out_features % unit != 0:
            raise ValueError(
                f"out_features {out_features} is not divisible by fused_chunks {fused_chunks}"
                f" x tp {self.tp_size} = {unit}"
            )
        if gather_output and (sequence_parallel or fused_chunks != 1):
            raise ValueError("gather_output needs fused_chunks=1 and no sequence_parallel")
        self.in_features, self.out_features = in_features, out_features
        self.fused_chunks = fused_chunks
        self.sequence_parallel = sequence_parallel
        self.gather_output = gather_output
        local = out_features // self.tp_size
        self.weight = _empty_param((local, in_features), device, dtype)
        self.bias = _empty_param((local,), device, dtype) if bias else None

    @property
    def param_style(self) -> str:
        """Shard style of weight and bias (see :mod:`mt_tensor_parallel.sharding`)."""
        return {1: "column", 2: "column_pair"}.get(self.fused_chunks, "column_qkv")

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of the unsliced ``weight`` [out, in] (and ``bias``)."""
        args = (self.tp_rank, self.tp_size)
        self.weight.copy_(shard_tensor(self.param_style, weight, *args, chunks=self.fused_chunks))
        if self.bias is not None and bias is not None:
            self.bias.copy_(shard_tensor(self.param_style, bias, *args, chunks=self.fused_chunks))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: ProcessGroup | None, *, fused_chunks: int = 1,
                    sequence_parallel: bool = False, gather_output: bool = False
                    ) -> ColumnParallelLinear:
        """The slice of an existing ``nn.Linear`` (same device and dtype; meta stays meta)."""
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None,
                    fused_chunks=fused_chunks, sequence_parallel=sequence_parallel,
                    gather_output=gather_output, device=linear.weight.device,
                    dtype=linear.weight.dtype)
        if not linear.weight.is_meta:
            layer.load_full_(linear.weight, linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            y = F.linear(x, self.weight, self.bias)
        else:
            # Under sequence parallelism the backward's reduce-scatter both sums the partial
            # input gradients and keeps this rank's sequence slice.
            y = _ColumnLinear.apply(x, self.weight, self.bias, self.group,
                                    self.sequence_parallel)
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight.shape[0]}), tp={self.tp_size}, rank={self.tp_rank}, "
            f"fused_chunks={self.fused_chunks}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` whose input features are split over the TP
    group: this rank holds ``in_features / tp`` columns of the weight; the bias is
    replicated and added once, after the cross-rank sum.

    Input: [b, s, in/tp] (``input_is_parallel``, the output of a column layer) or the full
    [b, s, in] (sliced here). Output: replicated [b, s, out], or this rank's sequence slice
    [b, s/tp, out] with ``sequence_parallel`` (reduce-scatter instead of all-reduce).
    """

    def __init__(self, in_features: int, out_features: int, group: ProcessGroup | None,
                 bias: bool = True, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group = group
        self.tp_size, self.tp_rank = group_size(group), group_rank(group)
        if in_features % self.tp_size != 0:
            raise ValueError(f"in_features {in_features} is not divisible by tp {self.tp_size}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = _empty_param((out_features, in_features // self.tp_size), device, dtype)
        self.bias = _empty_param((out_features,), device, dtype) if bias else None

    param_style = "row"
    defer_grad_reduce = False

    def partial_grad_names(self) -> tuple[str, ...]:
        """Parameters whose gradient on this rank is a partial sum over the group: the bias
        under sequence parallelism (it meets this rank's sequence slice only)."""
        partial = self.sequence_parallel and self.tp_size > 1 and self.bias is not None
        return ("bias",) if partial else ()

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of the unsliced ``weight`` [out, in] (and the full bias)."""
        self.weight.copy_(shard_tensor("row", weight, self.tp_rank, self.tp_size))
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: ProcessGroup | None, *,
                    input_is_parallel: bool = True, sequence_parallel: bool = False
                    ) -> RowParallelLinear:
        """The slice of an existing ``nn.Linear`` (same device and dtype; meta stays meta)."""
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None,
                    input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
                    device=linear.weight.device, dtype=linear.weight.dtype)
        if not linear.weight.is_meta:
            layer.load_full_(linear.weight, linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # nothing to reduce: the fused bias matches nn.Linear bit for bit
            return F.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.group)
            # The bias now meets only this rank's sequence slice: its gradient is a partial
            # sum, summed over the ranks per backward (copy_to_tp) or deferred to the step.
            bias = None if self.bias is None else partial_use(self.bias, self.group,
                                                              self.defer_grad_reduce)
        else:
            y = reduce_from_tp(y, self.group)
            bias = self.bias
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), "
            f"out_features={self.out_features}, tp={self.tp_size}, rank={self.tp_rank}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class ReplicatedKVLinear(nn.Module):
    """A grouped-query ``[k; v]`` projection when the TP degree exceeds the key/value heads
    (``tp % kv_heads == 0``): every rank holds the full, replicated weight and computes only
    the key/value head its query heads use (rank r: head ``r * kv_heads // tp``), so its
    output is [b, s, 2 * head_dim]. The weight (and bias) are used through
    :func:`copy_to_tp`: each rank's gradient covers its own query heads and the backward
    all-reduce sums them, so every rank holds the full gradient and the copies stay equal;
    the input's gradient is summed over ranks the same way (or reduce-scattered with
    sequence parallelism). Deferred (:func:`~mt_tensor_parallel.defer_replicated_grads`),
    the weight's partial gradients are summed once per step instead."""

    param_style = "replicate"
    defer_grad_reduce = False

    def partial_grad_names(self) -> tuple[str, ...]:
        """Parameters whose gradient on this rank is a partial sum over the group (this
        rank's key/value head's rows only)."""
        if group_size(self.group) == 1:
            return ()
        return ("weight",) if self.bias is None else ("weight", "bias")

    def __init__(self, linear: nn.Linear, group: ProcessGroup | None, kv_heads: int,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        tp, rank = group_size(group), group_rank(group)
        if tp % kv_heads:
            raise ValueError(f"replicated key/value heads need tp {tp} to be a multiple of "
                             f"the {kv_heads} key/value heads")
        self.weight, self.bias = linear.weight, linear.bias
        head_dim = linear.out_features // (2 * kv_heads)
        head = rank * kv_heads // tp
        rows = torch.arange(head * head_dim, (head + 1) * head_dim)
        self.rows = torch.cat([rows, rows + kv_heads * head_dim]).tolist()  # k_j, then v_j
        self.kv_heads, self.head = kv_heads, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sequence(x, self.group) if self.sequence_parallel \
            else copy_to_tp(x, self.group)
        deferred = self.defer_grad_reduce
        weight = partial_use(self.weight, self.group, deferred)[self.rows]
        bias = None if self.bias is None else partial_use(self.bias, self.group,
                                                          deferred)[self.rows]
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"kv_heads={self.kv_heads}, head={self.head}, replicated"
