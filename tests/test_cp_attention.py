"""Context parallelism, first layers: mt-model's attention core with mt-tensor-parallel's
``ContextParallel`` on 2 and 4 real gloo ranks computes, for each rank's slice of the sequence
(two chunks, causally balanced), the outputs and the query / key / value gradients of one
process's attention over the whole sequence (fp32 round-off), with learned positions (GPT-2)
and with rotary positions and grouped-query heads (Llama); and a whole model so split gives
one process's loss and parameter gradients (the loss summed over the ranks' tokens, the
gradients summed over the CP group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mt_dist.testing import run_distributed
from mt_model import GPT, preset
from mt_model.gpt import CoreAttention
from mt_tensor_parallel.context import (
    ContextParallel,
    attach_context,
    cp_chunks,
    cp_positions,
    shard_sequence,
    unshard_sequence,
)

SEQ = 32


def _inputs(name: str) -> tuple[CoreAttention, list[torch.Tensor]]:
    """The core of ``name``'s attention and random q, k, v and an upstream gradient [2, SEQ, .]."""
    config = preset(name)
    core = CoreAttention(config.head_dim, 0.0, config.rope_theta if config.position == "rope"
                         else None)
    gen = torch.Generator().manual_seed(3)
    widths = (config.hidden, config.n_kv_heads * config.head_dim,
              config.n_kv_heads * config.head_dim, config.hidden)
    return core, [torch.randn(2, SEQ, w, generator=gen, dtype=torch.float64).float()
                  for w in widths]


def _rank(name: str) -> dict[str, torch.Tensor]:
    core, (q, k, v, up) = _inputs(name)
    cp, rank = dist.get_world_size(), dist.get_rank()
    core.context = ContextParallel(dist.group.WORLD, SEQ)
    local = [shard_sequence(t, cp, rank).requires_grad_() for t in (q, k, v)]
    out = core(*local)
    out.backward(shard_sequence(up, cp, rank))
    return {"out": out.detach(), **{n: t.grad for n, t in zip("qkv", local)}}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", ["tiny", "llama-test"])
def test_cp_attention_equals_one_process(name: str, cp: int) -> None:
    core, (q, k, v, up) = _inputs(name)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = core(*full)
    want.backward(up)
    ranks = run_distributed(_rank, cp, name, timeout=120)
    got = {key: unshard_sequence([r[key] for r in ranks]) for key in ("out", "q", "k", "v")}
    torch.testing.assert_close(got["out"], want.detach(), rtol=1e-5, atol=1e-6)
    for key, t in zip("qkv", full):
        torch.testing.assert_close(got[key], t.grad, rtol=1e-5, atol=1e-6, msg=key)


def test_the_slices_balance_causal_work_and_cover_the_sequence() -> None:
    assert cp_chunks(16, 2, 0) == ((0, 4), (12, 16))
    assert cp_chunks(16, 2, 1) == ((4, 8), (8, 12))
    for cp in (1, 2, 4):
        slices = [cp_positions(32, cp, r) for r in range(cp)]
        assert sorted(p for s in slices for p in s) == list(range(32))
        # Causal work of a rank: the keys its queries see, equal on every rank.
        assert len({sum(p + 1 for p in s) for s in slices}) == 1
    x = torch.arange(2 * 32).reshape(2, 32)
    assert torch.equal(unshard_sequence([shard_sequence(x, 4, r) for r in range(4)]), x)
    with pytest.raises(ValueError, match="sequence length 30 is not divisible by 2 x cp = 8"):
        cp_chunks(30, 4, 0)


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return (torch.randint(0, vocab, (2, SEQ), generator=gen),
            torch.randint(0, vocab, (2, SEQ), generator=gen))


def _model_rank(name: str) -> dict[str, torch.Tensor]:
    cp, rank = dist.get_world_size(), dist.get_rank()
    model = GPT(preset(name).replace(seq_len=SEQ))
    context = ContextParallel(dist.group.WORLD, SEQ)
    # Every attention core, and the embedding (the slice's positions).
    assert attach_context(model, context) == model.config.n_layers + 1
    idx, targets = (shard_sequence(t, cp, rank) for t in _batch(model.config.vocab_size))
    logits = model(idx)
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    (total / targets.numel() / cp).backward()  # the mean over every rank's tokens
    dist.all_reduce(total)
    grads = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)  # every rank's tokens' share, as data parallelism sums
        grads[n] = p.grad
    return {"loss": total / (targets.numel() * cp), **grads}


@pytest.mark.parametrize("name", ["tiny", "llama-test"])
def test_a_cp2_model_trains_like_one_process(name: str) -> None:
    model = GPT(preset(name).replace(seq_len=SEQ))
    idx, targets = _batch(model.config.vocab_size)
    loss = model(idx, targets)
    loss.backward()
    got = run_distributed(_model_rank, 2, name, timeout=120)[0]
    torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
