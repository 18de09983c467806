"""Vocabulary-parallel embedding, tied LM head and cross entropy.

The vocabulary is padded to a multiple of ``pad_multiple * tp`` (zero rows) and every TP
rank owns a contiguous range of rows. The embedding looks up the ids in its range and the
partial results are summed over ranks; the head multiplies by the local rows only, giving
logits for the local vocabulary slice; the cross entropy combines per-rank max, sum of
exponentials and target logit with all-reduces of [b, s]-sized tensors, so the full
[b, s, vocab] logits never exist on any rank. Padding columns are excluded from the softmax.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from mt_dist.collectives import all_reduce, group_rank, group_size
from mt_tensor_parallel.loss import linear_cross_entropy
from mt_tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)
from mt_tensor_parallel.sharding import (
    DEFAULT_PAD_MULTIPLE,
    padded_vocab_size,
    shard_tensor,
    vocab_range,
)

__all__ = [
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "VocabParallelCrossEntropy",
    "gather_vocab_logits",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_logprobs",
]


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with rows split over the TP group.

    ``weight`` is this rank's [padded_vocab / tp, dim] slice (padding rows are zero).
    ``reduce``: ``"all"`` (default) returns the replicated [b, s, dim] embedding,
    ``"sequence"`` this rank's summed sequence slice [b, s/tp, dim] (sequence parallelism),
    ``"none"`` the un-summed partial lookup.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: ProcessGroup | None, *,
                 pad_multiple: int = DEFAULT_PAD_MULTIPLE, reduce: str = "all",
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if reduce not in ("all", "sequence", "none"):
            raise ValueError(f"reduce must be 'all', 'sequence' or 'none', got {reduce!r}")
        self.group = group
        self.tp_size, self.tp_rank = group_size(group), group_rank(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.pad_multiple, self.reduce = pad_multiple, reduce
        self.padded_vocab = padded_vocab_size(num_embeddings, self.tp_size, pad_multiple)
        self.vocab_start, self.vocab_end = vocab_range(self.padded_vocab, self.tp_rank,
                                                       self.tp_size)
        data = torch.empty((self.vocab_end - self.vocab_start, embedding_dim), device=device,
                           dtype=dtype)
        if not data.is_meta:
            data.zero_()
        self.weight = nn.Parameter(data)

    param_style = "vocab"

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of the unpadded [num_embeddings, dim] ``weight``."""
        self.weight.copy_(shard_tensor("vocab", weight, self.tp_rank, self.tp_size,
                                       pad_multiple=self.pad_multiple))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: ProcessGroup | None, *,
                       pad_multiple: int = DEFAULT_PAD_MULTIPLE, reduce: str = "all"
                       ) -> VocabParallelEmbedding:
        """The slice of an existing ``nn.Embedding`` (same device and dtype)."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group,
                    pad_multiple=pad_multiple, reduce=reduce,
                    device=embedding.weight.device, dtype=embedding.weight.dtype)
        if not embedding.weight.is_meta:
            layer.load_full_(embedding.weight)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            partial = F.embedding(idx, self.weight)
        else:
            outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
            local = (idx - self.vocab_start).masked_fill(outside, 0)
            partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce == "all":
            return reduce_from_tp(partial, self.group)
        if self.reduce == "sequence":
            return reduce_scatter_to_sequence(partial, self.group)
        return partial

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.padded_vocab}), {self.embedding_dim}, "
            f"rows [{self.vocab_start}, {self.vocab_end}), reduce={self.reduce}"
        )


class VocabParallelHead(nn.Module):
    """Output projection: ``forward(hidden, weight)`` with ``weight`` this rank's vocabulary
    rows of the tied embedding, or (untied) its own rows; returns logits for the local
    vocabulary slice [b, s, padded_vocab/tp].

    With ``sequence_parallel`` the hidden states [b, s/tp, h] are all-gathered first; the
    reduce-scatter of that gather's backward sums the partial input gradients, so the
    copy_to_tp of the replicated case is not needed on top.
    """

    def __init__(self, group: ProcessGroup | None, sequence_parallel: bool = False,
                 weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.weight = None if weight is None else nn.Parameter(weight)

    param_style = "vocab"

    @classmethod
    def from_head(cls, head: nn.Module, group: ProcessGroup | None,
                  sequence_parallel: bool = False,
                  pad_multiple: int = DEFAULT_PAD_MULTIPLE) -> VocabParallelHead:
        """The parallel version of a head: tied (no weight: ``forward`` is given this rank's
        embedding rows), or untied with its own ``weight`` [vocab, hidden], of which this
        rank keeps its padded vocabulary rows."""
        full = getattr(head, "weight", None)
        if full is None:
            return cls(group, sequence_parallel)
        shard = shard_tensor("vocab", full.detach(), group_rank(group), group_size(group),
                             pad_multiple=pad_multiple)
        return cls(group, sequence_parallel, shard)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.sequence_parallel:
            hidden = gather_from_sequence(hidden, self.group)
        else:
            hidden = copy_to_tp(hidden, self.group)
        return F.linear(hidden, self.weight if weight is None else weight)

    def extra_repr(self) -> str:
        return f"sequence_parallel={self.sequence_parallel}"


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross entropy of vocabulary-sharded logits (fp32 maths)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor,
                group: ProcessGroup | None, vocab_size: int, ignore_index: int
                ) -> torch.Tensor:
        width = logits.shape[-1]
        start = group_rank(group) * width
        real = max(0, min(width, vocab_size - start))  # local columns that are real tokens
        # At least float32 maths (bf16 logits are upcast); float64 stays float64.
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if real < width:
            x = x.clone()
            x[..., real:] = float("-inf")  # padding: no probability mass, no gradient
        # The global max only stabilises the exponentials; it carries no gradient.
        row_max = all_reduce(x.max(dim=-1).values, group, op=dist.ReduceOp.MAX)
        x = x - row_max.unsqueeze(-1)
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < real)
        index = local_t.clamp(0, width - 1).unsqueeze(-1)
        target_logit = torch.where(mine, x.gather(-1, index).squeeze(-1), 0.0)
        exp = x.exp_()
        # One all-reduce for both sums.
        sums = all_reduce(torch.stack([exp.sum(dim=-1), target_logit]), group)
        sum_exp, target_logit = sums[0], sums[1]
        valid = targets != ignore_index
        loss = torch.where(valid, torch.log(sum_exp) - target_logit, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # now the softmax
        ctx.save_for_backward(exp, index, mine, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, index, mine, valid = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target), masked by ignored tokens.
        grad_logits = softmax
        grad_logits.scatter_add_(-1, index, -mine.to(softmax.dtype).unsqueeze(-1))
        grad_logits.mul_((grad * valid).unsqueeze(-1))
        return grad_logits.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 group: ProcessGroup | None, vocab_size: int, *,
                                 ignore_index: int = -100, reduction: str = "mean"
                                 ) -> torch.Tensor:
    """Cross entropy of vocabulary-sharded ``logits`` [..., padded_vocab/tp] against global
    token ids ``targets`` [...], equal to ``F.cross_entropy`` over the first ``vocab_size``
    columns of the gathered logits. ``reduction``: ``"mean"`` (over non-ignored tokens),
    ``"sum"`` or ``"none"``. The result is at least float32 and identical on every TP rank.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    per_token = _VocabParallelCE.apply(logits, targets, group, vocab_size, ignore_index)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (targets != ignore_index).sum()


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                        targets: torch.Tensor, group: ProcessGroup | None,
                                        vocab_size: int, *, sequence_parallel: bool = False,
                                        chunk: int | None = None, ignore_index: int = -100,
                                        reduction: str = "mean") -> torch.Tensor:
    """The vocabulary-parallel head and cross entropy in one, chunk by chunk
    (:func:`mt_tensor_parallel.loss.linear_cross_entropy`): this rank's vocabulary rows ``weight``
    [padded_vocab/tp, hidden] times the hidden states [b, s, hidden] (with
    ``sequence_parallel``: this rank's [b, s/tp, hidden], gathered first), against global ids
    ``targets`` [b, s]; equal to :func:`vocab_parallel_cross_entropy` of the head's logits,
    without ever holding them. The same loss on every TP rank."""
    if sequence_parallel:
        hidden = gather_from_sequence(hidden, group)
    else:
        hidden = copy_to_tp(hidden, group)  # its backward sums the ranks' partial gradients

    def reduce(x: torch.Tensor, op: str) -> torch.Tensor:
        return all_reduce(x, group, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)

    return linear_cross_entropy(hidden, weight, targets, vocab_size=vocab_size,
                                vocab_start=group_rank(group) * weight.shape[0], reduce=reduce,
                                chunk=chunk, ignore_index=ignore_index, reduction=reduction)


@torch.no_grad()
def gather_vocab_logits(logits: torch.Tensor, group: ProcessGroup | None,
                        vocab_size: int) -> torch.Tensor:
    """The full logits [..., vocab_size] from vocabulary-sharded ``logits`` [...,
    padded_vocab/tp], the same on every TP rank (padding columns dropped): what a sampler
    draws from in decoding, where the logits are a few rows (the next token of each request).
    """
    size = group_size(group)
    if size > 1:
        parts = [torch.empty_like(logits) for _ in range(size)]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab_size]


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                            group: ProcessGroup | None, vocab_size: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each target token, whether it is the most likely token) from
    vocabulary-sharded ``logits`` [..., padded_vocab/tp] and global ids ``targets`` [...]:
    what an evaluation scores (``log_softmax(logits).gather(targets)`` and ``argmax ==
    target`` over the first ``vocab_size`` columns of the gathered logits), in float32 or
    wider, identical on every TP rank, with two all-reduces of [...]-sized tensors. A target
    tied with another token for the maximum counts as the most likely.
    """
    width = logits.shape[-1]
    start = group_rank(group) * width
    real = max(0, min(width, vocab_size - start))
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if real < width:
        x = x.clone()
        x[..., real:] = float("-inf")
    row_max = all_reduce(x.max(dim=-1).values, group, op=dist.ReduceOp.MAX)
    local_t = targets - start
    mine = (local_t >= 0) & (local_t < real)
    index = local_t.clamp(0, width - 1).unsqueeze(-1)
    target_logit = torch.where(mine, x.gather(-1, index).squeeze(-1), 0.0)
    sum_exp = (x - row_max.unsqueeze(-1)).exp().sum(dim=-1)
    sums = all_reduce(torch.stack([sum_exp, target_logit]), group)
    logprob = sums[1] - row_max - torch.log(sums[0])
    return logprob, sums[1] >= row_max


class VocabParallelCrossEntropy(nn.Module):
    """Module form of :func:`vocab_parallel_cross_entropy`: ``forward(logits, targets)``
    returns the mean token loss (a drop-in for a GPT's ``loss_fn``)."""

    def __init__(self, group: ProcessGroup | None, vocab_size: int,
                 ignore_index: int = -100) -> None:
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.group, self.vocab_size,
                                            ignore_index=self.ignore_index)

    def head_loss(self, head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
        """``forward(head(hidden, weight), targets)`` without the logits: the head's rows
        (``weight``, tied, or the head's own) and the loss in one, chunk by chunk
        (:func:`vocab_parallel_linear_cross_entropy`). ``head``: a
        :class:`VocabParallelHead` or, on one rank, any head with a ``weight``."""
        rows = weight if weight is not None else head.weight
        return vocab_parallel_linear_cross_entropy(
            hidden, rows, targets, self.group, self.vocab_size,
            sequence_parallel=getattr(head, "sequence_parallel", False),
            ignore_index=self.ignore_index)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, ignore_index={self.ignore_index}"
