"""GPTConfig validation, derived defaults, presets and dict round trips."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from mt_model import PRESETS, GPTConfig, GPTConfigError, preset


def test_derived_defaults_are_resolved() -> None:
    cfg = GPTConfig(n_layers=2, hidden=96, n_heads=6, vocab_size=50, seq_len=16)
    assert cfg.ffn_hidden == 384
    assert cfg.init_std == pytest.approx(math.sqrt(1.0 / (3 * 96)))
    assert cfg.head_dim == 16
    assert cfg.dropout == 0.0 and cfg.attention_dropout == 0.0
    assert cfg.layernorm_eps == 1e-5 and cfg.scaled_output_init is True
    assert cfg.gelu_approximate == "none"


def test_config_is_frozen() -> None:
    cfg = preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 128  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"hidden": 65}, ["hidden=65", "n_heads=4", "remainder 1"]),
        ({"n_layers": 0}, ["n_layers", "0"]),
        ({"vocab_size": -3}, ["vocab_size", "-3"]),
        ({"seq_len": 2.5}, ["seq_len", "2.5"]),
        ({"n_layers": True}, ["n_layers", "True"]),
        ({"ffn_hidden": 0}, ["ffn_hidden", "0"]),
        ({"dropout": 1.0}, ["dropout", "[0, 1)", "1.0"]),
        ({"attention_dropout": -0.1}, ["attention_dropout", "-0.1"]),
        ({"layernorm_eps": 0.0}, ["layernorm_eps", "0.0"]),
        ({"init_std": -0.02}, ["init_std", "-0.02"]),
        ({"gelu_approximate": "erf"}, ["gelu_approximate", "'erf'"]),
        ({"scaled_output_init": 1}, ["scaled_output_init", "1"]),
    ],
)
def test_invalid_values_are_named(overrides: dict, fragments: list[str]) -> None:
    base = dict(n_layers=2, hidden=64, n_heads=4, vocab_size=100, seq_len=32)
    with pytest.raises(GPTConfigError) as info:
        GPTConfig(**{**base, **overrides})
    for fragment in fragments:
        assert fragment in str(info.value)


def test_all_problems_reported_at_once() -> None:
    with pytest.raises(GPTConfigError) as info:
        GPTConfig(n_layers=-1, hidden=64, n_heads=4, vocab_size=0, seq_len=8, dropout=2.0)
    message = str(info.value)
    assert "n_layers" in message and "vocab_size" in message and "dropout" in message
    assert isinstance(info.value, ValueError)


def test_presets_match_published_shapes() -> None:
    expected = {
        "tiny": (4, 64, 4, 1000, 64),
        "gpt2-small": (12, 768, 12, 50257, 1024),
        "gpt2-medium": (24, 1024, 16, 50257, 1024),
        "gpt2-large": (36, 1280, 20, 50257, 1024),
        "gpt2-xl": (48, 1600, 25, 50257, 1024),
        "1.3b": (24, 2048, 16, 51200, 2048),
        "8.3b": (72, 3072, 24, 51200, 2048),
        "mt-nlg-530b": (105, 20480, 128, 51200, 2048),
    }
    llama = {"llama-test", "llama-3.2-1b", "llama-3.1-8b"}
    assert set(PRESETS) == set(expected) | llama
    for name, shape in expected.items():
        assert preset(name).architecture == "gpt2"
        cfg = preset(name)
        assert (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.vocab_size, cfg.seq_len) == shape
        assert cfg.ffn_hidden == 4 * cfg.hidden
    big = preset("mt-nlg-530b")
    assert big.head_dim == 160
    assert big.init_std == pytest.approx(math.sqrt(1.0 / (3 * 20480)))
    assert preset("tiny").dropout == 0.0


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(GPTConfigError) as info:
        preset("gpt5")
    assert "'gpt5'" in str(info.value)
    for name in PRESETS:
        assert name in str(info.value)


def test_presets_mapping_is_read_only() -> None:
    with pytest.raises(TypeError):
        PRESETS["mine"] = preset("tiny")  # type: ignore[index]


def test_replace_rederives_defaults_when_hidden_changes() -> None:
    tiny = preset("tiny")
    wider = tiny.replace(hidden=128)
    assert wider.ffn_hidden == 512
    assert wider.init_std == pytest.approx(math.sqrt(1.0 / 384))
    assert wider.n_layers == tiny.n_layers
    custom = tiny.replace(ffn_hidden=100, init_std=0.02).replace(hidden=128)
    assert custom.ffn_hidden == 100 and custom.init_std == 0.02
    explicit = tiny.replace(hidden=128, ffn_hidden=64)
    assert explicit.ffn_hidden == 64
    assert tiny.replace(n_layers=2).hidden == 64
    with pytest.raises(GPTConfigError, match="n_heads=4"):
        tiny.replace(hidden=66)
    with pytest.raises(GPTConfigError, match="nope"):
        tiny.replace(nope=1)


def test_dict_round_trip_through_json() -> None:
    for cfg in PRESETS.values():
        data = json.loads(json.dumps(cfg.to_dict()))
        assert GPTConfig.from_dict(data) == cfg
    assert preset("tiny").to_dict()["ffn_hidden"] == 256


def test_from_dict_rejects_unknown_and_missing_keys() -> None:
    data = preset("tiny").to_dict()
    with pytest.raises(GPTConfigError) as info:
        GPTConfig.from_dict({**data, "rotary": True, "bias_free": 1})
    assert "bias_free" in str(info.value) and "rotary" in str(info.value)
    del data["n_heads"], data["dropout"]
    with pytest.raises(GPTConfigError, match="n_heads"):
        GPTConfig.from_dict(data)


def test_llama_presets_match_published_shapes_and_counts() -> None:
    """Llama 3.2 1B and Llama 3.1 8B as published (config.json of the HF releases): shapes,
    and parameter counts equal to the released models' (1,235,814,400 and 8,030,261,248)."""
    from mt_model import count_parameters

    small, big = preset("llama-3.2-1b"), preset("llama-3.1-8b")
    assert (small.n_layers, small.hidden, small.n_heads, small.n_kv_heads, small.ffn_hidden,
            small.vocab_size, small.rope_theta, small.tied_embeddings) == (
        16, 2048, 32, 8, 8192, 128256, 500000.0, True)
    assert (big.n_layers, big.hidden, big.n_heads, big.n_kv_heads, big.ffn_hidden,
            big.vocab_size, big.tied_embeddings) == (32, 4096, 32, 8, 14336, 128256, False)
    for cfg in (small, big, preset("llama-test")):
        assert (cfg.position, cfg.norm, cfg.mlp, cfg.bias) == ("rope", "rmsnorm", "swiglu",
                                                               False)
    assert count_parameters(small) == 1_235_814_400
    assert count_parameters(big) == 8_030_261_248


def test_architecture_choices_are_validated_with_numbers() -> None:
    base = preset("tiny")
    with pytest.raises(GPTConfigError, match="n_heads=4 is not divisible by n_kv_heads=3"):
        base.replace(n_kv_heads=3)
    with pytest.raises(GPTConfigError, match="n_kv_heads must be a positive int, got 0"):
        base.replace(n_kv_heads=0)
    with pytest.raises(GPTConfigError, match=r"position must be one of \('learned', 'rope'\)"):
        base.replace(position="alibi")
    with pytest.raises(GPTConfigError, match="norm must be one of"):
        base.replace(norm="batchnorm")
    with pytest.raises(GPTConfigError, match="mlp must be one of"):
        base.replace(mlp="relu")
    with pytest.raises(GPTConfigError, match="rope needs an even head width, got hidden 60 / "
                                             "n_heads 4 = 15"):
        base.replace(hidden=60, position="rope")
    with pytest.raises(GPTConfigError, match="rope_theta must be a number > 1"):
        base.replace(rope_theta=0.5)
    assert base.n_kv_heads == base.n_heads  # None resolves to multi-head
    assert base.replace(n_kv_heads=1).architecture == "n_kv_heads=1"


def test_dicts_without_architecture_fields_read_as_gpt2() -> None:
    """Checkpoints written before the architecture fields existed hold none of them: their
    model reads back as the GPT-2 block, equal to today's preset (resume compares the two)."""
    new_fields = ("position", "rope_theta", "norm", "mlp", "n_kv_heads", "bias",
                  "tied_embeddings")
    for name in ("tiny", "gpt2-small"):
        old = {k: v for k, v in preset(name).to_dict().items() if k not in new_fields}
        assert GPTConfig.from_dict(old) == preset(name)
        assert GPTConfig.from_dict(old).architecture == "gpt2"
