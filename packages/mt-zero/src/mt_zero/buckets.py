"""One flat buffer of parameters: its compute copy, fp32 master shard and gradient storage.

A :class:`FlatBucket` takes a list of parameters and moves their data into one flat buffer
in the compute dtype; each parameter's ``.data`` becomes a view into it. What else it keeps
depends on the ZeRO stage (N = data-parallel size, "shard" = this rank's 1/N of the buffer
as laid out by :func:`mt_zero.partition.partition`):

=====  ====================  ==========================  ===================================
stage  compute parameters    gradients during a step     fp32 master weights
=====  ====================  ==========================  ===================================
0      full                  full flat (``p.grad`` views)  full (not sharded)
1      full                  full flat (``p.grad`` views)  shard
2      full                  shard (reduce-scattered)    shard
3      shard; full only      shard (reduce-scattered)    shard
       while gathered
=====  ====================  ==========================  ===================================

In fp32 the master shard aliases the compute parameters (no second copy).
Gradient reduction averages over the group: gradients are divided by N, then summed.

Gradient storage exists only from the first gradient of a backward until the optimizer step
(:meth:`FlatBucket.zero_grad` releases it), so the forward pass -- where activations peak --
runs without it. Stages 0-1 allocate the flat buffer when the bucket's first gradient
arrives and copy each gradient autograd produced into its slot (:meth:`FlatBucket.absorb`),
which frees autograd's tensor at once (a bucket of one parameter keeps autograd's tensor as
its buffer: no copy at all); later accumulation is in place into the view.

**fp32 main gradients** (``main_grads`` with 16-bit parameters, Megatron-LM's
``main_grad``): gradients are summed over micro-batches and reduced over the data-parallel
group in fp32. Autograd still computes each backward's gradient in the parameters' dtype; the
hook after it (:meth:`FlatBucket.absorb`) adds it into the parameter's slot of an fp32 flat
buffer and drops ``p.grad``, at every stage. Stages 2-3 reduce-scatter that fp32 buffer into
an fp32 shard. The cost: the gradient storage doubles (4 bytes per parameter), and stages 2-3
hold the full fp32 buffer while micro-batches accumulate. :meth:`FlatBucket.main_grad` is
where a parameter's gradient lives then (e.g. for the pipeline's tied-embedding sum).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from mt_dist.collectives import (
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
        main_grads: accumulate and reduce gradients in fp32 (see the module docstring); no
            effect when ``dtype`` is fp32.
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
        main_grads: bool = False,
    ) -> None:
        self.index = index
        self.names = tuple(names)
        self.params = tuple(params)
        self.layout = layout
        self.rank = rank
        self.stage = stage
        self.dtype = dtype
        self.group = group
        self.grad_dtype = torch.float32 if main_grads else dtype
        # Gradients leave p.grad for an fp32 buffer after every backward.
        self._main = self.grad_dtype != dtype
        # With one data-parallel rank (stages 0-1) nothing is reduced, so the flat gradient
        # is kept between steps and zeroed: autograd accumulates straight into its views.
        # Releasing it instead (as with several ranks, for memory) costs a copy per gradient
        # plus first-touch page faults on the fresh buffer every step.
        self._keep_grads = stage < 2 and group_size(group) == 1
        self._absorb = self._main or (stage < 2 and not self._keep_grads)
        self.start, self.end = layout.shard_range(rank)
        self._gather: Handle | None = None
        self._reduce: Handle | None = None
        self._recv: torch.Tensor | None = None
        self._send: torch.Tensor | None = None
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
        # Both are allocated lazily and released by zero_grad (see the module docstring):
        # stages 0-1 the full flat gradient, stages 2-3 the reduced shard.
        self.flat_grad: torch.Tensor | None = None
        self.shard_grad: torch.Tensor | None = None

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
    def _grad_buffer(self) -> torch.Tensor:
        """The full flat gradient (stages 0-1; any stage with main gradients), allocated now
        if it was released.

        Main gradients: zeros, which each backward's gradients are added to. Otherwise left
        uninitialized: a parameter's slot is valid only while ``p.grad`` is its view
        (:meth:`_attach_grad_views` fills the others), so no pass zeroes memory that
        gradients are about to overwrite. The padding is zeroed: it is reduced too.
        """
        if self.flat_grad is None:
            if self._main:
                self.flat_grad = torch.zeros(
                    self.layout.padded_numel, dtype=self.grad_dtype, device=self.device)
            else:
                self.flat_grad = torch.empty(
                    self.layout.padded_numel, dtype=self.dtype, device=self.device)
                self.flat_grad[self.layout.numel :].zero_()
        return self.flat_grad

    def main_grad(self, position: int) -> torch.Tensor:
        """The gradient of ``params[position]`` accumulated so far (before any reduction):
        with main gradients its fp32 slot (allocated if need be), else its ``.grad``
        (zeros if it has none). In place: what is written there is the gradient."""
        p = self.params[position]
        if not self._main:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            return p.grad
        start, numel = self.layout.param_starts[position], self.layout.numels[position]
        return self._grad_buffer()[start : start + numel].view(p.shape)

    def absorb(self, position: int) -> None:
        """Autograd just accumulated ``params[position].grad``: move it into the flat buffer.

        Stages 0-1 with more than one rank only (stages 2-3 copy at reduction time; one rank
        keeps its buffer, see ``__init__``). The first gradient of a step is
        a tensor autograd allocated; copying it into its slot and pointing ``.grad`` at the
        slot frees that tensor right away, and later accumulation happens in place.
        """
        p = self.params[position]
        if not self._absorb or p.grad is None:
            return
        if self._main:  # add into the fp32 slot; autograd's next gradient is a fresh tensor
            self.main_grad(position).add_(p.grad)
            p.grad = None
            return
        if self.flat_grad is None and self._whole(p.grad):
            # A bucket of one parameter without padding: autograd's tensor is the buffer.
            self.flat_grad = p.grad.detach().view(-1)
            return
        start, numel = self.layout.param_starts[position], self.layout.numels[position]
        view = self._grad_buffer()[start : start + numel].view(p.shape)
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def _whole(self, grad: torch.Tensor) -> bool:
        """Can ``grad`` serve as this bucket's whole flat buffer (no copy)?"""
        return (len(self.params) == 1 and self.layout.padded_numel == grad.numel()
                and grad.is_contiguous() and grad.dtype == self.dtype)

    def _attach_grad_views(self) -> None:
        flat = self._grad_buffer()
        for p, s, n in zip(self.params, self.layout.param_starts, self.layout.numels):
            view = flat[s : s + n].view(p.shape)
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
            if not self._main:
                self._attach_grad_views()
            self._grad_buffer()
            assert self.flat_grad is not None
            if world > 1:
                self.flat_grad.div_(world)
            self._reduce = all_reduce_sum(self.flat_grad, self.group)
            return
        grad = self.params[0].grad
        if self._main:  # the full fp32 buffer goes out; it is released once reduced
            send = self._grad_buffer()
            self.flat_grad = None
        elif grad is not None and self._whole(grad):
            send = grad.detach().view(-1)  # the gradient is dropped below: reduce it in place
            self.params[0].grad = None
        else:
            send = self._gather_grads()
        if world > 1:
            send.div_(world)
        self._recv = torch.empty(self.layout.shard_numel, dtype=self.grad_dtype,
                                 device=self.device)
        self._send = send
        self._reduce = reduce_scatter_flat(self._recv, send, self.group)

    def _gather_grads(self) -> torch.Tensor:
        """Stages 2-3: the gradients in one new flat tensor; every ``p.grad`` is dropped."""
        # Every element is written below (gradient, zero for none, zero padding): no memset.
        send = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        send[self.layout.numel :].zero_()
        for p, s, n in zip(self.params, self.layout.param_starts, self.layout.numels):
            if p.grad is None:
                send[s : s + n].zero_()
            else:
                send[s : s + n].copy_(p.grad.reshape(-1))
                p.grad = None
        return send

    def finish_reduce(self) -> None:
        """Wait for the reduction; stages 2-3 add the result to the gradient shard."""
        if self._reduce is None:
            return
        self._reduce.wait()
        self._reduce = None
        self._send = None
        if self._recv is not None:
            if self.shard_grad is None:  # first reduction of the step: the result is the shard
                self.shard_grad = self._recv
            else:
                self.shard_grad.add_(self._recv)
            self._recv = None

    def owned_grad(self) -> torch.Tensor:
        """The reduced gradient of this rank's shard (``grad_dtype``, ``shard_numel``).

        Zeros where no gradient exists (a step without backward, parameters without grad).
        """
        if self.stage < 2:
            if not self._main:
                self._attach_grad_views()
            return self._grad_buffer()[self.start : self.end]
        if self.shard_grad is None:
            self.shard_grad = torch.zeros(
                self.layout.shard_numel, dtype=self.grad_dtype, device=self.device)
        return self.shard_grad

    def zero_grad(self) -> None:
        """Release the gradient storage and set every ``p.grad`` to None.

        Releasing (rather than zeroing) keeps gradient memory out of the next forward pass;
        the next backward allocates it again as gradients arrive. With one rank the buffer is
        zeroed and kept instead (see ``__init__``).
        """
        if self._keep_grads and self.flat_grad is not None:
            self.flat_grad.zero_()
            if not self._main:
                self._attach_grad_views()
            return
        self.flat_grad = None
        self.shard_grad = None
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
        """Bytes of gradient storage a training step holds (released after each step).

        Stages 0-1: the flat buffer; stages 2-3: the reduced shard plus any ``p.grad`` (or
        main-gradient buffer) not yet reduced.
        """
        item = self.grad_dtype.itemsize
        if self.stage < 2:
            return self.layout.padded_numel * item
        pending = sum(p.grad.untyped_storage().nbytes() for p in self.params
                      if p.grad is not None)
        if self.flat_grad is not None:
            pending += self.flat_grad.untyped_storage().nbytes()
        return self.layout.shard_numel * item + pending

    def master_bytes(self) -> int:
        """Bytes of fp32 master weights that are not also the compute parameters."""
        if self.dtype == torch.float32:
            return 0
        return self.master.untyped_storage().nbytes()
