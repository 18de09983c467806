"""The ZeRO optimizer wrapper: data parallelism with sharded optimizer state, gradients and
parameters (stages 0-3), mixed precision, loss scaling and global gradient clipping.

Usage (every rank of the data-parallel group)::

    opt = ZeroOptimizer(model, lambda groups: torch.optim.AdamW(groups, lr=1e-3),
                        dp_group=groups.dp, config=ZeroConfig(stage=2, precision="bf16"))
    for micro in micro_batches[:-1]:
        with opt.no_sync():
            opt.backward(model(micro) / len(micro_batches))
    opt.backward(model(micro_batches[-1]) / len(micro_batches))
    result = opt.step()          # reduces what is left, clips, steps, re-publishes params

The wrapped torch optimizer only ever sees fp32 *master pieces*: 1-D tensors, one per
(parameter, shard) intersection, that are views into this rank's fp32 master shard. Its
state is therefore sharded exactly like the master weights, and parameter groups (weight
decay rules) survive sharding because each piece stays in its parameter's group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from mt_dist.collectives import (
    all_gather_flat,
    all_reduce_over,
    all_reduce_sum_flat,
    group_rank,
    group_size,
)
from mt_zero.buckets import FlatBucket
from mt_zero.clip import clip_coefficient, sum_of_squares
from mt_zero.grad_sync import GradSync
from mt_zero.partition import bucketize, partition
from mt_zero.precision import PRECISIONS, LossScaler, LossScalerConfig, compute_dtype
from mt_zero.stage3 import ParamGatherer, assign_units, default_units

__all__ = ["MasterPiece", "MemoryReport", "StepResult", "ZeroConfig", "ZeroOptimizer"]

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


@dataclass(frozen=True)
class ZeroConfig:
    """How data parallelism shards and computes."""

    stage: int = 1
    """ZeRO stage: 0 plain data parallel, 1 optimizer state sharded, 2 + gradients sharded,
    3 + parameters sharded."""
    precision: str = "fp32"
    """Compute dtype of the model parameters: fp32, bf16 or fp16 (fp16 uses loss scaling).
    Master weights and optimizer state are always fp32."""
    main_grads: bool = True
    """bf16 / fp16: accumulate gradients over micro-batches and reduce them over the
    data-parallel group in fp32 (Megatron-LM's main grads); False keeps them in the compute
    dtype (half the gradient memory, rounding at every addition)."""
    bucket_numel: int = 2**22
    """Elements per gradient-reduction bucket (stages 0-2; stage 3 reduces per unit)."""
    clip_grad: float = 0.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    prefetch: bool = True
    """Stage 3: gather the next unit while the current one computes."""
    loss_scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    """Dynamic loss scaling policy (used only with precision fp16)."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage}")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}"
            )
        if self.bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {self.bucket_numel}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables), got {self.clip_grad}")


@dataclass(frozen=True)
class StepResult:
    """What :meth:`ZeroOptimizer.step` did.

    Attributes:
        grad_norm: global gradient norm before clipping (unscaled; inf/nan on overflow).
        skipped: True if the step was skipped because gradients overflowed (fp16).
        loss_scale: the loss scale used for this step (1.0 without loss scaling).
    """

    grad_norm: float
    skipped: bool
    loss_scale: float


@dataclass
class MasterPiece:
    """One fp32 master tensor the inner optimizer steps: a parameter's slice in this shard."""

    name: str
    param_offset: int
    length: int
    group: int
    bucket: int
    shard_offset: int
    tensor: nn.Parameter
    counted: bool


@dataclass(frozen=True)
class MemoryReport:
    """Bytes this rank holds during a step, in the categories of the ZeRO paper.

    Gradients count their full storage although it is released between steps.
    """

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        """All three together."""
        return self.params + self.grads + self.optimizer


class ZeroOptimizer:
    """Data-parallel training of ``model`` with ZeRO stage 0-3 over ``dp_group``.

    Args:
        model: the module to train. Its trainable parameters are moved into flat buffers
            (``p.data`` becomes a view) in the compute dtype; under stage 3 they only hold
            data while their unit runs (see :meth:`gathered`).
        optimizer_factory: builds the inner optimizer from a list of parameter-group dicts
            (e.g. ``lambda g: torch.optim.AdamW(g, lr=3e-4, betas=(0.9, 0.95))``).
        dp_group: the data-parallel group; ``None`` for a single process.
        config: stage, precision, buckets, clipping.
        param_groups: optional groups as for a torch optimizer (``"params"`` lists of model
            parameters plus options), e.g. from :func:`mt_zero.decay_param_groups`.
        units: stage 3 modules whose parameters are gathered together (default: the model
            and every module in an ``nn.ModuleList``).
        norm_groups: the other orthogonal groups (tensor, pipeline parallel) over which the
            gradient norm and the overflow flag are summed; the DP group is added for
            stages >= 1, where each DP rank holds a disjoint shard.
        count_in_norm: ``(name, param) -> bool``, whether this rank counts a parameter in
            the norm (see :func:`mt_zero.counts_once`); default: all.
        partial_params: parameters whose gradient on this rank is a partial sum over
            ``partial_group`` (replicated parameters used on this rank's share of the work,
            e.g. norms under sequence parallelism, once their per-backward all-reduce is
            deferred: :func:`mt_tensor_parallel.defer_replicated_grads`). :meth:`step` sums
            them over the group once, in one bucket, after the data-parallel reduction
            (which it commutes with; under stages 2-3 only this rank's shard of them).
        partial_group: the group ``partial_params`` are summed over (tensor parallel).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_factory: OptimizerFactory,
        dp_group: ProcessGroup | None = None,
        config: ZeroConfig = ZeroConfig(),
        *,
        param_groups: Sequence[dict[str, Any]] | None = None,
        units: Sequence[nn.Module] | None = None,
        norm_groups: Sequence[ProcessGroup | None] = (),
        count_in_norm: Callable[[str, nn.Parameter], bool] | None = None,
        partial_params: Sequence[nn.Parameter] = (),
        partial_group: ProcessGroup | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.dp_group = dp_group
        self.dp_size, self.dp_rank = group_size(dp_group), group_rank(dp_group)
        self.dtype = compute_dtype(config.precision)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.names = [n for n, _ in named]
        self._shapes = {n: tuple(p.shape) for n, p in named}
        params = [p for _, p in named]
        self.buckets, unit_list, unit_buckets = self._build_buckets(model, params, units)
        self.pieces, self.optimizer = self._build_optimizer(
            named, param_groups, optimizer_factory, count_in_norm)
        self.gatherer: ParamGatherer | None = None
        if config.stage == 3:
            self.gatherer = ParamGatherer(unit_list, unit_buckets, prefetch=config.prefetch)
        self.partial_group = partial_group
        self._partial = self._partial_slices(partial_params)
        self.grad_sync = GradSync(
            self.buckets, self.gatherer.on_backward_done if self.gatherer else None)
        self._norm_groups = ([dp_group] if config.stage >= 1 else []) + list(norm_groups)
        self.scaler: LossScaler | None = (
            LossScaler(config.loss_scaler) if PRECISIONS[config.precision].loss_scaling
            else None)

    # ------------------------------------------------------------------------ construction
    def _build_buckets(
        self, model: nn.Module, params: list[nn.Parameter], units: Sequence[nn.Module] | None
    ) -> tuple[list[FlatBucket], list[nn.Module], list[FlatBucket | None]]:
        """Group parameters into flat buckets (stages 0-2) or per-unit buckets (stage 3)."""
        stage = self.config.stage
        if stage == 3:
            unit_list = [model] + [u for u in (units or default_units(model)) if u is not model]
            owners = assign_units(model, unit_list, params)
            members = [[i for i, o in enumerate(owners) if o == u] for u in range(len(unit_list))]
            # Launch order: units whose parameters come last in the model first, because
            # backward reaches them first.
            groups = sorted((m for m in members if m), key=lambda m: -m[0])
        else:
            unit_list, members = [], []
            limit = self.config.bucket_numel
            groups = bucketize([p.numel() for p in params], limit, own_bucket_from=limit)
        world, rank = (self.dp_size, self.dp_rank) if stage >= 1 else (1, 0)
        buckets = []
        for index, idx in enumerate(groups):
            layout = partition([params[i].numel() for i in idx], world)
            buckets.append(FlatBucket(
                index, [self.names[i] for i in idx], [params[i] for i in idx], layout, rank,
                stage, self.dtype, self.dp_group, self.config.main_grads))
        self._slots = {id(params[i]): (b, position) for idx, b in zip(groups, buckets)
                       for position, i in enumerate(idx)}
        by_first = {idx[0]: b for idx, b in zip(groups, buckets)}
        unit_buckets = [by_first.get(m[0]) if m else None for m in members]
        return buckets, unit_list, unit_buckets

    def _partial_slices(self, partial: Sequence[nn.Parameter]) -> list[tuple[int, int, int]]:
        """(bucket, offset in its owned gradient, length) of every piece of a partially
        summed parameter that this rank's shard holds, in bucket order."""
        wanted = {id(p) for p in partial}
        unknown = len(wanted - set(self._slots))
        if unknown:
            raise ValueError(f"{unknown} of partial_params are not trainable parameters of "
                             "the model")
        for prefix, module in self.model.named_modules():  # a deferred sum nobody does
            if getattr(module, "defer_grad_reduce", False):
                for name in module.partial_grad_names():
                    if id(module.get_parameter(name)) not in wanted:
                        raise ValueError(
                            f"{prefix}.{name}: its module leaves the sum of its gradient over "
                            "tensor parallelism to the step (deferred), but it is not among "
                            "partial_params: it would be stepped with this rank's part only")
        return [(bucket.index, piece.shard_offset, piece.length) for bucket in self.buckets
                for piece in bucket.layout.pieces(bucket.rank)
                if id(bucket.params[piece.param_index]) in wanted]

    def _build_optimizer(
        self,
        named: list[tuple[str, nn.Parameter]],
        param_groups: Sequence[dict[str, Any]] | None,
        factory: OptimizerFactory,
        count_in_norm: Callable[[str, nn.Parameter], bool] | None,
    ) -> tuple[list[MasterPiece], torch.optim.Optimizer]:
        """One master piece per (parameter, shard) intersection, grouped like the params."""
        groups = list(param_groups) if param_groups is not None else [
            {"params": [p for _, p in named]}]
        group_of: dict[int, int] = {}
        for g, spec in enumerate(groups):
            for p in spec["params"]:
                group_of.setdefault(id(p), g)
        missing = [n for n, p in named if id(p) not in group_of]
        if missing:
            raise ValueError(f"trainable parameters missing from param_groups: {missing}")
        counted = {n: count_in_norm is None or count_in_norm(n, p) for n, p in named}
        per_group: list[list[MasterPiece]] = [[] for _ in groups]
        for bucket in self.buckets:
            for piece in bucket.layout.pieces(bucket.rank):
                name, p = bucket.names[piece.param_index], bucket.params[piece.param_index]
                view = bucket.master[piece.shard_offset : piece.shard_offset + piece.length]
                per_group[group_of[id(p)]].append(MasterPiece(
                    name, piece.param_offset, piece.length, group_of[id(p)], bucket.index,
                    piece.shard_offset, nn.Parameter(view), counted[name]))
        pieces = [mp for group in per_group for mp in group]
        specs = [{**{k: v for k, v in spec.items() if k != "params"},
                  "params": [mp.tensor for mp in per_group[g]]} for g, spec in enumerate(groups)]
        return pieces, factory(specs)

    # ---------------------------------------------------------------------------- training
    def no_sync(self) -> Any:
        """Context: backward passes accumulate gradients without communicating."""
        return self.grad_sync.no_sync()

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16 loss scaling)."""
        return 1.0 if self.scaler is None else self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (a no-op unless fp16)."""
        return loss if self.scaler is None else loss * self.scaler.scale

    def main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """Where ``param``'s gradient accumulates before the data-parallel reduction: its
        fp32 main gradient, or its ``.grad`` without main gradients. Adding to it in place
        (between backward and :meth:`step`, e.g. a tied weight's sum over pipeline stages)
        changes the gradient that is reduced and stepped."""
        bucket, position = self._slots[id(param)]
        return bucket.main_grad(position)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the (scaled) loss; gradients are averaged unless in :meth:`no_sync`."""
        self.scale_loss(loss).backward()

    def step(self) -> StepResult:
        """Reduce what is pending, unscale, clip, step the shards, re-publish parameters.

        Collective over the data-parallel group (and ``norm_groups``). Releases the
        gradients (every ``p.grad`` becomes None).
        """
        self.grad_sync.finish()
        if self.gatherer is not None:
            self.gatherer.free_all()
        buffers = self._attach_master_grads()
        self._sum_partial(buffers)
        scale = self.loss_scale
        if scale != 1.0:
            for buf in buffers:
                buf.mul_(1.0 / scale)
        counted = sum_of_squares((mp.tensor.grad for mp in self.pieces if mp.counted),
                                 self.buckets[0].device)  # type: ignore[misc]
        # Count buckets with inf/nan without a host sync per bucket (matters on GPUs); only
        # fp16 loss scaling acts on it, so other precisions skip the passes over the grads.
        if self.scaler is not None:
            nonfinite = torch.stack([~torch.isfinite(b).all() for b in buffers]).sum()
        else:
            nonfinite = torch.zeros((), device=counted.device)
        stats = torch.stack([counted, nonfinite.to(counted.dtype)])
        all_reduce_over(stats, self._norm_groups)
        norm, found_inf = float(stats[0].sqrt()), bool(stats[1] > 0)
        skipped = found_inf and self.scaler is not None
        if not skipped:
            coef = clip_coefficient(norm, self.config.clip_grad)
            if coef < 1.0:
                for buf in buffers:
                    buf.mul_(coef)
            self.optimizer.step()
            for handle in [b.publish() for b in self.buckets]:
                handle.wait()
        self.zero_grad()
        if self.scaler is not None:
            self.scaler = self.scaler.update(found_inf)
        return StepResult(grad_norm=norm, skipped=skipped, loss_scale=scale)

    def _sum_partial(self, buffers: list[torch.Tensor]) -> None:
        """One all-reduce over ``partial_group`` of every partially summed gradient piece."""
        all_reduce_sum_flat([buffers[b][offset : offset + n] for b, offset, n in self._partial],
                            self.partial_group)

    def _attach_master_grads(self) -> list[torch.Tensor]:
        """Point each master piece's ``.grad`` at its slice of an fp32 gradient shard."""
        buffers = []
        for bucket in self.buckets:
            grad = bucket.owned_grad()
            buffers.append(grad if grad.dtype == torch.float32 else grad.float())
        for mp in self.pieces:
            mp.tensor.grad = buffers[mp.bucket][mp.shard_offset : mp.shard_offset + mp.length]
        return buffers

    def zero_grad(self) -> None:
        """Release all gradients (model ``p.grad`` and master pieces become None)."""
        for bucket in self.buckets:
            bucket.zero_grad()
        for mp in self.pieces:
            mp.tensor.grad = None

    def publish(self) -> None:
        """Copy the master weights into the compute parameters on every rank (collective)."""
        for handle in [b.publish() for b in self.buckets]:
            handle.wait()

    # ------------------------------------------------------------------------- inspection
    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Stage 3: all parameters materialized inside (collective); no-op otherwise."""
        if self.gatherer is None:
            yield
            return
        self.gatherer.gather_all()
        try:
            yield
        finally:
            self.gatherer.free_all()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Full fp32 master weights by parameter name, on every rank (collective)."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            full = torch.empty(bucket.layout.padded_numel, dtype=torch.float32,
                               device=bucket.device)
            group = self.dp_group if self.config.stage >= 1 else None
            all_gather_flat(full, bucket.master, group).wait()
            for name, s, n in zip(bucket.names, bucket.layout.param_starts, bucket.layout.numels):
                out[name] = full[s : s + n].view(self._shapes[name]).clone()
        return {name: out[name] for name in self.names}

    def memory(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state (incl. fp32 master) held now."""
        state = sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                    for v in s.values() if isinstance(v, torch.Tensor))
        return MemoryReport(
            params=sum(b.param_bytes() for b in self.buckets),
            grads=sum(b.grad_bytes() for b in self.buckets),
            optimizer=state + sum(b.master_bytes() for b in self.buckets),
        )

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shape of every managed parameter, by name."""
        return dict(self._shapes)
