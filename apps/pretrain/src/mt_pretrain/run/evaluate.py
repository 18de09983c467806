"""Validation loss: forward only (mt-pipeline's :func:`~mt_pipeline.forward_losses` through
every stage), averaged over micro-batches, data and context parallelism, known on every rank."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mt_data import DPDataLoader
from mt_dist import ParallelGroups
from mt_pipeline import PipelineStage, StageComm, forward_losses
from mt_pretrain.data.inputs import inputs_targets, to_batch

__all__ = ["evaluate", "forward_loss"]


def forward_loss(stage: PipelineStage, groups: ParallelGroups, micro_batches: list[torch.Tensor],
                 shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> float:
    """Mean loss of this DP rank's ``micro_batches`` ([micro, seq + 1] token tensors; this
    rank's slice of them with context parallelism), known on every rank of the pipeline."""
    pairs = [inputs_targets(b.to(device), groups.cp_size, groups.cp_rank)
             for b in micro_batches]
    losses = forward_losses(
        stage, StageComm.from_groups(groups), len(pairs),
        [idx for idx, _ in pairs] if groups.is_first_stage else None,
        [targets for _, targets in pairs] if groups.is_last_stage else None, shape, dtype,
        device)
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for loss in losses:
        total += loss.float()
    if groups.pp_size > 1:
        dist.broadcast(total, src=groups.pp_group_ranks[-1], group=groups.pp)
    return float(total) / max(len(micro_batches), 1)


def evaluate(stage: PipelineStage, groups: ParallelGroups, loader: DPDataLoader,
             shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device | None = None) -> tuple[float, float]:
    """(validation loss, perplexity) over the loader's first global batch, on every rank."""
    micro = [to_batch([m]) for m in loader.global_batch(0)]
    was_training = stage.training
    stage.eval()
    try:
        local = forward_loss(stage, groups, micro, shape, dtype, device or groups.device)
    finally:
        stage.train(was_training)
    value = torch.tensor([local], dtype=torch.float32, device=groups.device)
    if groups.grad_size > 1:  # over data and context parallelism: every token's loss
        dist.all_reduce(value, group=groups.grad_group)
        value /= groups.grad_size
    loss = float(value)
    return loss, math.exp(min(loss, 50.0))
