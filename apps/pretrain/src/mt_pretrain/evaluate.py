"""Validation loss: forward only, through every pipeline stage, averaged over data parallel.

The pipeline executor runs training steps (forward and backward); evaluation needs only
forward passes, so it walks the virtual stages in order with plain point-to-point messages:
each rank handles (micro-batch, chunk) pairs in the same global order, receives its input
from the previous virtual stage and sends its output to the next. That order is a
topological order of the data flow, so asynchronous sends cannot deadlock.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mt_data import DPDataLoader
from mt_dist import ParallelGroups
from mt_pipeline import PipelineStage
from mt_pretrain.data import to_batch

__all__ = ["evaluate", "forward_loss"]


def _forward_micro(stage: PipelineStage, groups: ParallelGroups, idx: torch.Tensor | None,
                   targets: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor | None:
    """One micro-batch through every virtual stage; the loss on the last one, else None."""
    p, s = groups.pp_size, groups.pp_rank
    ranks = groups.pp_group_ranks
    pending = []
    loss = None
    for chunk in range(stage.num_chunks):
        virtual = chunk * p + s
        if stage.is_first_chunk(chunk):
            x = idx
        else:
            x = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(x, src=ranks[(virtual - 1) % p], group=groups.pp)
        out = stage.forward_chunk(chunk, x)
        if stage.is_last_chunk(chunk):
            loss = stage.loss(out, targets)
        else:
            pending.append(dist.isend(out.contiguous(), dst=ranks[(virtual + 1) % p],
                                      group=groups.pp))
    for work in pending:
        work.wait()
    return loss


@torch.no_grad()
def forward_loss(stage: PipelineStage, groups: ParallelGroups, micro_batches: list[torch.Tensor],
                 shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> float:
    """Mean loss of this DP rank's ``micro_batches`` ([micro, seq + 1] token tensors),
    known on every rank of the pipeline."""
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for batch in micro_batches:
        batch = batch.to(device)
        idx, targets = batch[:, :-1], batch[:, 1:]
        loss = _forward_micro(stage, groups, idx if groups.is_first_stage else None,
                              targets if groups.is_last_stage else None, shape, dtype, device)
        if loss is not None:
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
    if groups.dp_size > 1:
        dist.all_reduce(value, group=groups.dp)
        value /= groups.dp_size
    loss = float(value)
    return loss, math.exp(min(loss, 50.0))
