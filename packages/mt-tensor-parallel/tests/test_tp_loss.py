"""mt-tensor-parallel's chunked output projection + cross entropy against the unchunked one
(``F.cross_entropy`` of ``F.linear``'s logits upcast to float32): the loss and the gradients
of the hidden states and of the weight, for any chunking, with padding rows, ignored tokens
and every reduction; and that no [tokens, vocab] tensor is held between forward and
backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mt_tensor_parallel.loss import chunk_tokens, linear_cross_entropy

TOKENS, HIDDEN, VOCAB, PADDED = 50, 16, 37, 40
#: float32 round-off of a gradient element: a sum over the tokens of terms of order 1, in
#: another order (the float64 test below shows the maths exact).
ROUND_OFF = TOKENS * torch.finfo(torch.float32).eps


def _inputs(dtype: torch.dtype = torch.float32, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, TOKENS // 2, HIDDEN, generator=gen).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(PADDED, HIDDEN, generator=gen)).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=gen)
    targets[0, :3] = -100  # ignored
    return hidden, weight, targets


def _reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
               reduction: str) -> torch.Tensor:
    logits = F.linear(hidden, weight)[..., :VOCAB].float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                           reduction=reduction).reshape(-1 if reduction == "none" else ())


@pytest.mark.parametrize("chunk", [1, 7, TOKENS, None])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_equals_the_unchunked_loss_and_gradients(chunk: int | None, reduction: str) -> None:
    h1, w1, t = _inputs()
    h2, w2, _ = _inputs()
    ours = linear_cross_entropy(h1, w1, t, vocab_size=VOCAB, chunk=chunk, reduction=reduction)
    ref = _reference(h2, w2, t, reduction)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.reshape(ref.shape), ref, rtol=1e-6, atol=1e-6)
    seed = torch.linspace(0.5, 1.5, ours.numel()).reshape(ours.shape)
    (ours * seed).sum().backward()
    (ref * seed.reshape(ref.shape)).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=ROUND_OFF)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=ROUND_OFF)
    assert w1.grad[VOCAB:].abs().max() == 0  # padding rows get no gradient


def test_float64_is_exact_to_float64_round_off() -> None:
    h1, w1, t = _inputs(torch.float64)
    h2, w2, _ = _inputs(torch.float64)
    ours = linear_cross_entropy(h1, w1, t, vocab_size=VOCAB, chunk=9)
    logits = F.linear(h2, w2)[..., :VOCAB]
    ref = F.cross_entropy(logits.reshape(-1, VOCAB), t.reshape(-1))
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12)


def test_bf16_matches_the_unchunked_bf16_path() -> None:
    """bf16 hidden states and weight: the logits in bf16, their maths in float32, as the
    unchunked head + LMLoss do; the gradients in bf16 within bf16 round-off of them."""
    h1, w1, t = _inputs(torch.bfloat16)
    h2, w2, _ = _inputs(torch.bfloat16)
    ours = linear_cross_entropy(h1, w1, t, vocab_size=VOCAB, chunk=8)
    ref = _reference(h2, w2, t, "mean")
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)  # the same float32 maths
    ours.backward()
    ref.backward()
    assert h1.grad.dtype == w1.grad.dtype == torch.bfloat16
    torch.testing.assert_close(h1.grad.float(), h2.grad.float(), rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(w1.grad.float(), w2.grad.float(), rtol=1e-2, atol=1e-4)


def test_no_tokens_by_vocab_tensor_is_saved_for_backward() -> None:
    vocab = 5000
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(vocab, 8, requires_grad=True)
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = linear_cross_entropy(hidden, weight, torch.randint(0, vocab, (64,)), chunk=16)
    assert all(s.numel() < 64 * vocab for s in saved) and torch.Size([64, vocab]) not in saved
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None
    assert chunk_tokens(50304) == (64 << 20) // (4 * 50304)
