"""Hugging Face GPT-2 format without transformers: exact round trips, layout details,
legacy files, and refusals. (Loading into transformers: test_convert_hf_transformers.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mt_formats import (
    ConvertError,
    convert_checkpoint,
    load_state_dict,
    open_checkpoint,
    save_model,
)
from mt_model import GPT, preset


def _model(**overrides: object) -> GPT:
    return GPT(preset("tiny").replace(**overrides), seed=11).eval()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_convert_hf_round_trip_is_bit_identical(tmp_path: Path) -> None:
    model = _model(gelu_approximate="tanh", ffn_hidden=96, layernorm_eps=1e-6)
    save_model(model, tmp_path / "a")
    convert_checkpoint(tmp_path / "a", tmp_path / "hf", to="hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "b", to="consolidated")
    for name in ("model.safetensors", "config.json"):  # same bytes, same config
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_convert_hf_layout(tmp_path: Path) -> None:
    model = _model()
    save_model(model, tmp_path / "hf", to="hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "model.safetensors"]
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    layer = {f"transformer.h.0.{k}" for k in (
        "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
        "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
        "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")}
    assert layer <= set(stored) and "lm_head.weight" not in stored  # tied: stored once
    assert len(stored) == 4 + 12 * model.config.n_layers
    state = model.state_dict()
    # Conv1D keeps [in, out]: the transposes of mt's nn.Linear weights
    assert torch.equal(stored["transformer.h.0.attn.c_attn.weight"],
                       state["blocks.0.attn.qkv.weight"].t())
    assert torch.equal(stored["transformer.h.3.mlp.c_proj.weight"],
                       state["blocks.3.mlp.proj.weight"].t())
    assert torch.equal(stored["transformer.wte.weight"], state["embed.tokens.weight"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert (config["n_layer"], config["n_embd"], config["n_head"], config["n_inner"],
            config["vocab_size"], config["n_positions"]) == (4, 64, 4, 256, 1000, 64)
    assert config["activation_function"] == "gelu"  # exact erf GeLU, mt's default
    assert config["tie_word_embeddings"] is True and config["bos_token_id"] is None


def _legacy_hf(tmp_path: Path, model: GPT) -> Path:
    """An old-style HF dir: pytorch_model.bin, no "transformer." prefix, causal-mask
    buffers, a duplicated lm_head, and no mt section in the config."""
    save_model(model, tmp_path / "hf", to="hf")
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    legacy = {k.removeprefix("transformer."): v for k, v in stored.items()}
    for layer in range(model.config.n_layers):
        legacy[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
        legacy[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    legacy["lm_head.weight"] = stored["transformer.wte.weight"].clone()
    out = tmp_path / "legacy"
    out.mkdir()
    torch.save(legacy, out / "pytorch_model.bin")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["mt"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_convert_hf_reads_legacy_torch_bin(tmp_path: Path) -> None:
    model = _model()
    legacy = _legacy_hf(tmp_path, model)
    config, state = load_state_dict(legacy)
    assert _same(state, model.state_dict())
    # without the mt section the GPT-2 fields still give the same shapes
    assert config.replace(dropout=0.0, attention_dropout=0.0, init_std=model.config.init_std) \
        == model.config
    tensors = torch.load(legacy / "pytorch_model.bin", weights_only=True)
    tensors["lm_head.weight"][0, 0] += 1.0
    torch.save(tensors, legacy / "pytorch_model.bin")
    with open_checkpoint(legacy) as reader, pytest.raises(
            ConvertError, match=r"'lm_head\.weight' differs from 'wte\.weight': an untied "
                                r"output head is not supported"):
        reader.read("embed.tokens.weight")


class _NotATensor:
    pass


def test_convert_hf_refuses_to_unpickle_objects(tmp_path: Path) -> None:
    legacy = _legacy_hf(tmp_path, _model())
    # a torch.save'd pickle with an arbitrary object: weights-only loading refuses it
    torch.save({"wte.weight": _NotATensor()}, legacy / "pytorch_model.bin")
    with pytest.raises(ConvertError, match=r"pytorch_model\.bin: cannot load as plain tensors"):
        open_checkpoint(legacy)


def test_convert_hf_reads_sharded_safetensors(tmp_path: Path) -> None:
    model = _model()
    save_model(model, tmp_path / "hf", to="hf")
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "model.safetensors").unlink()
    keys = sorted(stored)
    parts = {"model-00001-of-00002.safetensors": keys[:20],
             "model-00002-of-00002.safetensors": keys[20:]}
    for file, names in parts.items():
        save_file({k: stored[k] for k in names}, str(tmp_path / "hf" / file),
                  metadata={"format": "pt"})
    index = {"weight_map": {k: f for f, names in parts.items() for k in names}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _same(load_state_dict(tmp_path / "hf")[1], model.state_dict())


@pytest.mark.parametrize(("key", "value"), [
    ("scale_attn_by_inverse_layer_idx", True),
    ("tie_word_embeddings", False),
    ("activation_function", "relu"),
    ("model_type", "mistral"),  # llama is read by mt_formats.hf_llama
])
def test_convert_hf_rejects_what_mt_cannot_express(tmp_path: Path, key: str,
                                                   value: object) -> None:
    save_model(_model(), tmp_path / "hf", to="hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config[key] = value
    path.write_text(json.dumps(config))
    with pytest.raises(ConvertError, match=rf"hf/config\.json: {key}={value!r} is not "
                                           "supported"):
        open_checkpoint(tmp_path / "hf")


def test_convert_hf_shape_and_name_errors(tmp_path: Path) -> None:
    save_model(_model(), tmp_path / "hf", to="hf")
    path = tmp_path / "hf" / "model.safetensors"
    stored = load_file(str(path))
    fc = "transformer.h.2.mlp.c_fc.weight"
    stored[fc] = stored[fc].t().contiguous()
    save_file(stored, str(path), metadata={"format": "pt"})
    with pytest.raises(ConvertError, match=r"hf/model\.safetensors: tensor "
                                           r"'transformer\.h\.2\.mlp\.c_fc\.weight' has shape "
                                           r"\[256, 64\], config\.json needs \[64, 256\]"):
        open_checkpoint(tmp_path / "hf")
    del stored["transformer.h.2.mlp.c_fc.weight"]
    save_file(stored, str(path), metadata={"format": "pt"})
    with pytest.raises(ConvertError, match=r"missing tensors \['h\.2\.mlp\.c_fc\.weight'\]"):
        open_checkpoint(tmp_path / "hf")
