"""Forward-only passes through a pipeline: validation, scoring, generation of logits.

Training needs a schedule (forward and backward interleaved); a forward pass needs only an
order in which every virtual stage receives its input before it runs. Every rank walks the
(micro-batch, chunk) pairs in the same global order, receives a chunk's input from the
previous virtual stage and sends its output to the next; that order is a topological order
of the data flow, so the asynchronous sends cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from mt_pipeline.p2p import StageComm
from mt_pipeline.stage import DecodeCache, PipelineStage

__all__ = ["decode_step", "forward_losses", "forward_outputs"]

T = TypeVar("T")


@torch.no_grad()
def forward_outputs(stage: PipelineStage, comm: StageComm, num_micro_batches: int,
                    inputs: Sequence[torch.Tensor] | None,
                    last: Callable[[int, torch.Tensor], T],
                    activation_shape: Sequence[int] | Callable[[int], Sequence[int]],
                    dtype: torch.dtype, device: torch.device | str,
                    head: bool = True) -> list[T]:
    """``last(i, logits)`` of each of ``num_micro_batches`` micro-batches, on the last stage
    (an empty list on the others); ``inputs[i]`` are micro-batch ``i``'s token ids on the
    first stage. Receive buffers have ``activation_shape`` (one shape, or the shape of
    micro-batch ``i`` when micro-batches differ in size) and ``dtype``. ``head=False`` gives
    ``last`` the final hidden states instead of logits (it may apply
    :meth:`PipelineStage.apply_head` to the positions it needs).
    """
    p, s = comm.num_stages, comm.stage
    shape_of = activation_shape if callable(activation_shape) else (lambda _i: activation_shape)
    outputs, pending = [], []
    for micro in range(num_micro_batches):
        for chunk in range(stage.num_chunks):
            virtual = chunk * p + s
            if stage.is_first_chunk(chunk):
                assert inputs is not None, "the first stage needs the inputs"
                x = inputs[micro]
            else:
                x = torch.empty(tuple(shape_of(micro)), dtype=dtype, device=device)
                dist.recv(x, src=comm.stage_ranks[(virtual - 1) % p], group=comm.group)
            out = stage.forward_chunk(chunk, x, head=head)
            if stage.is_last_chunk(chunk):
                outputs.append(last(micro, out))
            else:
                pending.append(dist.isend(out.contiguous(), dst=comm.stage_ranks[(virtual + 1) % p],
                                          group=comm.group))
    for work in pending:
        work.wait()
    return outputs


def forward_losses(stage: PipelineStage, comm: StageComm, num_micro_batches: int,
                   inputs: Sequence[torch.Tensor] | None,
                   targets: Sequence[torch.Tensor] | None,
                   activation_shape: Sequence[int], dtype: torch.dtype,
                   device: torch.device | str) -> list[torch.Tensor]:
    """The loss of each of ``num_micro_batches`` micro-batches (``inputs[i]`` token ids on
    the first stage, ``targets[i]`` on the last), on the last stage; an empty list on the
    others. Receive buffers have ``activation_shape`` and ``dtype`` (as in the executor).
    """
    def loss(micro: int, hidden: torch.Tensor) -> torch.Tensor:
        assert targets is not None, "the last stage needs the targets"
        return stage.head_loss(hidden, targets[micro])

    return forward_outputs(stage, comm, num_micro_batches, inputs, loss, activation_shape,
                           dtype, device, head=False)


@torch.no_grad()
def decode_step(stage: PipelineStage, comm: StageComm, ids: torch.Tensor, cache: DecodeCache,
                hidden: int, dtype: torch.dtype, pending: list[dist.Work] | None = None,
                last: bool = False) -> torch.Tensor | None:
    """One step of incremental decoding through the pipeline (:meth:`PipelineStage.decode`):
    ``ids`` [b, s] are every row's next tokens (given on every stage: the others take the
    activations' shape [b, s, ``hidden``] from them); each stage receives the previous
    stage's activations (``dtype``), runs its layers on this rank's ``cache`` and sends on
    (asynchronously when given a ``pending`` list: the send's handle joins it, for the caller
    to wait on, so that the stage can go on with another batch). Returns the last stage's
    logits (of the last position only with ``last``); None on the others."""
    p, s = comm.num_stages, comm.stage
    if comm.is_first:
        x = ids
    else:
        x = torch.empty((*ids.shape, hidden), dtype=dtype, device=ids.device)
        dist.recv(x, src=comm.stage_ranks[s - 1], group=comm.group)
    out = stage.decode(x, cache, last)
    if s == p - 1:
        return out
    if pending is None:
        dist.send(out.contiguous(), dst=comm.stage_ranks[s + 1], group=comm.group)
    else:
        pending.append(dist.isend(out.contiguous(), dst=comm.stage_ranks[s + 1],
                                  group=comm.group))
    return None
