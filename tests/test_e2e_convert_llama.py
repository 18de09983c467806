"""Cross-app: Hugging Face Llama in and out of mt at a TP 2 x PP 2 layout.

A random ``LlamaForCausalLM`` (grouped-query attention with 2 key/value heads for 4 query
heads, a vocabulary of 1003 (not a multiple of 128), untied or tied head) saved by
transformers -> ``mt convert --to pretrain`` -> ``mt convert --tp 2 --pp 2`` (resharded,
optimizer state carried) -> ``mt convert --to hf`` -> ``LlamaForCausalLM.from_pretrained``:
the same logits within 1e-5; and mt's own forward on the TP 2 x PP 2 checkpoint gives
transformers' logits within 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from mt_convert.cli import app
from mt_formats import load_model


def _convert(*args: str) -> None:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_round_trip_through_tp2_pp2(tmp_path: Path, tied: bool) -> None:
    config = transformers.LlamaConfig(
        vocab_size=1003, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=tied)
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).eval()
    original.save_pretrained(tmp_path / "hf")
    _convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--to", "pretrain")
    _convert(str(tmp_path / "ckpt"), str(tmp_path / "ckpt22"), "--tp", "2", "--pp", "2")
    _convert(str(tmp_path / "ckpt22"), str(tmp_path / "back"), "--to", "hf")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.config.num_key_value_heads == 2 and back.config.tie_word_embeddings == tied
    idx = torch.randint(0, 1003, (2, 40))
    with torch.no_grad():
        want = original(idx).logits
        assert torch.allclose(back(idx).logits, want, atol=1e-5, rtol=0)
        mine = load_model(tmp_path / "ckpt22").eval()
        assert (mine.config.n_kv_heads, mine.config.tied_embeddings) == (2, tied)
        assert torch.allclose(mine(idx), want, atol=1e-5, rtol=0)
    # mt convert's own sharded format: TP 4 (key/value heads replicated) x PP 2, and back.
    _convert(str(tmp_path / "hf"), str(tmp_path / "tp42"), "--tp", "4", "--pp", "2")
    _convert(str(tmp_path / "tp42"), str(tmp_path / "back42"), "--to", "hf")
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back42").eval()
    with torch.no_grad():
        assert torch.equal(again(idx).logits, back(idx).logits)


def test_llama_settings_mt_cannot_reproduce_are_refused_by_name(tmp_path: Path) -> None:
    from mt_formats.errors import ConvertError
    from mt_formats.hf_llama import gpt_config_from_llama

    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "intermediate_size": 176, "vocab_size": 1003}
    assert gpt_config_from_llama(base, tmp_path).n_kv_heads == 4
    for extra, match in (
            ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}},
             "rope_parameters.rope_type='llama3'"),
            ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
            ({"attention_bias": True, "mlp_bias": False}, "mlp_bias=False"),
            ({"num_key_value_heads": 3}, "n_heads=4 is not divisible by n_kv_heads=3")):
        with pytest.raises(ConvertError, match=match):
            gpt_config_from_llama({**base, **extra}, tmp_path)
