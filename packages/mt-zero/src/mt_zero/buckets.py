"""One flat buffer of parameters: its compute copy, fp32 master shard and gradient storage.

A :class:`FlatBucket` takes a list of parameters and moves their data into one flat buffer
in the compute dtype; each parameter's ``.data`` becomes a view into it. What else it keeps
depends on the ZeRO stage (N = data-parallel size, "shard" = this rank's 1/N of the buffer
as laid out by :func:`mt_zero.partition.partition`):

=====  ====================  ==========================  ===================================
stage  compute parameters    gradients at rest           fp32 master weights
=====  ====================  ==========================  ===================================
0      full                  full flat (``p.grad`` views)  full (not sharded)
1      full                  full flat (``p.grad`` views)  shard
2      full                  shard (reduce-scattered)    shard
3      shard; full only      shard (reduce-scattered)    shard
       while gathered
=====  ====================  ==========================  ===================================

In fp32 the master shard aliases the compute parameters (no second copy).
Gradient reduction averages over the group: gradients are divided by N, then summed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from mt_zero._comm import (
    Handle,
    all_gather_flat,
    all_reduce_sum,
    broadcast_from_first,
    group_size,
    reduce_scatter_flat,
)
from mt_zero.partition import ShardLayout

__all__ = ["FlatBucket"]


class FlatBucket:
    """The flat storage of one bucket (stages 0-2) or one module unit (stage 3).

    Args:
        index: position of the bucket in launch order.
        names: parameter names (for checkpoints and reports).
        params: the parameters; their ``.data`` is redirected into the flat buffer.
        layout: the partition of this buffer over the data-parallel group (world size 1
            for stage 0, whose optimizer is not sharded).
        rank: this rank's index in ``layout``.
        stage: ZeRO stage 0-3.
        dtype: compute dtype of the parameters.
        group: data-parallel group (``None``: single process). The initial values are
            broadcast from its first rank so that all replicas start identical.
    """

    def __init__(
        self,
        index: int,
        names: Sequence[str],
        params: Sequence[nn.Parameter],
        layout: ShardLayout,
        rank: int,
        stage: int,
        dtype: torch.dtype,
        group: ProcessGroup | None,
    ) -> None:
        self.index = index
        self.names = tuple(names)
        self.params = tuple(params)
        self.layout = layout
        self.rank = rank
        self.stage = stage
        self.dtype = dtype
        self.group = group
        self.start, self.end = layout.shard_range(rank)
        self._gather: Handle | None = None
        self._reduce: Handle | None = None
        self._recv: torch.Tensor | None = None
        device = self.device = params[0].device
        # The original values in fp32 seed the master weights at full precision.
        flat32 = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
        for p, s, n in zip(params, layout.param_starts, layout.numels):
            flat32[s : s + n].copy_(p.detach().reshape(-1))
        broadcast_from_first(flat32, group)
        self.flat_param = flat32 if dtype == torch.float32 else flat32.to(dtype)
        for p, s, n in zip(params, layout.param_starts, layout.numels):
            p.data = self.flat_param[s : s + n].view(p.shape)
        self.shard_param: torch.Tensor | None = None
        if stage == 3:
            self.shard_param = self.flat_param[self.start : self.end].clone()
            self.master = self.shard_param if dtype == torch.float32 else (
                flat32[self.start : self.end].clone())
            self._full_bytes = self.flat_param.untyped_storage().nbytes()
            self.free()
        elif dtype == torch.float32:
            self.master = self.flat_param[self.start : self.end]
        else:
            self.master = flat32[self.start : self.end].clone()
        del flat32
        self.flat_grad: torch.Tensor | None = None
        self.shard_grad: torch.Tensor | None = None
        if stage < 2:
            self.flat_grad = torch.zeros_like(self.flat_param)
            self._attach_grad_views()
        else:
            self.shard_grad = torch.zeros(layout.shard_numel, dtype=dtype, device=device)

    # ---------------------------------------------------------------- parameters (stage 3)
    @property
    def gathered(self) -> bool:
        """True while the full compute parameters are materialized (always below stage 3)."""
        return self.flat_param.untyped_storage().nbytes() > 0

    def start_gather(self) -> None:
        """Stage 3: allocate the full buffer and start all-gathering the shards into it."""
        if self.stage != 3 or self.gathered:
            return
        assert self.shard_param is not None
        self.flat_param.untyped_storage().resize_(self._full_bytes)
        self._gather = all_gather_flat(self.flat_param, self.shard_param, self.group)

    def wait_gather(self) -> None:
        """Make sure the full parameters are present (gathering them if needed)."""
        self.start_gather()
        if self._gather is not None:
            self._gather.wait()
            self._gather = None

    def free(self) -> None:
        """Stage 3: release the full parameter buffer (the shard stays)."""
        if self.stage != 3 or not self.gathered:
            return
        if self._gather is not None:  # never free memory a collective is still writing into
            self._gather.wait()
            self._gather = None
        # Resizing the storage keeps every view (and tensors saved for backward) pointing at
        # the same storage object, so a later gather refills them in place.
        self.flat_param.untyped_storage().resize_(0)

    def publish(self) -> Handle:
        """After an optimizer step: copy the master shard into the compute parameters.

        Stages 1-2 all-gather the updated shards (returns the handle to wait on);
        stage 3 only refreshes its compute shard; stage 0 copies locally.
        """
        if self.stage == 3:
            assert self.shard_param is not None
            if self.shard_param is not self.master:
                self.shard_param.copy_(self.master)
            return Handle()
        if self.stage == 0:
            if self.master.data_ptr() != self.flat_param.data_ptr():
                self.flat_param.copy_(self.master)
            return Handle()
        if group_size(self.group) == 1:
            # One rank: cast the master straight into the parameters, no gather buffer.
            if self.master.data_ptr() != self.flat_param.data_ptr():
                self.flat_param.copy_(self.master)
            return Handle()
        # A separate send buffer: the master may alias the receive buffer (fp32).
        send = self.master.to(self.dtype, copy=True)
        return all_gather_flat(self.flat_param, send, self.group)

    # --------------------------------------------------------------------------- gradients
    def _attach_grad_views(self) -> None:
        assert self.flat_grad is not None
        for p, s, n in zip(self.params, self.layout.param_starts, self.layout.numels):
            view = self.flat_grad[s : s + n].view(p.shape)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                # Someone replaced .grad (e.g. zero_grad(set_to_none=True) on the model and a
                # fresh autograd accumulation): fold it back into the flat buffer.
                view.copy_(p.grad)
            p.grad = view

    def start_reduce(self) -> None:
        """Start averaging this bucket's gradients over the data-parallel group.

        Stages 0-1 all-reduce the flat gradient in place; stages 2-3 copy the gradients into
        a temporary flat buffer, drop the full ``p.grad`` and reduce-scatter into the shard.
        """
        world = group_size(self.group)
        if self.stage < 2:
            self._attach_grad_views()
            assert self.flat_grad is not None
            if world > 1:
                self.flat_grad.div_(world)
            self._reduce = all_reduce_sum(self.flat_grad, self.group)
            return
        send = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        for p, s, n in zip(self.params, self.layout.param_starts, self.layout.numels):
            if p.grad is not None:
                send[s : s + n].copy_(p.grad.reshape(-1))
                p.grad = None
        if world > 1:
            send.div_(world)
        self._recv = torch.empty(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        self._reduce = reduce_scatter_flat(self._recv, send, self.group)

    def finish_reduce(self) -> None:
        """Wait for the reduction; stages 2-3 add the result to the gradient shard."""
        if self._reduce is None:
            return
        self._reduce.wait()
        self._reduce = None
        if self._recv is not None:
            assert self.shard_grad is not None
            self.shard_grad.add_(self._recv)
            self._recv = None

    def owned_grad(self) -> torch.Tensor:
        """The reduced gradient of this rank's shard (compute dtype, ``shard_numel``)."""
        if self.flat_grad is not None:
            return self.flat_grad[self.start : self.end]
        assert self.shard_grad is not None
        return self.shard_grad

    def zero_grad(self) -> None:
        """Zero the gradient storage (stages 0-1 keep ``p.grad`` as views)."""
        if self.flat_grad is not None:
            self.flat_grad.zero_()
            self._attach_grad_views()
        else:
            assert self.shard_grad is not None
            self.shard_grad.zero_()
            for p in self.params:
                p.grad = None

    # ------------------------------------------------------------------------------ memory
    def param_bytes(self) -> int:
        """Bytes of compute-dtype parameters held now (full buffer if present + shard)."""
        total = self.flat_param.untyped_storage().nbytes()
        if self.shard_param is not None:
            total += self.shard_param.untyped_storage().nbytes()
        return total

    def grad_bytes(self) -> int:
        """Bytes of gradient storage held at rest."""
        held = self.flat_grad if self.flat_grad is not None else self.shard_grad
        assert held is not None
        extra = 0 if self.flat_grad is not None else sum(
            p.grad.untyped_storage().nbytes() for p in self.params if p.grad is not None)
        return held.untyped_storage().nbytes() + extra

    def master_bytes(self) -> int:
        """Bytes of fp32 master weights that are not also the compute parameters."""
        if self.dtype == torch.float32:
            return 0
        return self.master.untyped_storage().nbytes()
