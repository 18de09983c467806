"""Megatron-LM style layout: mt -> megatron -> mt bit-identical at TP 2 x PP 2, Megatron's
names and per-head qkv order, and weights-only reading that refuses other pickles."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from mt_formats import ConvertError, convert_checkpoint, load_model, save_model
from mt_model import GPT, preset


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_convert_megatron_round_trip_tp2_pp2(tmp_path: Path) -> None:
    model = GPT(preset("tiny"), seed=9).eval()
    save_model(model, tmp_path / "tp", to="tp", tp=2, pp=2)
    result = convert_checkpoint(tmp_path / "tp", tmp_path / "meg", to="megatron", tp=2, pp=2)
    assert result.target_format == "megatron"
    assert (tmp_path / "meg" / "latest_checkpointed_iteration.txt").read_text() == "0\n"
    assert sorted(str(p.relative_to(tmp_path / "meg"))
                  for p in (tmp_path / "meg").rglob("*.pt")) == [
        f"iter_0000000/mp_rank_{t:02d}_{s:03d}/model_optim_rng.pt"
        for t in range(2) for s in range(2)]
    convert_checkpoint(tmp_path / "meg", tmp_path / "back", to="tp", tp=2, pp=2)
    assert _files(tmp_path / "back") == _files(tmp_path / "tp")  # bit-identical
    idx = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "meg")(idx), model(idx), atol=0,
                                   rtol=0)


def test_convert_megatron_names_and_qkv_order(tmp_path: Path) -> None:
    model = GPT(preset("tiny"), seed=9).eval()
    save_model(model, tmp_path / "meg", to="megatron", tp=2, pp=2)
    first = _load(tmp_path / "meg/iter_0000000/mp_rank_01_000/model_optim_rng.pt")
    last = _load(tmp_path / "meg/iter_0000000/mp_rank_01_001/model_optim_rng.pt")
    assert first["checkpoint_version"] == 3.0 and first["iteration"] == 0
    embedding = first["model"]["language_model"]["embedding"]
    assert embedding["word_embeddings"]["weight"].shape == (512, 64)  # padded, tp 1 of 2
    assert torch.equal(embedding["position_embeddings"]["weight"], model.embed.positions.weight)
    assert sorted(k for k in first["model"]["language_model"]["encoder"] if "layers.1." in k) \
        == sorted(f"layers.1.{m}.{p}" for p in ("weight", "bias") for m in (
            "input_layernorm", "self_attention.query_key_value", "self_attention.dense",
            "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"))
    encoder = last["model"]["language_model"]["encoder"]
    assert "final_layernorm.weight" in encoder and "layers.2.input_layernorm.weight" not in encoder
    # stage 1 holds global layers 2-3 as local layers 0-1; qkv rows [heads, 3, head_dim]
    qkv = model.blocks[3].attn.qkv.weight.reshape(3, 4, 16, 64)  # [q|k|v, head, dim, in]
    want = torch.stack([qkv[:, 2], qkv[:, 3]]).reshape(96, 64)  # heads 2, 3 on tp rank 1
    assert torch.equal(encoder["layers.1.self_attention.query_key_value.weight"], want)
    assert torch.equal(encoder["layers.1.self_attention.dense.weight"],
                       model.blocks[3].attn.proj.weight[:, 32:])
    assert torch.equal(last["model"]["word_embeddings_for_head"]["weight"],
                       embedding["word_embeddings"]["weight"])


def test_convert_megatron_refuses_other_pickles(tmp_path: Path) -> None:
    save_model(GPT(preset("tiny"), seed=9), tmp_path / "meg", to="megatron")
    path = tmp_path / "meg/iter_0000000/mp_rank_00/model_optim_rng.pt"
    data = _load(path)
    torch.save({**data, "args": argparse.Namespace(num_layers=4)}, path)  # as Megatron does
    with pytest.raises(ConvertError, match=r"mp_rank_00/model_optim_rng\.pt: holds objects "
                                           "other than tensors and plain containers; refusing"):
        convert_checkpoint(tmp_path / "meg", tmp_path / "out")
    layers = data["model"]["language_model"]["encoder"]
    layers["layers.0.mlp.dense_h_to_4h.weight"] = layers["layers.0.mlp.dense_h_to_4h.weight"][1:]
    torch.save(data, path)
    with pytest.raises(ConvertError, match=r"tensor 'language_model\.encoder\.layers\.0\.mlp\."
                                           r"dense_h_to_4h\.weight' is \[255, 64\], the model "
                                           r"config needs \[256, 64\]"):
        convert_checkpoint(tmp_path / "meg", tmp_path / "out")
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ConvertError, match="not a readable torch checkpoint"):
        convert_checkpoint(tmp_path / "meg", tmp_path / "out")
    assert not (tmp_path / "out").exists()
