"""mt-eval's :class:`~mt_eval.Scorer` for a pipeline stage of any TP x PP x DP layout.

Every rank holds the same batches (tasks and tokenizer are deterministic); DP replica ``r``
scores batches ``r, r + dp, ...``; within a replica the batches stream through mt-pipeline's
forward-only pass as micro-batches (no backward, a few in flight at once); the last stage
turns vocabulary-sharded logits into per-token log-probabilities and greedy flags
(:func:`mt_tensor_parallel.vocab_parallel_logprobs`: the full logits never exist); one
all-reduce then gives every rank every score.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from mt_dist import ParallelGroups
from mt_eval import Request
from mt_pipeline import PipelineStage, StageComm, forward_outputs
from mt_tensor_parallel import vocab_parallel_logprobs

__all__ = ["StageScorer"]


class StageScorer:
    """Scores requests with this rank's ``stage`` (every rank of the run calls it together).

    Args:
        stage: this rank's pipeline stage (the whole model when pp == 1).
        groups: the run's process groups.
        vocab_size: real vocabulary size (padding columns carry no probability).
        max_length: the model's positions.
        dtype: dtype of activations between stages.
        sequence_parallel: the stage splits sequences over TP (lengths padded to a multiple
            of tp).
        in_flight: micro-batches sent through the pipeline before waiting for their sends.
    """

    def __init__(self, stage: PipelineStage, groups: ParallelGroups, vocab_size: int,
                 max_length: int, dtype: torch.dtype, hidden: int,
                 sequence_parallel: bool = False, in_flight: int = 4) -> None:
        self.stage, self.groups, self.vocab_size = stage, groups, vocab_size
        self.max_length, self.dtype, self.hidden = max_length, dtype, hidden
        self.sequence_parallel, self.in_flight = sequence_parallel, in_flight
        self.device = groups.device

    def _length(self, batch: Sequence[Request]) -> int:
        length = max(len(r.tokens) for r in batch) - 1
        if self.sequence_parallel:
            tp = self.groups.tp_size
            length = -(-length // tp) * tp
        return length

    def _tensors(self, batch: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
        """(inputs, targets, scored mask), each [batch, length], right-padded."""
        length = self._length(batch)
        inputs = torch.zeros(len(batch), length, dtype=torch.int64)
        targets = torch.zeros(len(batch), length, dtype=torch.int64)
        mask = torch.zeros(len(batch), length, dtype=torch.bool)
        for i, request in enumerate(batch):
            tokens = torch.tensor(request.tokens, dtype=torch.int64)
            n = len(tokens) - 1
            inputs[i, :n], targets[i, :n] = tokens[:-1], tokens[1:]
            mask[i, n - request.scored:n] = True
        return inputs.to(self.device), targets.to(self.device), mask.to(self.device)

    def _shape(self, batch: Sequence[Request]) -> tuple[int, int, int]:
        length = self._length(batch)
        if self.sequence_parallel:
            length //= self.groups.tp_size
        return (len(batch), length, self.hidden)

    @torch.no_grad()
    def __call__(self, batches: Sequence[Sequence[Request]],
                 advance: Callable[[int], None]) -> list[list[tuple[float, bool]]]:
        groups = self.groups
        offsets = [0]
        for batch in batches:
            offsets.append(offsets[-1] + len(batch))
        # (log-likelihood, greedy) of every request; filled where this rank scores, summed.
        scores = torch.zeros(offsets[-1], 2, dtype=torch.float64, device=self.device)
        mine = list(range(groups.dp_rank, len(batches), groups.dp_size))
        comm = StageComm.from_groups(groups)
        was_training = self.stage.training
        self.stage.eval()
        try:
            for start in range(0, len(mine), self.in_flight):
                group = [batches[b] for b in mine[start:start + self.in_flight]]
                tensors = [self._tensors(batch) for batch in group]

                def last(micro: int, logits: torch.Tensor,
                         tensors: list = tensors) -> torch.Tensor:
                    _, targets, mask = tensors[micro]
                    logprob, greedy = vocab_parallel_logprobs(logits, targets, groups.tp,
                                                              self.vocab_size)
                    ll = torch.where(mask, logprob.double(), 0.0).sum(dim=1)
                    return torch.stack([ll, (greedy | ~mask).all(dim=1).double()], dim=1)

                out = forward_outputs(
                    self.stage, comm, len(group),
                    [t[0] for t in tensors] if groups.is_first_stage else None, last,
                    lambda micro, group=group: self._shape(group[micro]), self.dtype,
                    self.device)
                if groups.is_last_stage and groups.tp_rank == 0:
                    for b, result in zip(mine[start:start + self.in_flight], out, strict=True):
                        scores[offsets[b]:offsets[b + 1]] = result
                advance(sum(len(batch) for batch in group) * groups.dp_size)
        finally:
            self.stage.train(was_training)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(scores)
        values = scores.cpu().tolist()
        return [[(ll, greedy > 0.5) for ll, greedy in values[offsets[b]:offsets[b + 1]]]
                for b in range(len(batches))]
