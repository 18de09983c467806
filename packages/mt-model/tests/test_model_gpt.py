"""Forward pass, module-name contract, causality, loss, tied weights, training, bf16."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.nn.functional as F

from mt_model import GPT, CoreAttention, LMHead, count_parameters, preset

TINY = preset("tiny")


def _batch(seed: int, batch: int = 2, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY.vocab_size, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def test_forward_shapes_and_loss_mode() -> None:
    model = GPT(TINY)
    idx, targets = _batch(0, batch=3, seq=TINY.seq_len)
    logits = model(idx)
    assert logits.shape == (3, TINY.seq_len, TINY.vocab_size)
    assert logits.dtype == torch.float32
    loss = model(idx, targets)
    assert loss.shape == () and torch.isfinite(loss)
    # An untrained model with std ~0.07 init predicts roughly uniformly.
    assert abs(loss.item() - torch.log(torch.tensor(1000.0)).item()) < 0.5


def test_module_names_are_the_contract() -> None:
    model = GPT(TINY)
    names = dict(model.named_parameters())
    block = {
        "ln1.weight": (64,), "ln1.bias": (64,),
        "attn.qkv.weight": (192, 64), "attn.qkv.bias": (192,),
        "attn.proj.weight": (64, 64), "attn.proj.bias": (64,),
        "ln2.weight": (64,), "ln2.bias": (64,),
        "mlp.fc.weight": (256, 64), "mlp.fc.bias": (256,),
        "mlp.proj.weight": (64, 256), "mlp.proj.bias": (64,),
    }
    expected = {"embed.tokens.weight": (1000, 64), "embed.positions.weight": (64, 64),
                "ln_f.weight": (64,), "ln_f.bias": (64,)}
    for i in range(TINY.n_layers):
        expected.update({f"blocks.{i}.{k}": v for k, v in block.items()})
    assert {k: tuple(v.shape) for k, v in names.items()} == expected
    modules = dict(model.named_modules())
    for name in ("embed.drop", "blocks.0.attn.core", "blocks.3.drop1", "blocks.3.drop2",
                 "head", "loss_fn"):
        assert name in modules
    assert isinstance(model.head, LMHead)
    assert isinstance(model.blocks[0].attn.core, CoreAttention)


def test_tied_embedding_is_one_parameter() -> None:
    model = GPT(TINY)
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == count_parameters(TINY)
    assert sum(1 for p in params if p.shape == (TINY.vocab_size, TINY.hidden)) == 1
    assert list(model.head.parameters()) == []
    idx, _ = _batch(1)
    hidden = model.ln_f(torch.nn.Sequential(*model.blocks)(model.embed(idx)))
    assert torch.allclose(model(idx), hidden @ model.embed.tokens.weight.T, atol=1e-6, rtol=0)
    # Gradients of both uses accumulate into the single tied matrix.
    model(idx).sum().backward()
    assert model.embed.tokens.weight.grad is not None


def test_stage_wise_composition_equals_forward() -> None:
    """A pipeline stage calls the submodules separately; the result must be identical."""
    model = GPT(TINY)
    idx, targets = _batch(2)
    x = model.embed(idx)
    for block in model.blocks[:2]:
        x = block(x)
    for block in model.blocks[2:]:
        x = block(x)
    logits = model.head(model.ln_f(x), model.embed.tokens.weight)
    assert torch.equal(model.loss_fn(logits, targets), model(idx, targets))


def test_causal_future_tokens_do_not_change_the_past() -> None:
    model = GPT(TINY)
    idx, _ = _batch(3, seq=20)
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 7) % TINY.vocab_size
    before, after = model(idx), model(changed)
    assert torch.allclose(before[:, :12], after[:, :12], atol=1e-6, rtol=0)
    assert not torch.allclose(before[:, 12:], after[:, 12:], atol=1e-3)


def test_loss_equals_cross_entropy_of_logits() -> None:
    model = GPT(TINY)
    idx, targets = _batch(4)
    logits = model(idx)
    reference = F.cross_entropy(logits.reshape(-1, TINY.vocab_size), targets.reshape(-1))
    assert torch.allclose(model(idx, targets), reference, atol=1e-6, rtol=0)
    masked = targets.clone()
    masked[:, :5] = -100  # ignored positions do not count, as in F.cross_entropy
    reference = F.cross_entropy(logits.reshape(-1, TINY.vocab_size), masked.reshape(-1))
    assert torch.allclose(model(idx, masked), reference, atol=1e-6, rtol=0)


def test_core_attention_takes_head_count_from_width() -> None:
    """What a tensor-parallel rank does: run the same core on a slice of the heads."""
    core = CoreAttention(head_dim=8)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 10, 4 * 8, generator=gen) for _ in range(3))
    full = core(q, k, v)
    half = core(q[..., 16:], k[..., 16:], v[..., 16:])
    assert torch.allclose(full[..., 16:], half, atol=1e-6)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        core(q[..., :12], k[..., :12], v[..., :12])


def test_sequence_longer_than_positions_is_rejected() -> None:
    model = GPT(TINY)
    with pytest.raises(ValueError, match="65 exceeds the model's seq_len 64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_dropout_only_in_training() -> None:
    cfg = TINY.replace(dropout=0.2, attention_dropout=0.2)
    model = GPT(cfg)
    idx, _ = _batch(6)
    model.eval()
    assert torch.equal(model(idx), model(idx))
    model.train()
    torch.manual_seed(0)
    first = model(idx)
    assert not torch.allclose(first, model(idx))


def test_adamw_reduces_loss_on_a_repeated_batch() -> None:
    torch.manual_seed(0)
    model = GPT(TINY.replace(n_layers=2))
    idx, targets = _batch(7, batch=4, seq=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for _ in range(10):
        loss = model(idx, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_bf16_forward_close_to_fp32() -> None:
    """bf16 has an 8-bit mantissa (~3 significant digits); through 4 blocks the logits
    stay within 0.05 absolute (logits are O(1)) and the loss within 1% of fp32."""
    model = GPT(TINY)
    idx, targets = _batch(8, seq=TINY.seq_len)
    logits32, loss32 = model(idx), model(idx, targets)
    model.to(torch.bfloat16)
    logits16, loss16 = model(idx), model(idx, targets)
    assert logits16.dtype == torch.bfloat16 and loss16.dtype == torch.float32
    assert (logits16.float() - logits32).abs().max().item() < 0.05
    assert abs(loss16.item() - loss32.item()) < 0.01 * loss32.item()
    loss16.backward()
    assert model.embed.tokens.weight.grad.dtype == torch.bfloat16


def test_tanh_gelu_option_changes_only_the_activation() -> None:
    exact = GPT(TINY)
    approx = GPT(TINY.replace(gelu_approximate="tanh"))
    assert approx.blocks[0].mlp.act.approximate == "tanh"
    idx, _ = _batch(9)
    diff = (exact(idx) - approx(idx)).abs().max().item()
    assert 0.0 < diff < 1e-2


def test_package_imports_no_distributed_and_no_other_mt_package() -> None:
    src = pathlib.Path(__file__).resolve().parents[1] / "src" / "mt_model"
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                assert not module.startswith("torch.distributed"), (path, module)
                assert not module.startswith("mt_") or module.startswith("mt_model"), (
                    path, module)
