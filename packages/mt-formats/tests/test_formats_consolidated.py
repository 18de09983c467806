"""Consolidated checkpoints: exact round trips, manifest contents, clear errors, atomicity."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mt_formats import (
    ConvertError,
    canonical_shapes,
    convert_checkpoint,
    load_model,
    load_state_dict,
    open_checkpoint,
    save_model,
    save_state_dict,
)
from mt_formats.manifest import MODEL_KEY
from mt_formats.safetensors_io import SafetensorsWriter
from mt_formats.tensors import TensorSpec, tensor_checksum, tensor_sha256
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
    assert manifest["format"] == "mt-consolidated" and manifest["format_version"] == 3
    assert manifest["model"] == model.config.to_dict()
    entries = manifest["files"]["model.safetensors"]
    state = model.state_dict()
    assert list(entries) == list(canonical_shapes(model.config)) == list(state)
    for name, tensor in state.items():
        assert entries[name] == {"dtype": "F32", "shape": list(tensor.shape),
                                 "checksum": tensor_checksum(tensor)}
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
    with pytest.raises(ConvertError, match=r"a/config\.json: model\.hidden is 32, where "
                                           r"model\.safetensors was written for 64 \(1 more "
                                           r"field\(s\) differ\)"):
        open_checkpoint(tmp_path / "a")
    # a file that does not record its model config (older mt-convert): the shapes still tell
    path = tmp_path / "a" / "model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        metadata = {k: v for k, v in (handle.metadata() or {}).items() if k != MODEL_KEY}
    save_file(load_file(str(path)), str(path), metadata=metadata)
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
    def disk_full(name: str, done: int, total: int) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(ConvertError, match=r"out: writing failed, nothing was written: .*No "
                                           r"space left on device"):
        save_model(model, tmp_path / "out", progress=disk_full)  # an OS error while writing
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "a_file").write_text("")  # the parent is not a directory: refused up front
    with pytest.raises(ConvertError, match=r"a_file/out: .*a_file is a file, not a folder"):
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


def test_an_interrupt_between_the_renames_of_force_keeps_the_previous_destination(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--force moves the previous destination aside, then the new one into place: an
    interrupt between the two renames puts the previous one back (not hidden in a
    ``.ckpt.old-*`` folder, with no destination)."""
    import mt_formats.atomic as atomic

    old, new = _model(1), _model(2)
    save_model(old, tmp_path / "ckpt")
    replace, calls = os.replace, []

    def interrupted(source: object, target: object) -> None:
        calls.append(target)
        if len(calls) == 2:  # the new one into place
            raise KeyboardInterrupt
        replace(source, target)

    monkeypatch.setattr(atomic.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_model(new, tmp_path / "ckpt", overwrite=True)
    monkeypatch.setattr(atomic.os, "replace", replace)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert _same(load_state_dict(tmp_path / "ckpt")[1], old.state_dict())


def test_convert_reads_format_version_1_checkpoints(tmp_path: Path) -> None:
    """Checkpoints written before CRC checksums (sha256, format_version 1) still load and
    are verified; an unknown version is refused with a clear message."""
    model = _model()
    save_model(model, tmp_path / "ckpt")
    state = model.state_dict()
    path = tmp_path / "ckpt" / "model.safetensors"
    path.unlink()
    with SafetensorsWriter(path, {k: TensorSpec.of(v) for k, v in state.items()},
                           {"mt.format": "mt-consolidated"}, algorithm="sha256") as writer:
        for name, tensor in state.items():
            writer.write(name, tensor)
    config_path = tmp_path / "ckpt" / "config.json"
    manifest = json.loads(config_path.read_text())
    manifest["format_version"] = 1
    for name, entry in manifest["files"]["model.safetensors"].items():
        del entry["checksum"]
        entry["sha256"] = tensor_sha256(state[name])
    config_path.write_text(json.dumps(manifest))
    _, loaded = load_state_dict(tmp_path / "ckpt")
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    manifest["files"]["model.safetensors"]["ln_f.bias"]["sha256"] = "0" * 64
    config_path.write_text(json.dumps(manifest))
    with pytest.raises(ConvertError, match=r"checksum mismatch for tensor 'ln_f\.bias' "
                                           r"\(manifest says 0000"):
        load_state_dict(tmp_path / "ckpt")
    manifest["format_version"] = 4
    config_path.write_text(json.dumps(manifest))
    with pytest.raises(ConvertError, match=r"config\.json: format_version 4 is not supported "
                                           r"\(this mt-convert reads versions \[1, 2, 3\]"):
        load_state_dict(tmp_path / "ckpt")


def _rewrite_checksums(tmp_path: Path, state: dict[str, torch.Tensor], algorithm: str,
                       version: int) -> Path:
    """Rewrite ``tmp_path/ckpt`` as an older format version writes it (its file metadata
    and manifest entries in ``algorithm``); returns the manifest path."""
    path = tmp_path / "ckpt" / "model.safetensors"
    path.unlink()
    with SafetensorsWriter(path, {k: TensorSpec.of(v) for k, v in state.items()},
                           {"mt.format": "mt-consolidated"}, algorithm=algorithm) as writer:
        for name, tensor in state.items():
            writer.write(name, tensor)
    config_path = tmp_path / "ckpt" / "config.json"
    manifest = json.loads(config_path.read_text())
    manifest["format_version"] = version
    for name, entry in manifest["files"]["model.safetensors"].items():
        entry["checksum"] = tensor_checksum(state[name], algorithm)
    config_path.write_text(json.dumps(manifest))
    return config_path


def test_convert_reads_format_version_2_crc32_checkpoints(tmp_path: Path) -> None:
    """Version 2 (zlib CRC-32) checkpoints load, verified; corruption is caught; a version
    given a checksum kind it never recorded, or an unknown kind, is refused naming the file
    and the supported kinds."""
    model = _model()
    save_model(model, tmp_path / "ckpt")
    state = model.state_dict()
    config_path = _rewrite_checksums(tmp_path, state, "crc32", 2)
    manifest = json.loads(config_path.read_text())
    entry = manifest["files"]["model.safetensors"]["ln_f.bias"]
    assert entry["checksum"] == f"crc32:{zlib.crc32(state['ln_f.bias'].numpy()):08x}"
    _, loaded = load_state_dict(tmp_path / "ckpt")
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    converted = convert_checkpoint(tmp_path / "ckpt", tmp_path / "tp", to="tp", tp=2)
    assert converted.tensors == len(state)  # a v2 source reshapes (verified with crc32)
    assert json.loads((tmp_path / "tp" / "config.json").read_text())["format_version"] == 3
    assert _same(load_state_dict(tmp_path / "tp")[1], state)
    good = entry["checksum"]
    entry["checksum"] = "crc32:" + f"{int(good[6:], 16) ^ 1:08x}"
    config_path.write_text(json.dumps(manifest))
    with pytest.raises(ConvertError, match=r"checksum mismatch for tensor 'ln_f\.bias' "
                                           r"\(manifest says crc32:"):
        load_state_dict(tmp_path / "ckpt")
    entry["checksum"] = tensor_checksum(state["ln_f.bias"], "crc32c")
    config_path.write_text(json.dumps(manifest))
    with pytest.raises(ConvertError, match=r"config\.json: files\.model\.safetensors\.ln_f"
                                           r"\.bias\.checksum is a crc32c checksum; "
                                           r"format_version 2 records crc32 "):
        load_state_dict(tmp_path / "ckpt")
    entry["checksum"] = "md5:0123456789abcdef0123456789abcdef"
    config_path.write_text(json.dumps(manifest))
    with pytest.raises(ConvertError, match=r"config\.json: files\.model\.safetensors\.ln_f"
                                           r"\.bias\.checksum: unrecognised checksum "
                                           r"'md5:.*supported: 'crc32c:' or 'crc32:'"):
        load_state_dict(tmp_path / "ckpt")


def test_unfinished_folders_of_a_killed_conversion_are_named(tmp_path: Path) -> None:
    """A conversion killed (SIGKILL) leaves its ``.NAME.partial-*`` folder: the next
    conversion to the same place names it in a note, and deletes nothing (another
    conversion may be writing it)."""
    from mt_formats import convert_checkpoint

    save_model(_model(), tmp_path / "ckpt")
    left = tmp_path / ".out.partial-abc123"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"x" * 2**20)
    notes = convert_checkpoint(tmp_path / "ckpt", tmp_path / "out", to="hf").notes
    said = [note for note in notes if "unfinished folder" in note]
    assert len(said) == 1 and ".out.partial-abc123" in said[0] and "1.0 MiB" in said[0]
    assert left.is_dir()
    notes = convert_checkpoint(tmp_path / "ckpt", tmp_path / "other", to="hf").notes
    assert not [note for note in notes if "unfinished folder" in note]
