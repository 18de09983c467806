"""Sequence-parallel LayerNorm and the RNG region wrapper for sharded dropout.

Between the tensor-parallel blocks (LayerNorms, residual adds, dropouts) Megatron-style
TP alone replicates the activations on every rank. Sequence parallelism instead keeps
each rank's slice of the sequence, [b, s/tp, h]: the same maths on 1/tp of the data.
The LayerNorm parameters stay replicated but each rank only sees its slice of the
sequence, so their gradient is a partial sum: using the parameters through
:func:`copy_to_tp` (identity forward, all-reduce backward) makes autograd produce the
full gradient on every rank, with no separate synchronisation step; or, once
:func:`~mt_tensor_parallel.defer_replicated_grads` has switched them, the partial sums
accumulate locally and the optimizer sums them once per step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from mt_dist.collectives import group_size
from mt_tensor_parallel.mappings import partial_use
from mt_tensor_parallel.rng import TP_RNG, RNGTracker

__all__ = ["SequenceParallelLayerNorm", "SequenceParallelRMSNorm", "RNGRegion"]


class SequenceParallelLayerNorm(nn.Module):
    """LayerNorm over the last dim of a sequence-sharded [b, s/tp, h] input, with
    replicated ``weight`` / ``bias`` whose gradients are summed over the TP group."""

    def __init__(self, normalized_shape: int | tuple[int, ...], group: ProcessGroup | None,
                 eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        self.normalized_shape = tuple(shape)
        self.group, self.eps = group, eps
        kwargs = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, **kwargs)) \
            if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **kwargs)) \
            if elementwise_affine and bias else None

    param_style = "replicate"
    defer_grad_reduce = False
    #: Selective recomputation makes this module's output again in backward instead of
    #: keeping it (mt_pipeline.checkpointing): its backward keeps its input anyway.
    recompute_output = True

    def partial_grad_names(self) -> tuple[str, ...]:
        """Parameters whose gradient on this rank is a partial sum over the group."""
        return _partial(self, ("weight", "bias"))

    @classmethod
    def from_layernorm(cls, norm: nn.LayerNorm, group: ProcessGroup | None
                       ) -> SequenceParallelLayerNorm:
        """Same parameters (copied) as an existing ``nn.LayerNorm``."""
        layer = cls(norm.normalized_shape, group, norm.eps, norm.weight is not None,
                    norm.bias is not None, device=_device_of(norm), dtype=_dtype_of(norm))
        with torch.no_grad():
            for name in ("weight", "bias"):
                src, dst = getattr(norm, name), getattr(layer, name)
                if src is not None and dst is not None and not src.is_meta:
                    dst.copy_(src)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        deferred = self.defer_grad_reduce
        weight = None if self.weight is None else partial_use(self.weight, self.group, deferred)
        bias = None if self.bias is None else partial_use(self.bias, self.group, deferred)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, sequence_parallel=True"


class SequenceParallelRMSNorm(nn.Module):
    """RMSNorm over the last dim of a sequence-sharded [b, s/tp, h] input, with a replicated
    ``weight`` whose gradient is summed over the TP group (as
    :class:`SequenceParallelLayerNorm`)."""

    param_style = "replicate"
    defer_grad_reduce = False
    #: Selective recomputation makes this module's output again in backward instead of
    #: keeping it (mt_pipeline.checkpointing): its backward keeps its input anyway.
    recompute_output = True

    def partial_grad_names(self) -> tuple[str, ...]:
        """Parameters whose gradient on this rank is a partial sum over the group."""
        return _partial(self, ("weight",))

    def __init__(self, norm: nn.RMSNorm, group: ProcessGroup | None) -> None:
        super().__init__()
        self.normalized_shape, self.eps = tuple(norm.normalized_shape), norm.eps
        self.weight, self.group = norm.weight, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else partial_use(self.weight, self.group,
                                                              self.defer_grad_reduce)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, sequence_parallel=True"


def _partial(module: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    if group_size(module.group) == 1:
        return ()
    return tuple(n for n in names if getattr(module, n) is not None)


def _device_of(module: nn.Module) -> torch.device | None:
    return next((p.device for p in module.parameters()), None)


def _dtype_of(module: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in module.parameters()), None)


class RNGRegion(nn.Module):
    """Runs ``module`` inside ``tracker.fork(name)``: randomness in it (dropout) draws from
    the per-TP-rank stream instead of the default generator. For regions whose activations
    are sharded across TP ranks (attention heads; dropouts under sequence parallelism)."""

    def __init__(self, module: nn.Module, tracker: RNGTracker, name: str = TP_RNG) -> None:
        super().__init__()
        self.module = module
        # Not a submodule or buffer: the tracker holds generator states, not parameters.
        object.__setattr__(self, "tracker", tracker)
        self.stream = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.training:  # dropout is off: no need to swap generator states
            return self.module(*args, **kwargs)
        with self.tracker.fork(self.stream):
            return self.module(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"rng={self.stream!r}"
