"""Consolidated checkpoints: exact round trips, manifest contents, clear errors, atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mt_convert import (
    ConvertError,
    canonical_shapes,
    load_model,
    load_state_dict,
    open_checkpoint,
    save_model,
    save_state_dict,
)
from mt_convert.safetensors_io import tensor_sha256
from mt_model import GPT, preset


def _model(seed: int = 7) -> GPT:
    return GPT(preset("tiny"), seed=seed).eval()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_convert_consolidated_round_trip_is_exact(tmp_path: Path) -> None:
    model = _model()
    save_model(model, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "config.json", "model.safetensors"]
    config, state = load_state_dict(tmp_path / "ckpt")
    assert config == model.config
    assert _same(state, model.state_dict())
    idx = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "ckpt")(idx), model(idx))


def test_convert_consolidated_manifest(tmp_path: Path) -> None:
    model = _model()
    save_model(model, tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert manifest["format"] == "mt-consolidated" and manifest["format_version"] == 1
    assert manifest["model"] == model.config.to_dict()
    entries = manifest["files"]["model.safetensors"]
    state = model.state_dict()
    assert list(entries) == list(canonical_shapes(model.config)) == list(state)
    for name, tensor in state.items():
        assert entries[name] == {"dtype": "F32", "shape": list(tensor.shape),
                                 "sha256": tensor_sha256(tensor)}
    # the tied output embedding is stored once, under the mt name
    assert "embed.tokens.weight" in load_file(str(tmp_path / "ckpt" / "model.safetensors"))


def test_convert_consolidated_keeps_bf16(tmp_path: Path) -> None:
    model = _model().to(torch.bfloat16)
    save_model(model, tmp_path / "bf16")
    with open_checkpoint(tmp_path / "bf16") as reader:
        assert reader.format == "consolidated"
        assert reader.spec("blocks.0.attn.qkv.weight").dtype == torch.bfloat16
    assert _same(load_state_dict(tmp_path / "bf16")[1], model.state_dict())
    assert load_model(tmp_path / "bf16").embed.tokens.weight.dtype == torch.bfloat16


def _rewrite(path: Path, edit) -> None:  # noqa: ANN001 - a small test helper
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_convert_consolidated_missing_and_unexpected_tensors(tmp_path: Path) -> None:
    save_model(_model(), tmp_path / "a")
    _rewrite(tmp_path / "a" / "model.safetensors",
             lambda t: (t.pop("blocks.1.mlp.fc.bias"), t.update(extra=torch.ones(1))))
    with pytest.raises(ConvertError, match=r"a/model\.safetensors: missing tensors "
                                           r"\['blocks\.1\.mlp\.fc\.bias'\]; unexpected "
                                           r"tensors \['extra'\]"):
        open_checkpoint(tmp_path / "a")


def test_convert_consolidated_detects_changed_values(tmp_path: Path) -> None:
    save_model(_model(), tmp_path / "a")
    # a well-formed file whose values differ from the manifest's checksums
    _rewrite(tmp_path / "a" / "model.safetensors",
             lambda t: t["ln_f.weight"].mul_(2.0))
    with open_checkpoint(tmp_path / "a") as reader:
        reader.read("ln_f.bias")
        with pytest.raises(ConvertError, match=r"a/model\.safetensors: checksum mismatch for "
                                               r"tensor 'ln_f\.weight' \(manifest says"):
            reader.read("ln_f.weight")


def test_convert_consolidated_wrong_shape_and_bad_config(tmp_path: Path) -> None:
    save_model(_model(), tmp_path / "a")
    config_path = tmp_path / "a" / "config.json"
    manifest = json.loads(config_path.read_text())
    manifest["model"]["hidden"] = 32  # the stored tensors no longer fit the config
    manifest["model"]["ffn_hidden"] = 128
    config_path.write_text(json.dumps(manifest))
    with pytest.raises(ConvertError, match=r"tensor 'embed\.tokens\.weight' is \[1000, 64\] "
                                           r"F32, .* the model config needs \[1000, 32\]"):
        open_checkpoint(tmp_path / "a")
    config_path.write_text("{ not json")
    with pytest.raises(ConvertError, match=r"a/config\.json: not valid JSON"):
        open_checkpoint(tmp_path / "a")
    manifest["model"]["n_heads"] = 5
    manifest["model"]["hidden"] = 64
    config_path.write_text(json.dumps(manifest))
    with pytest.raises(ConvertError, match=r"config\.json: invalid model config: .*hidden=64 "
                                           r"is not divisible by n_heads=5"):
        open_checkpoint(tmp_path / "a")


def test_convert_consolidated_truncated_file(tmp_path: Path) -> None:
    save_model(_model(), tmp_path / "a")
    path = tmp_path / "a" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ConvertError, match=r"a/model\.safetensors: not a readable "
                                           r"safetensors file \(malformed or truncated\)"):
        load_state_dict(tmp_path / "a")


class _Boom(RuntimeError):
    pass


def _fail_after(count: int):  # noqa: ANN202
    def progress(name: str, done: int, total: int) -> None:
        if done == count:
            raise _Boom(f"injected failure after {name}")
    return progress


def test_convert_failed_write_leaves_no_destination(tmp_path: Path) -> None:
    model = _model()
    with pytest.raises(_Boom):
        save_model(model, tmp_path / "out", progress=_fail_after(5))
    assert list(tmp_path.iterdir()) == []  # no destination and no staging leftovers
    bad = dict(model.state_dict())
    bad["ln_f.bias"] = torch.zeros(3)
    with pytest.raises(ConvertError, match=r"'ln_f\.bias' has shape \[3\], the config "
                                           r"needs \[64\]"):
        save_state_dict(bad, model.config, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "a_file").write_text("")  # an OS error: the parent is not a directory
    with pytest.raises(ConvertError, match=r"a_file/out: writing failed, nothing was written"):
        save_model(model, tmp_path / "a_file" / "out")


def test_convert_existing_destination_is_kept_on_failure(tmp_path: Path) -> None:
    old, new = _model(1), _model(2)
    save_model(old, tmp_path / "ckpt")
    with pytest.raises(ConvertError, match="destination already exists"):
        save_model(new, tmp_path / "ckpt")
    with pytest.raises(_Boom):
        save_model(new, tmp_path / "ckpt", overwrite=True, progress=_fail_after(10))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert _same(load_state_dict(tmp_path / "ckpt")[1], old.state_dict())
    save_model(new, tmp_path / "ckpt", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert _same(load_state_dict(tmp_path / "ckpt")[1], new.state_dict())
