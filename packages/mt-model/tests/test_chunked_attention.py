"""mt-model's chunked causal attention (what a context-parallel rank computes): runs of queries
over the whole sequence's keys, fused calls merged by their log-sum-exps, equal to one causal
attention over the whole sequence (outputs and the gradients of queries, keys and values, in
fp32 round-off), with grouped-query heads, and without ever keeping an [L, S] mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mt_model.chunked_attention import chunked_causal_attention

S, D = 32, 8


def _tensors(heads: int, kv_heads: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, n, S, D, generator=gen) for n in (heads, kv_heads, kv_heads, heads)]


@pytest.mark.parametrize("runs", [((0, 8), (24, 32)), ((8, 16), (16, 24)), ((0, 32),),
                                  ((4, 8), (28, 32), (12, 16))])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_chunked_attention_equals_causal_attention(runs: tuple[tuple[int, int], ...],
                                                   heads: int, kv_heads: int) -> None:
    q, k, v, up = _tensors(heads, kv_heads)
    rows = torch.cat([torch.arange(a, b) for a, b in runs])
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=heads != kv_heads)
    want[:, :, rows].backward(up[:, :, :len(rows)])
    local = [q[:, :, rows].clone().requires_grad_(), k.clone().requires_grad_(),
             v.clone().requires_grad_()]
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        got = chunked_causal_attention(*local, runs)
    got.backward(up[:, :, :len(rows)])
    torch.testing.assert_close(got, want[:, :, rows].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(local[0].grad, full[0].grad[:, :, rows], rtol=1e-5, atol=1e-6)
    for name, mine, theirs in zip("kv", local[1:], full[1:]):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6, msg=name)
    # What backward keeps: q, k, v, the output and the log-sum-exp; no [L, S] mask or scores.
    assert max(saved) <= 2 * heads * S * D and len(saved) == 5


def test_any_memory_layout_gives_the_same_attention() -> None:
    """Queries whose head dimension is not contiguous (a projection computed without grad
    can come out so) give the same numbers: the fused kernel reads only unit strides."""
    q, k, v, _ = _tensors(4, 4)
    odd = q.transpose(2, 3).contiguous().transpose(2, 3)  # stride 1 along the sequence
    assert odd.stride(-1) != 1
    runs = ((8, 16), (16, 24))
    with torch.no_grad():
        want = chunked_causal_attention(q[:, :, 8:24].contiguous(), k, v, runs)
        got = chunked_causal_attention(odd[:, :, 8:24], k, v, runs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_runs_are_refused() -> None:
    q, k, v, _ = _tensors(4, 4)
    with pytest.raises(ValueError, match="do not cover the 32 queries"):
        chunked_causal_attention(q, k, v, ((0, 16),))
