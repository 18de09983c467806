"""mt-eval's :class:`~mt_eval.Scorer` for a pipeline stage of any TP x PP x DP layout.

Every rank holds the same batches (tasks and tokenizer are deterministic); DP replica ``r``
scores batches ``r, r + dp, ...``; within a replica the batches stream through mt-pipeline's
forward-only pass as micro-batches (no backward, a few in flight at once); the last stage
applies the output head to the scored positions only (a multiple-choice request scores a
few of its tokens) and turns those vocabulary-sharded logits into log-probabilities and
greedy flags (:func:`mt_tensor_parallel.vocab_parallel_logprobs`: the full logits never
exist on one rank); one all-reduce then gives every rank every score.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mt_dist import ParallelGroups
from mt_eval import Request
from mt_pipeline import PipelineStage, StageComm, forward_outputs
from mt_tensor_parallel import vocab_parallel_logprobs

__all__ = ["StageScorer"]


@dataclass(frozen=True)
class _Batch:
    """One batch as tensors: ``ids`` [distinct inputs, length] (right-padded); for every
    scored position, its input row, column, target token and owning request."""

    ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    owner: torch.Tensor
    requests: int


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

    def _inputs(self, batch: Sequence[Request]) -> list[tuple[int, ...]]:
        """The distinct input sequences of a batch (requests that differ only in their last
        token, such as the one-token choices of a question, share one forward pass)."""
        return list(dict.fromkeys(r.tokens[:-1] for r in batch))

    def _tensors(self, batch: Sequence[Request]) -> _Batch:
        inputs = self._inputs(batch)
        row_of = {tokens: i for i, tokens in enumerate(inputs)}
        ids = torch.zeros(len(inputs), self._length(batch), dtype=torch.int64)
        for i, tokens in enumerate(inputs):
            ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        rows, cols, targets, owner = [], [], [], []
        for i, request in enumerate(batch):
            n = len(request.tokens) - 1
            rows += [row_of[request.tokens[:-1]]] * request.scored
            cols += range(n - request.scored, n)
            targets += request.tokens[n - request.scored + 1:]
            owner += [i] * request.scored
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        return _Batch(ids.to(self.device), as_tensor(rows), as_tensor(cols),
                      as_tensor(targets), as_tensor(owner), len(batch))

    def _shape(self, batch: Sequence[Request]) -> tuple[int, int, int]:
        length = self._length(batch)
        if self.sequence_parallel:
            length //= self.groups.tp_size
        return (len(self._inputs(batch)), length, self.hidden)

    def _scores(self, out: torch.Tensor, b: _Batch) -> torch.Tensor:
        """[requests, 2]: summed log-likelihood and all-greedy of each request, from the
        last stage's output (hidden states, or logits under sequence parallelism)."""
        picked = out[b.rows, b.cols].unsqueeze(0)  # the scored positions only
        logits = picked if self.sequence_parallel else self.stage.apply_head(picked)
        logprob, greedy = vocab_parallel_logprobs(logits, b.targets.unsqueeze(0),
                                                  self.groups.tp, self.vocab_size)
        ll = torch.zeros(b.requests, dtype=torch.float64, device=self.device)
        ll.index_add_(0, b.owner, logprob[0].double())
        missed = torch.zeros(b.requests, device=self.device)
        missed.index_add_(0, b.owner, (~greedy[0]).float())
        return torch.stack([ll, (missed == 0).double()], dim=1)

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

                def last(micro: int, out: torch.Tensor,
                         tensors: list[_Batch] = tensors) -> torch.Tensor:
                    return self._scores(out, tensors[micro])

                out = forward_outputs(
                    self.stage, comm, len(group),
                    [t.ids for t in tensors] if groups.is_first_stage else None, last,
                    lambda micro, group=group: self._shape(group[micro]), self.dtype,
                    self.device, head=self.sequence_parallel)
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
