"""The output projection and the cross entropy in one, by chunks of tokens, so that no
[tokens, vocab] tensor is ever held: neither the logits nor their float32 upcast nor their
gradient, forward or backward. Each chunk's logits are computed, reduced to its tokens'
log-sum-exp (kept: 4 bytes a token) and dropped; the backward recomputes them chunk by chunk.

The same code serves a vocabulary split over tensor-parallel ranks: ``weight`` is then this
rank's rows of the (padded) vocabulary, starting at ``vocab_start``, and ``reduce`` sums or
takes the maximum of a tensor over the ranks (mt-tensor-parallel passes its group's
all-reduce; the caller also sums the hidden states' gradient over the ranks, as a
vocabulary-parallel head does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["Reduce", "chunk_tokens", "linear_cross_entropy"]

#: ``reduce(tensor, op)`` with op "sum" or "max": the tensor reduced over the ranks that hold
#: the other parts of the vocabulary (in place or not), or returned as it is on one rank.
Reduce = Callable[[torch.Tensor, str], torch.Tensor]

#: Bytes of float32 logits one chunk may hold (64 MiB: 330 tokens of GPT-2's vocabulary).
CHUNK_BYTES = 64 << 20


def chunk_tokens(vocab_local: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: as many as keep a chunk's float32 logits within ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_local))


def _alone(tensor: torch.Tensor, _op: str) -> torch.Tensor:
    return tensor


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss of ``hidden @ weight.T`` against global ``targets``, chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                vocab_size: int, vocab_start: int, reduce: Reduce, chunk: int,
                ignore_index: int) -> torch.Tensor:
        width = weight.shape[0]
        real = max(0, min(width, vocab_size - vocab_start))  # this part's real tokens
        lse = torch.empty(hidden.shape[0], device=hidden.device,
                          dtype=torch.promote_types(hidden.dtype, torch.float32))
        loss = torch.empty_like(lse)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            x = _logits(hidden[rows], weight, real)
            row_max = reduce(x.max(dim=-1).values, "max")
            local = targets[rows] - vocab_start
            mine = (local >= 0) & (local < real)
            picked = x.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
            sums = reduce(torch.stack([(x - row_max.unsqueeze(-1)).exp().sum(dim=-1),
                                       torch.where(mine, picked, 0.0)]), "sum")
            lse[rows] = row_max + torch.log(sums[0])
            loss[rows] = torch.where(targets[rows] != ignore_index, lse[rows] - sums[1], 0.0)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.args = (real, vocab_start, chunk, ignore_index)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        real, vocab_start, chunk, ignore_index = ctx.args
        width = weight.shape[0]
        grad_hidden = torch.empty_like(hidden)
        wide = torch.promote_types(weight.dtype, torch.float32)  # where grad_weight sums
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            # d loss / d logits = softmax - one_hot(target), times the token's gradient.
            p = (_logits(hidden[rows], weight, real) - lse[rows].unsqueeze(-1)).exp_()
            local = targets[rows] - vocab_start
            mine = (local >= 0) & (local < real)
            p.scatter_add_(-1, local.clamp(0, width - 1).unsqueeze(-1),
                           -mine.to(p.dtype).unsqueeze(-1))
            p.mul_((grad[rows] * (targets[rows] != ignore_index)).unsqueeze(-1))
            g = p.to(hidden.dtype)  # the logits' gradient in their own dtype, as unchunked
            grad_hidden[rows] = g @ weight
            grad_weight.addmm_(g.t().to(wide), hidden[rows].to(wide))
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, real: int) -> torch.Tensor:
    """One chunk's logits, at least float32, padding columns at -inf (no mass, no
    gradient)."""
    x = F.linear(hidden, weight)
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if real < x.shape[-1]:
        x[..., real:] = float("-inf")
    return x


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         *, vocab_size: int | None = None, vocab_start: int = 0,
                         reduce: Reduce | None = None, chunk: int | None = None,
                         ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of the logits ``hidden @ weight.T`` ([..., hidden] x [vocab, hidden])
    against token ids ``targets`` [...], equal to ``F.cross_entropy`` of those logits upcast
    to float32, without holding them: ``chunk`` tokens at a time (default: 64 MiB of
    float32 logits). ``vocab_size``: the real vocabulary (rows past it are padding);
    ``weight`` holds rows ``vocab_start ...`` of it and ``reduce`` combines the ranks holding
    the rest (see the module). ``reduction``: "mean" (over the tokens not ignored), "sum" or
    "none"; the loss is float32 (or wider)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    ids = targets.reshape(-1)
    per_token = _LinearCrossEntropy.apply(
        flat, weight, ids, vocab_size if vocab_size is not None else weight.shape[0],
        vocab_start, reduce or _alone, chunk or chunk_tokens(weight.shape[0]), ignore_index)
    if reduction == "none":
        return per_token.reshape(targets.shape)
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (ids != ignore_index).sum()
