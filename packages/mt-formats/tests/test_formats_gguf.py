"""GGUF export read back by the ``gguf`` package's own ``GGUFReader`` (names, types, keys,
tokenizer, values) and by mt (round trips); a Llama's q / k rows, which GGUF stores in the
adjacent-pair RoPE order llama.cpp computes, drive a Meta-style forward to mt's logits.
llama.cpp's own forward on these files: ``benchmarks/gguf_llama_cpp.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from reference_llama import titan_logits

from mt_formats import ConvertError, convert_checkpoint, load_model, open_checkpoint, save_model
from mt_model import GPT, GPTConfig, preset

gguf = pytest.importorskip("gguf")

LLAMA = GPTConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=1000, seq_len=32,
                  ffn_hidden=96, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                  tied_embeddings=False, layernorm_eps=1e-5)


def _stored(reader: gguf.GGUFReader) -> dict[str, gguf.ReaderTensor]:
    return {tensor.name: tensor for tensor in reader.tensors}


def _values(tensor: gguf.ReaderTensor) -> np.ndarray:
    shape = tuple(reversed(tensor.shape.tolist()))
    if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:
        raw = np.ascontiguousarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(shape)
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0"])
def test_gpt2_gguf_read_by_gguf_reader(tmp_path: Path, kind: str) -> None:
    model = GPT(preset("tiny").replace(hidden=48, n_heads=4), seed=2).eval()
    save_model(model, tmp_path / "mt")
    convert_checkpoint(tmp_path / "mt", tmp_path / "g", to="gguf", gguf_type=kind,
                       tokenizer="tokenizer-1k")
    reader = gguf.GGUFReader(tmp_path / "g" / "model.gguf")
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "gpt2"
    assert (fields["gpt2.block_count"], fields["gpt2.embedding_length"],
            fields["gpt2.attention.head_count"]) == (model.config.n_layers, 48, 4)
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert len(fields["tokenizer.ggml.tokens"]) == model.config.vocab_size
    stored, state = _stored(reader), model.state_dict()
    assert set(stored) == {  # llama.cpp's names; the tied head is token_embd's
        "token_embd.weight", "position_embd.weight", "output_norm.weight", "output_norm.bias",
        *(f"blk.{i}.{t}.{p}" for i in range(model.config.n_layers) for t in (
            "attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
          for p in ("weight", "bias"))}
    for key, name in (("blk.1.attn_qkv.weight", "blocks.1.attn.qkv.weight"),
                      ("blk.0.ffn_down.weight", "blocks.0.mlp.proj.weight"),
                      ("output_norm.bias", "ln_f.bias")):
        tensor, want = stored[key], state[name].numpy()
        got = _values(tensor)
        assert got.shape == want.shape
        if want.ndim == 1 or kind == "f32":
            assert tensor.tensor_type.name == "F32" and np.array_equal(got, want)
        elif kind in ("f16", "bf16"):
            dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[kind]
            assert np.array_equal(got, torch.from_numpy(want).to(dtype).float().numpy())
        elif want.shape[1] % 32:  # q8_0 blocks need rows of 32: 48 columns stay f16
            assert tensor.tensor_type.name == "F16"
        else:  # q8_0: each block of 32 within half a step of its scale max|x| / 127, the
            # scale itself an f16 (relative error <= 2^-11, times up to 127 steps)
            assert tensor.tensor_type.name == "Q8_0"
            blocks, approx = want.reshape(-1, 32), got.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127
            assert (np.abs(approx - blocks) <= step * 0.5 + np.abs(blocks) * 2**-11).all()
    back = load_model(tmp_path / "g").float().eval()  # mt reads the file back
    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, again = model(tokens), back(tokens)
    if kind == "f32":
        for name, tensor in state.items():
            assert torch.equal(back.state_dict()[name], tensor), name
    else:
        limit = {"f16": 1e-2, "bf16": 5e-2, "q8_0": 5e-2}[kind]
        assert (ours - again).abs().max() < limit
        assert (ours.argmax(-1) == again.argmax(-1)).float().mean() > 0.9


def test_llama_gguf_rows_are_llama_cpp_rope_order(tmp_path: Path) -> None:
    model = GPT(LLAMA, seed=3).eval()
    save_model(model, tmp_path / "g", to="gguf", gguf_type="f32")
    stored = _stored(gguf.GGUFReader(tmp_path / "g" / "model.gguf"))
    names = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(LLAMA.n_layers):
        for titan, ours in (("attention.qkv_linear.wq", "attn_q"),
                            ("attention.qkv_linear.wk", "attn_k"),
                            ("attention.qkv_linear.wv", "attn_v"), ("attention.wo", "attn_output"),
                            ("feed_forward.w1", "ffn_gate"), ("feed_forward.w3", "ffn_up"),
                            ("feed_forward.w2", "ffn_down"), ("attention_norm", "attn_norm"),
                            ("ffn_norm", "ffn_norm")):
            names[f"layers.{i}.{titan}.weight"] = f"blk.{i}.{ours}.weight"
    assert set(names.values()) == set(stored)
    state = {key: torch.from_numpy(_values(stored[gguf_key]).copy())
             for key, gguf_key in names.items()}
    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(titan_logits(state, tokens, LLAMA), model(tokens),
                                   atol=1e-5, rtol=0)
    back = load_model(tmp_path / "g")
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_gguf_refusals(tmp_path: Path) -> None:
    save_model(GPT(preset("tiny"), seed=1), tmp_path / "mt")
    with pytest.raises(ConvertError, match="--gguf-type 'q4_k': one of"):
        convert_checkpoint(tmp_path / "mt", tmp_path / "g", to="gguf", gguf_type="q4_k")
    with pytest.raises(ConvertError, match="--gguf-type only applies to the gguf target"):
        convert_checkpoint(tmp_path / "mt", tmp_path / "g", to="hf", gguf_type="q8_0")
    (tmp_path / "tokenizer.json").write_bytes(b"\xff not a tokenizer")
    with pytest.raises(ConvertError, match=r"^tokenizer: .*tokenizer\.json: not a readable "
                       r"tokenizer\.json"):  # as --to hf says it, not a traceback
        convert_checkpoint(tmp_path / "mt", tmp_path / "g", to="gguf",
                           tokenizer=str(tmp_path / "tokenizer.json"))
    assert not (tmp_path / "g").exists()
    convert_checkpoint(tmp_path / "mt", tmp_path / "g", to="gguf")
    data = (tmp_path / "g" / "model.gguf").read_bytes()
    (tmp_path / "bad.gguf").write_bytes(data[:len(data) // 2])  # a .gguf file is a source too
    with pytest.raises(ConvertError, match=r"bad\.gguf: not a readable GGUF file \(truncated"):
        open_checkpoint(tmp_path / "bad.gguf")
    # a flipped bit in a tensor: GGUF cannot tell, the CRC-32C in mt.json can
    stored = _stored(gguf.GGUFReader(tmp_path / "g" / "model.gguf"))["blk.0.ffn_up.weight"]
    damaged = bytearray(data)
    damaged[stored.data_offset + 7] ^= 0x04
    (tmp_path / "g" / "model.gguf").write_bytes(bytes(damaged))
    with open_checkpoint(tmp_path / "g") as reader, pytest.raises(
            ConvertError, match=r"model\.gguf: tensor 'blk\.0\.ffn_up\.weight': checksum"):
        reader.read("blocks.0.mlp.fc.weight")


def test_gguf_mt_json_names_only_stored_tensors(tmp_path: Path) -> None:
    """mt.json beside model.gguf: edited since mt wrote it (its own checksum), or, in one
    without its own checksum, a checksum of a tensor the file does not hold or a tensor
    without one, is refused in one line (a renamed key would leave a tensor unchecked)."""
    save_model(GPT(preset("tiny"), seed=1), tmp_path / "mt")
    convert_checkpoint(tmp_path / "mt", tmp_path / "g", to="gguf")
    path = tmp_path / "g" / "mt.json"
    sidecar = json.loads(path.read_text())
    path.write_text(json.dumps({**sidecar, "checksums": {**sidecar["checksums"],
                                                         "token_embd.weight": "crc32c:00000000"}}))
    with pytest.raises(ConvertError, match=r"mt\.json: edited or damaged since mt wrote it"):
        open_checkpoint(tmp_path / "g")
    path.write_text(json.dumps({**sidecar, "checksum": None}))
    with pytest.raises(ConvertError, match=r"mt\.json: checksum: unrecognised checksum 'None'"):
        open_checkpoint(tmp_path / "g")
    del sidecar["checksum"]
    text = json.dumps(sidecar)
    path.write_text(text.replace('"blk.0.ffn_up.weight"', '"blk.0.ffn_up/weight"'))
    with pytest.raises(ConvertError, match=r"mt\.json: records a checksum of "
                       r"'blk\.0\.ffn_up/weight', which model\.gguf does not hold"):
        open_checkpoint(tmp_path / "g")
    sidecar = json.loads(text)
    del sidecar["checksums"]["blk.0.ffn_up.weight"]
    path.write_text(json.dumps(sidecar))
    with open_checkpoint(tmp_path / "g") as reader, pytest.raises(
            ConvertError, match=r"mt\.json: records no checksum of tensor 'blk\.0\.ffn_up"):
        reader.read("blocks.0.mlp.fc.weight")


@pytest.mark.parametrize(("kind", "value"), [("f16", 1e5), ("q8_0", 1e7)])
def test_gguf_refuses_a_value_its_type_cannot_hold(tmp_path: Path, kind: str,
                                                   value: float) -> None:
    """A matrix value beyond what f16 (or q8_0's f16 scale) holds is refused in one line
    naming the tensor, not written as inf; f32 stores it."""
    model = GPT(preset("tiny"), seed=1)
    with torch.no_grad():
        model.blocks[0].attn.proj.weight[0, 0] = value
    save_model(model, tmp_path / "mt")
    with pytest.raises(ConvertError, match=r"'blocks\.0\.attn\.proj\.weight'.*--gguf-type f32"):
        convert_checkpoint(tmp_path / "mt", tmp_path / "g", to="gguf", gguf_type=kind)
    assert not (tmp_path / "g").exists()
    convert_checkpoint(tmp_path / "mt", tmp_path / "g", to="gguf", gguf_type="f32")
    assert load_model(tmp_path / "g").blocks[0].attn.proj.weight[0, 0].item() == value


def test_a_gguf_type_that_rounds_the_source_says_so(tmp_path: Path) -> None:
    """An fp32 model stored as f16 (the default), bf16 or q8_0 gets one note saying its
    values were rounded; stored as f32, or a bf16 model as bf16, none."""
    model = GPT(preset("tiny"), seed=1)
    save_model(model, tmp_path / "fp32")
    for kind in ("f16", "bf16", "q8_0", "f32"):
        notes = convert_checkpoint(tmp_path / "fp32", tmp_path / kind, to="gguf",
                                   gguf_type=kind).notes
        rounded = [note for note in notes if "rounded" in note]
        assert rounded == ([] if kind == "f32" else [
            f"matrices stored as {kind} (--gguf-type): their float32 values rounded; "
            "--gguf-type f32 keeps every value"]), (kind, notes)
    save_model(model.to(torch.bfloat16), tmp_path / "bf16-model")
    notes = convert_checkpoint(tmp_path / "bf16-model", tmp_path / "bf16-as-bf16", to="gguf",
                               gguf_type="bf16").notes
    assert not [note for note in notes if "rounded" in note], notes


@pytest.mark.parametrize(("before", "after"), [
    (b'"layernorm_eps": 1e-05', b'"layernorm_eps": 1e-01'),  # in mt.config
    (b'"n_heads": 4, "n_kv_heads": 4', b'"n_heads": 2, "n_kv_heads": 2')])
def test_gguf_header_edit_is_refused(tmp_path: Path, before: bytes, after: bytes) -> None:
    """mt.json records the CRC-32C of model.gguf's bytes before the tensor data (header,
    key/values, tensor table): a same-length edit there is refused in one line; a sidecar
    without that checksum (as mt wrote them before it) still reads."""
    from mt_formats.dcp_files import write_sidecar

    model = GPT(preset("tiny"), seed=1)
    save_model(model, tmp_path / "mt")
    convert_checkpoint(tmp_path / "mt", tmp_path / "g", to="gguf", gguf_type="f32")
    path = tmp_path / "g" / "model.gguf"
    data = path.read_bytes()
    assert data.count(before) == 1
    path.write_bytes(data.replace(before, after))
    with pytest.raises(ConvertError, match=r"model\.gguf: header \(metadata keys and tensor "
                       r"table\): checksum mismatch \(recorded crc32c:"):
        open_checkpoint(tmp_path / "g")
    path.write_bytes(data)
    sidecar = json.loads((tmp_path / "g" / "mt.json").read_text())
    assert sidecar["header"].startswith("crc32c:")
    write_sidecar(tmp_path / "g", {key: value for key, value in sidecar.items()
                                   if key not in ("format", "format_version", "checksum",
                                                  "header")})
    assert torch.equal(load_model(tmp_path / "g").blocks[0].mlp.fc.weight,
                       model.blocks[0].mlp.fc.weight)


def _foreign(src: Path, dst: Path, drop: set[str] = frozenset(),
             keys: dict[str, tuple[object, gguf.GGUFValueType]] | None = None) -> Path:
    """``src`` (an mt GGUF) rewritten as llama.cpp's converter would: no ``mt.config``,
    without the tensors or keys in ``drop``, with ``keys`` added."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in drop | {"general.architecture", "mt.config"}:
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for name, (value, kind) in (keys or {}).items():
        writer.add_key_value(name, value, kind)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


_STRING, _FLOAT, _UINT = (gguf.GGUFValueType.STRING, gguf.GGUFValueType.FLOAT32,
                         gguf.GGUFValueType.UINT32)


@pytest.mark.parametrize(("drop", "keys", "message"), [
    ({"token_embd.weight"}, {}, r"no tensor 'token_embd\.weight'"),
    (set(), {"llama.rope.scaling.type": ("linear", _STRING),
             "llama.rope.scaling.factor": (4.0, _FLOAT)},
     r"llama\.rope\.scaling\.factor=4\.0 is not supported by mt's Llama"),
    (set(), {"llama.rope.scaling.type": ("yarn", _STRING)},
     r"llama\.rope\.scaling\.type='yarn' is not supported by mt's Llama"),
    ({"llama.rope.dimension_count"}, {"llama.rope.dimension_count": (8, _UINT)},
     r"llama\.rope\.dimension_count=8 is not supported by mt's Llama \(.* = 16")])
def test_foreign_gguf_mt_cannot_honour_is_refused(
        tmp_path: Path, drop: set[str], keys: dict[str, tuple[object, gguf.GGUFValueType]],
        message: str) -> None:
    """A llama.cpp GGUF (config from its keys) without token_embd.weight, with RoPE scaling
    (linear with a factor, or yarn) or with RoPE on part of each head (rope.dimension_count
    below the head width) is refused in one line naming the file and the tensor or key;
    the same file without those reads back as the model."""
    model = GPT(LLAMA, seed=3)
    save_model(model, tmp_path / "g", to="gguf", gguf_type="f32")
    src = tmp_path / "g" / "model.gguf"
    back = load_model(_foreign(src, tmp_path / "plain.gguf"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    path = _foreign(src, tmp_path / "edited.gguf", drop, keys)
    with pytest.raises(ConvertError, match=rf"^{re.escape(str(path))}: {message}"):
        open_checkpoint(path)


@pytest.mark.parametrize(("hidden", "file_type", "stored", "fallen"), [
    (48, "MOSTLY_F16", "f16", "token_embd.weight, position_embd.weight, "
     "blk.*.attn_qkv.weight, blk.*.attn_output.weight, blk.*.ffn_up.weight, "
     "blk.*.ffn_down.weight"),
    (64, "MOSTLY_Q8_0", "q8_0 / f16", "blk.*.ffn_down.weight")])
def test_q8_0_notes_and_file_type_say_what_was_stored(tmp_path: Path, hidden: int,
                                                      file_type: str, stored: str,
                                                      fallen: str) -> None:
    """--gguf-type q8_0 where rows are not a multiple of 32 (ffn_hidden 100; hidden 48 too)
    stores those matrices as f16: general.file_type is the type holding most of the
    matrices' values, and the notes name the types stored and the matrices stored as f16."""
    save_model(GPT(preset("tiny").replace(hidden=hidden, n_heads=4, ffn_hidden=100), seed=1),
               tmp_path / "mt")
    notes = convert_checkpoint(tmp_path / "mt", tmp_path / "g", to="gguf",
                               gguf_type="q8_0").notes
    reader = gguf.GGUFReader(tmp_path / "g" / "model.gguf")
    assert gguf.LlamaFileType(reader.fields["general.file_type"].contents()).name == file_type
    types = {key: tensor.tensor_type.name for key, tensor in _stored(reader).items()}
    assert (types["blk.0.ffn_down.weight"], types["blk.0.ffn_up.weight"]) == (
        ("F16", "F16") if hidden == 48 else ("F16", "Q8_0"))
    assert [note for note in notes if "q8_0" in note or "rounded" in note] == [
        f"matrices stored as {stored} (--gguf-type): their float32 values rounded; "
        "--gguf-type f32 keeps every value",
        f"--gguf-type q8_0: {fallen} stored as f16, not q8_0: their rows are not a multiple "
        "of q8_0's blocks of 32"], notes


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_q8_0_refuses_a_non_finite_value(tmp_path: Path, value: float) -> None:
    """q8_0 would turn the whole block of 32 holding a nan or inf into nan: refused in one
    line naming the tensor; f16 stores the value as it is."""
    model = GPT(preset("tiny"), seed=1)
    with torch.no_grad():
        model.blocks[0].mlp.fc.weight[3, 5] = value
    save_model(model, tmp_path / "mt")
    with pytest.raises(ConvertError, match=r"^tensor 'blocks\.0\.mlp\.fc\.weight' holds "
                       rf"{value}, which q8_0 cannot store .*--gguf-type f16"):
        convert_checkpoint(tmp_path / "mt", tmp_path / "g", to="gguf", gguf_type="q8_0")
    assert not (tmp_path / "g").exists()
    convert_checkpoint(tmp_path / "mt", tmp_path / "g", to="gguf", gguf_type="f16")
    weight = load_model(tmp_path / "g").blocks[0].mlp.fc.weight
    assert weight[3, 5].item() == value or (value != value and weight[3, 5].isnan())
    assert weight.isfinite().sum() == weight.numel() - 1


def test_an_exact_gelu_model_says_llama_cpp_approximates_it(tmp_path: Path) -> None:
    """llama.cpp's gpt2 computes GELU's tanh approximation: a GPT-2-shaped model with the
    exact GELU (mt's default) says so in a note; one trained with the tanh GELU does not."""
    from dataclasses import replace

    for approximate in ("none", "tanh"):
        config = replace(preset("tiny"), gelu_approximate=approximate)
        save_model(GPT(config, seed=1), tmp_path / approximate)
        notes = convert_checkpoint(tmp_path / approximate, tmp_path / f"g-{approximate}",
                                   to="gguf", gguf_type="f32").notes
        said = [note for note in notes if "tanh approximation of GELU" in note]
        assert len(said) == (approximate == "none"), (approximate, notes)
