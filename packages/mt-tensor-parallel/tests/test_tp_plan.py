"""Plans as data: pattern matching, parameter styles, and apply_tensor_parallel on a toy
model (column -> row MLP with a vocab embedding), real and on the meta device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mt_dist.testing import run_distributed
from mt_tensor_parallel import (
    GPT_PLAN,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    match_plan,
    param_styles,
    shard_tensor,
)

GPT_NAMES = ["embed", "embed.tokens", "embed.positions", "embed.drop", "blocks", "blocks.0",
             "blocks.0.ln1", "blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.attn.core",
             "blocks.0.attn.proj", "blocks.0.drop1", "blocks.0.ln2", "blocks.0.mlp",
             "blocks.0.mlp.fc", "blocks.0.mlp.act", "blocks.0.mlp.proj", "blocks.0.drop2",
             "blocks.1.attn.qkv", "ln_f", "head", "loss_fn"]


def test_tp_match_plan_segments() -> None:
    matched = match_plan(GPT_NAMES, GPT_PLAN)
    assert matched["blocks.0.attn.qkv"] == "column_qkv"
    assert matched["blocks.1.attn.qkv"] == "column_qkv"
    assert matched["embed"] == "gpt_embedding"
    assert "embed.tokens" not in matched and "blocks.0.mlp.act" not in matched
    # '*' is one segment: it does not reach into deeper names.
    assert match_plan(["a.b.c", "a.b"], {"a.*": "column"}, strict=False) == {"a.b": "column"}


def test_tp_match_plan_errors_name_the_pattern() -> None:
    with pytest.raises(ValueError, match=r"match no module of the model: \['blocks\.\*\.ffn'\]"):
        match_plan(GPT_NAMES, {**GPT_PLAN, "blocks.*.ffn": "column"})
    assert "blocks.*.ffn" not in match_plan(GPT_NAMES, {"blocks.*.ffn": "column"}, strict=False)
    with pytest.raises(ValueError, match="unknown styles in plan: {'head': 'diagonal'}"):
        match_plan(GPT_NAMES, {"head": "diagonal"})
    with pytest.raises(ValueError, match="matches several plan patterns"):
        match_plan(GPT_NAMES, {"blocks.0.ln1": "norm", "blocks.*.ln1": "norm"})
    with pytest.raises(ValueError, match="both 'embed' and its child 'embed.tokens'"):
        match_plan(GPT_NAMES, {"embed": "gpt_embedding", "embed.tokens": "vocab_embedding"})


def test_tp_param_styles_of_gpt_names() -> None:
    names = ["embed.tokens.weight", "embed.positions.weight", "blocks.3.attn.qkv.weight",
             "blocks.3.attn.qkv.bias", "blocks.3.attn.proj.weight", "blocks.3.attn.proj.bias",
             "blocks.3.mlp.fc.bias", "blocks.3.mlp.proj.weight", "blocks.3.ln1.weight",
             "ln_f.bias"]
    assert param_styles(names, GPT_PLAN) == {
        "embed.tokens.weight": "vocab", "embed.positions.weight": "replicate",
        "blocks.3.attn.qkv.weight": "column_qkv", "blocks.3.attn.qkv.bias": "column_qkv",
        "blocks.3.attn.proj.weight": "row", "blocks.3.attn.proj.bias": "replicate",
        "blocks.3.mlp.fc.bias": "column", "blocks.3.mlp.proj.weight": "row",
        "blocks.3.ln1.weight": "replicate", "ln_f.bias": "replicate",
    }


class Toy(nn.Module):
    """Embedding -> column -> GeLU -> row: the smallest model a plan can slice."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        with torch.random.fork_rng():  # same weights every time, global RNG untouched
            torch.manual_seed(0)
            self.emb = nn.Embedding(300, 16, device=device)
            self.fc = nn.Linear(16, 32, device=device)
            self.proj = nn.Linear(32, 16, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.nn.functional.gelu(self.fc(self.emb(ids))))


TOY_PLAN = {"emb": "vocab_embedding", "fc": "column", "proj": "row"}


def _apply_toy() -> dict[str, object]:
    group, rank, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = Toy()
    want = ref(ids)
    want.sum().backward()
    model = apply_tensor_parallel(Toy(), group, TOY_PLAN)
    out = model(ids)
    out.sum().backward()
    styles = param_styles([name for name, _ in ref.named_parameters()], TOY_PLAN)
    grads_ok = all(
        torch.allclose(p.grad, shard_tensor(styles[name], ref.get_parameter(name).grad, rank, n),
                       rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters())
    meta = apply_tensor_parallel(Toy(device="meta"), group, TOY_PLAN)
    return {
        "types": [type(m).__name__ for m in (model.emb, model.fc, model.proj)],
        "out_err": (out - want).abs().max().item(), "grads_ok": grads_ok,
        "meta": {name: (p.is_meta, tuple(p.shape)) for name, p in meta.named_parameters()},
    }


def test_tp_apply_plan_to_toy_model() -> None:
    for rank, result in enumerate(run_distributed(_apply_toy, 2, timeout=120)):
        assert result["types"] == [VocabParallelEmbedding.__name__,
                                   ColumnParallelLinear.__name__, RowParallelLinear.__name__]
        assert result["out_err"] < 1e-5, rank
        assert result["grads_ok"], rank
        assert result["meta"] == {
            "emb.weight": (True, (256, 16)),  # 300 padded to a multiple of 128 x 2: 512 rows
            "fc.weight": (True, (16, 16)), "fc.bias": (True, (16,)),
            "proj.weight": (True, (16, 16)), "proj.bias": (True, (16,)),
        }


def test_tp_apply_plan_rejects_wrong_module_types() -> None:
    with pytest.raises(TypeError, match="style 'row' needs an nn.Linear, got Embedding"):
        apply_tensor_parallel(Toy(), None, {"emb": "row"})
    with pytest.raises(ValueError, match=r"match no module of the model: \['mlp'\]"):
        apply_tensor_parallel(Toy(), None, {"mlp": "column"})


class _Loss(nn.Module):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_tp_vocab_cross_entropy_style_needs_a_vocab_size() -> None:
    model = nn.ModuleDict({"loss_fn": _Loss()})
    with pytest.raises(ValueError, match="needs the vocabulary size"):
        apply_tensor_parallel(model, None, {"loss_fn": "vocab_cross_entropy"})
    apply_tensor_parallel(model, None, {"loss_fn": "vocab_cross_entropy"}, vocab_size=5)
    logits, targets = torch.randn(2, 3, 128), torch.randint(0, 5, (2, 3))
    want = torch.nn.functional.cross_entropy(logits[..., :5].flatten(0, 1), targets.flatten())
    torch.testing.assert_close(model["loss_fn"](logits, targets), want)
