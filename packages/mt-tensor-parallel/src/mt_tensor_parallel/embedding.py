"""Tensor-parallel version of a GPT token + position embedding block."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from mt_dist.collectives import group_rank, group_size
from mt_tensor_parallel.mappings import partial_use
from mt_tensor_parallel.rng import RNGTracker
from mt_tensor_parallel.sharding import DEFAULT_PAD_MULTIPLE
from mt_tensor_parallel.vocab import VocabParallelEmbedding

__all__ = ["ParallelTokenPositionEmbedding"]


class ParallelTokenPositionEmbedding(nn.Module):
    """``drop(tokens(idx) + positions(arange(s)))`` with a vocabulary-parallel ``tokens``.

    Children keep the names ``tokens`` (a :class:`VocabParallelEmbedding`), ``positions``
    (replicated ``nn.Embedding``; None with rotary positions) and ``drop``, so state-dict
    keys do not change.
    Without sequence parallelism the token partial sums are all-reduced and the output is
    replicated [b, s, h]; dropout uses the default generator (same mask on every rank).
    With it the partial sums are reduce-scattered along the sequence, this rank's position
    rows are added (the position weight's gradient is then a partial sum: summed over the
    ranks per backward, or once per step when deferred) and the output [b, s/tp, h] gets
    dropout from the TP stream of ``tracker``.
    ``context`` (None: ``idx`` holds whole sequences) is a context-parallel slice
    (:class:`~mt_tensor_parallel.ContextParallel`): the tokens are at its positions.
    """

    def __init__(self, tokens: VocabParallelEmbedding, positions: nn.Embedding | None,
                 drop: nn.Module,
                 group: ProcessGroup | None, *, sequence_parallel: bool = False,
                 tracker: RNGTracker | None = None) -> None:
        super().__init__()
        if sequence_parallel and tracker is None and group_size(group) > 1:
            raise ValueError("sequence-parallel dropout needs an RNGTracker")
        self.tokens, self.positions, self.drop = tokens, positions, drop
        self.group, self.sequence_parallel = group, sequence_parallel
        object.__setattr__(self, "tracker", tracker)
        self.context: Any = None

    defer_grad_reduce = False

    def partial_grad_names(self) -> tuple[str, ...]:
        """Parameters whose gradient on this rank is a partial sum over the group: the
        position rows under sequence parallelism (this rank's slice of them)."""
        partial = self.sequence_parallel and self.positions is not None
        return ("positions.weight",) if partial and group_size(self.group) > 1 else ()

    @classmethod
    def from_module(cls, embed: nn.Module, group: ProcessGroup | None, *,
                    sequence_parallel: bool = False, tracker: RNGTracker | None = None,
                    pad_multiple: int = DEFAULT_PAD_MULTIPLE) -> ParallelTokenPositionEmbedding:
        """Build from a module with ``tokens`` / ``positions`` embeddings and ``drop``."""
        for child in ("tokens", "positions", "drop"):
            if not hasattr(embed, child):
                raise TypeError(f"{type(embed).__name__} has no '{child}' child")
        tokens = VocabParallelEmbedding.from_embedding(
            embed.tokens, group, pad_multiple=pad_multiple,
            reduce="sequence" if sequence_parallel else "all")
        return cls(tokens, embed.positions, embed.drop, group,
                   sequence_parallel=sequence_parallel, tracker=tracker)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``idx`` [b, s] -> [b, s, h], or [b, s/tp, h] with sequence parallelism;
        ``positions`` [b, s] (incremental decoding, without sequence parallelism), else
        the context-parallel slice's, else 0 .. s - 1."""
        seq = idx.shape[-1]
        if positions is not None and self.sequence_parallel:
            raise ValueError("decoding with given positions runs without sequence parallelism")
        if positions is None and self.context is not None:
            positions = self.context.positions(idx.device)
        last = seq - 1 if positions is None else int(positions.max())
        if self.positions is not None and last >= self.positions.num_embeddings:
            raise ValueError(f"sequence length {last + 1} exceeds the model's seq_len "
                             f"{self.positions.num_embeddings}")
        if not self.sequence_parallel:
            x = self.tokens(idx)
            if self.positions is None:  # rotary positions are applied in attention
                return self.drop(x)
            if positions is None:
                positions = torch.arange(seq, device=idx.device)
            return self.drop(x + F.embedding(positions, self.positions.weight))
        size, rank = group_size(self.group), group_rank(self.group)
        if seq % size != 0:
            raise ValueError(f"sequence length {seq} is not divisible by tp {size}")
        local = seq // size
        x = self.tokens(idx)
        if self.positions is not None:
            weight = partial_use(self.positions.weight, self.group, self.defer_grad_reduce)
            x = x + (weight[rank * local:(rank + 1) * local] if positions is None else
                     F.embedding(positions[rank * local:(rank + 1) * local], weight))
        if self.tracker is None or not self.training:
            return self.drop(x)
        with self.tracker.fork():
            return self.drop(x)

    def extra_repr(self) -> str:
        return f"sequence_parallel={self.sequence_parallel}"
