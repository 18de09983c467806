"""Deterministic per-parameter init: purity, build-order/device independence, statistics."""

from __future__ import annotations

import math

import pytest
import torch

from mt_model import GPT, init_gpt_, init_parameter, init_std_for, parameter_seed, preset

TINY = preset("tiny")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_same_seed_same_values_other_seed_other_values() -> None:
    torch.manual_seed(1)
    a = _state(GPT(TINY, seed=3))
    torch.manual_seed(2)  # the global RNG must not matter
    b = _state(GPT(TINY, seed=3))
    c = _state(GPT(TINY, seed=4))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])
    assert torch.equal(a["ln_f.weight"], c["ln_f.weight"])  # constants are seed-free


def test_init_parameter_is_pure_and_per_name() -> None:
    first = init_parameter("blocks.1.mlp.fc.weight", (256, 64), TINY, seed=0)
    again = init_parameter("blocks.1.mlp.fc.weight", [256, 64], TINY, seed=0)
    other = init_parameter("blocks.2.mlp.fc.weight", (256, 64), TINY, seed=0)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert first.device.type == "cpu" and first.dtype == torch.float32
    as_bf16 = init_parameter("blocks.1.mlp.fc.weight", (256, 64), TINY, 0, torch.bfloat16)
    assert torch.equal(as_bf16, first.to(torch.bfloat16))
    assert parameter_seed(0, "x") == parameter_seed(0, "x") != parameter_seed(1, "x")


def test_values_do_not_depend_on_layer_count() -> None:
    """A pipeline stage (or a shallower model) gets the same values for the same names.

    Output projections are scaled by 1/sqrt(2 * n_layers), so there the underlying draws
    are the same and only the scale differs."""
    shallow = _state(GPT(TINY.replace(n_layers=2), seed=11))
    deep = _state(GPT(TINY, seed=11))
    for name, value in shallow.items():
        if name.endswith("proj.weight"):
            ratio = math.sqrt((2 * 2) / (2 * 4))  # std(4 layers) / std(2 layers)
            assert torch.allclose(deep[name], value * ratio, rtol=1e-6, atol=0), name
        else:
            assert torch.equal(deep[name], value), name


def test_values_do_not_depend_on_construction_order() -> None:
    model = GPT(TINY, seed=None)
    reversed_params = list(model.named_parameters())[::-1]
    with torch.no_grad():  # initialise parameter by parameter in reverse order
        for name, param in reversed_params:
            param.copy_(init_parameter(name, param.shape, TINY, seed=5))
    expected = _state(GPT(TINY, seed=5))
    for name, value in _state(model).items():
        assert torch.equal(value, expected[name]), name


def test_meta_build_then_to_empty_equals_cpu_build() -> None:
    with torch.device("meta"):
        model = GPT(TINY, seed=7)  # init is skipped on meta
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ValueError, match="meta device"):
        init_gpt_(model, seed=7)
    model.to_empty(device="cpu")
    init_gpt_(model, seed=7)
    reference = GPT(TINY, seed=7)
    for (name, value), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(value, ref), name
    idx = torch.arange(10).reshape(1, 10)
    assert torch.equal(model(idx), reference(idx))


def test_a_meta_build_stays_cheap() -> None:
    """Building on the meta device (how mt learns shapes: every conversion, every stage it
    materialises) runs no init there: torch's meta ``normal_`` goes through its Python
    reference, whose first call imports ``torch._dynamo`` (about a second per process).
    A fresh interpreter shows it; the parameters are those of a CPU build."""
    import subprocess
    import sys

    probe = ("import sys, torch\n"
             "from mt_model import GPT, preset\n"
             "with torch.device('meta'):\n"
             "    model = GPT(preset('tiny'), seed=None)\n"
             "print('torch._dynamo' in sys.modules)\n"
             "print(sorted((n, tuple(p.shape), p.requires_grad) for n, p in "
             "model.named_parameters()))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    expected = sorted((n, tuple(p.shape), p.requires_grad)
                      for n, p in GPT(TINY, seed=None).named_parameters())
    assert out[0] == "False" and out[1] == str(expected)


def test_init_in_bf16_is_the_rounded_fp32_init() -> None:
    model = GPT(TINY, seed=None).to(torch.bfloat16)
    init_gpt_(model, seed=2)
    reference = GPT(TINY, seed=2)
    for (name, value), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, ref.to(torch.bfloat16)), name


def test_mt_nlg_statistics() -> None:
    cfg = TINY.replace(hidden=256, n_heads=8, n_layers=6, vocab_size=4000)
    std = math.sqrt(1.0 / (3 * 256))
    params = dict(GPT(cfg, seed=0).named_parameters())
    for name in ("embed.tokens.weight", "embed.positions.weight", "blocks.0.attn.qkv.weight",
                 "blocks.5.mlp.fc.weight"):
        value = params[name]
        assert abs(value.mean().item()) < 0.05 * std, name
        assert value.std().item() == pytest.approx(std, rel=0.05), name
    for name in ("blocks.0.attn.proj.weight", "blocks.3.mlp.proj.weight"):
        assert params[name].std().item() == pytest.approx(std / math.sqrt(12), rel=0.05), name
    for name, value in params.items():
        if name.endswith(".bias"):
            assert torch.count_nonzero(value) == 0, name
        if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
            assert torch.equal(value, torch.ones_like(value)), name
    unscaled = cfg.replace(scaled_output_init=False, init_std=0.02)
    assert init_std_for("blocks.0.attn.proj.weight", unscaled) == 0.02
    assert init_std_for("blocks.0.attn.proj.weight", cfg) == pytest.approx(std / math.sqrt(12))


def test_unknown_parameter_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="blocks.0.attn.rotary.weight"):
        init_parameter("blocks.0.attn.rotary.weight", (4, 4), TINY, seed=0)
    with pytest.raises(TypeError, match="GPTConfig"):
        init_gpt_(torch.nn.Linear(2, 2), seed=0)
