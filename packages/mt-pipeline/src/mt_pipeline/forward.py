"""Forward-only passes through a pipeline: validation, scoring, generation of logits.

Training needs a schedule (forward and backward interleaved); a forward pass needs only an
order in which every virtual stage receives its input before it runs. Every rank walks the
(micro-batch, chunk) pairs in the same global order, receives a chunk's input from the
previous virtual stage and sends its output to the next; that order is a topological order
of the data flow, so the asynchronous sends cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mt_pipeline.p2p import StageComm
from mt_pipeline.stage import PipelineStage

__all__ = ["forward_losses"]


@torch.no_grad()
def forward_losses(stage: PipelineStage, comm: StageComm, num_micro_batches: int,
                   inputs: Sequence[torch.Tensor] | None,
                   targets: Sequence[torch.Tensor] | None,
                   activation_shape: Sequence[int], dtype: torch.dtype,
                   device: torch.device | str) -> list[torch.Tensor]:
    """The loss of each of ``num_micro_batches`` micro-batches (``inputs[i]`` token ids on
    the first stage, ``targets[i]`` on the last), on the last stage; an empty list on the
    others. Receive buffers have ``activation_shape`` and ``dtype`` (as in the executor).
    """
    p, s = comm.num_stages, comm.stage
    losses, pending = [], []
    for micro in range(num_micro_batches):
        for chunk in range(stage.num_chunks):
            virtual = chunk * p + s
            if stage.is_first_chunk(chunk):
                assert inputs is not None, "the first stage needs the inputs"
                x = inputs[micro]
            else:
                x = torch.empty(tuple(activation_shape), dtype=dtype, device=device)
                dist.recv(x, src=comm.stage_ranks[(virtual - 1) % p], group=comm.group)
            out = stage.forward_chunk(chunk, x)
            if stage.is_last_chunk(chunk):
                assert targets is not None, "the last stage needs the targets"
                losses.append(stage.loss(out, targets[micro]))
            else:
                pending.append(dist.isend(out.contiguous(), dst=comm.stage_ranks[(virtual + 1) % p],
                                          group=comm.group))
    for work in pending:
        work.wait()
    return losses
