"""Tensor-parallel layout: exact split/merge round trips, the same slices as
mt_tensor_parallel, real 2-rank gloo model loading, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from mt_dist.testing import run_distributed
from mt_formats import (
    ConvertError,
    TensorSpec,
    canonical_shapes,
    convert_checkpoint,
    load_state_dict,
    make_writer,
    open_checkpoint,
    save_model,
)
from mt_formats.safetensors_io import SafetensorsReader
from mt_formats.tensors import tensor_checksum
from mt_model import GPT, GPTConfig, preset
from mt_tensor_parallel import GPT_PLAN, apply_tensor_parallel, shard_state_dict


def _model() -> GPT:
    return GPT(preset("tiny"), seed=21).eval()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_convert_tp_round_trip_is_bit_identical(tmp_path: Path, tp: int) -> None:
    save_model(_model(), tmp_path / "full")
    result = convert_checkpoint(tmp_path / "full", tmp_path / "tp", to="tp", tp=tp)
    assert result.target_format == "tp" and result.tensors == 52
    assert sorted(p.name for p in (tmp_path / "tp").iterdir()) == [
        "config.json", *[f"tp_rank_{r:02d}" for r in range(tp)]]
    convert_checkpoint(tmp_path / "tp", tmp_path / "back")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "full" / name).read_bytes() == (tmp_path / "back" / name).read_bytes()


def test_convert_tp_shards_are_mt_tensor_parallel_slices(tmp_path: Path) -> None:
    model = _model()
    save_model(model, tmp_path / "tp", to="tp", tp=2)
    manifest = json.loads((tmp_path / "tp" / "config.json").read_text())
    assert manifest["format"] == "mt-sharded"
    assert manifest["layout"] == {"tp": 2, "pp": 1, "pad_multiple": 128}
    for rank in range(2):
        want = shard_state_dict(model.state_dict(), GPT_PLAN, rank, 2)
        got = load_file(str(tmp_path / "tp" / f"tp_rank_{rank:02d}" / "model.safetensors"))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        entries = manifest["files"][f"tp_rank_{rank:02d}/model.safetensors"]
        assert all(entries[k]["checksum"] == tensor_checksum(want[k]) for k in want)
    # vocabulary padded to 128 * tp = 256 rows: 1000 -> 1024, 512 per rank
    assert got["embed.tokens.weight"].shape == (512, 64)
    assert got["blocks.0.attn.qkv.weight"].shape == (96, 64)


def test_convert_hf_to_tp_and_back(tmp_path: Path) -> None:
    save_model(_model(), tmp_path / "hf", to="hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "tp4", to="tp", tp=4)
    convert_checkpoint(tmp_path / "tp4", tmp_path / "hf2", to="hf")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "hf2" / name).read_bytes()


def _rank_logits(directory: str, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On each rank: build the TP model from the plain GPT and load this rank's file."""
    rank = dist.get_rank()
    reader = SafetensorsReader(Path(directory) / f"tp_rank_{rank:02d}" / "model.safetensors")
    with open(Path(directory) / "config.json") as handle:
        config = GPTConfig.from_dict(json.load(handle)["model"])
    model = apply_tensor_parallel(GPT(config, seed=None), dist.new_group([0, 1]), GPT_PLAN)
    model.load_state_dict({k: reader.get(k) for k in reader.keys()}, strict=True)
    model.eval()
    with torch.no_grad():
        return model(idx[:, :-1]), model(idx[:, :-1], idx[:, 1:])


def test_convert_tp_checkpoint_loads_into_a_real_tp_model(tmp_path: Path) -> None:
    model = _model()
    save_model(model, tmp_path / "tp", to="tp", tp=2)
    idx = torch.randint(0, 1000, (2, 33), generator=torch.Generator().manual_seed(0))
    results = run_distributed(_rank_logits, 2, str(tmp_path / "tp"), idx, timeout=120.0)
    logits = torch.cat([local for local, _ in results], dim=-1)[..., :1000]  # drop padding
    with torch.no_grad():
        torch.testing.assert_close(logits, model(idx[:, :-1]), atol=1e-5, rtol=0)
        for _, loss in results:
            torch.testing.assert_close(loss, model(idx[:, :-1], idx[:, 1:]), atol=1e-5, rtol=0)


def test_convert_tp_errors(tmp_path: Path) -> None:
    save_model(_model(), tmp_path / "full")
    with pytest.raises(ConvertError, match="n_heads 4 is not divisible by tp 3"):
        convert_checkpoint(tmp_path / "full", tmp_path / "tp3", to="tp", tp=3)
    assert not (tmp_path / "tp3").exists()
    with pytest.raises(ConvertError, match="--tp 2 only applies to the tp and megatron formats"):
        convert_checkpoint(tmp_path / "full", tmp_path / "x", to="hf", tp=2)
    convert_checkpoint(tmp_path / "full", tmp_path / "tp", to="tp", tp=2)
    config_path = tmp_path / "tp" / "config.json"
    manifest = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**manifest, "layout": {**manifest["layout"], "pp": 2}}))
    with pytest.raises(ConvertError, match=r"files .* do not match tp=2 pp=2 \(expected "
                                           r"\['pp_rank_00_tp_rank_00/model\.safetensors'"):
        open_checkpoint(tmp_path / "tp")
    config_path.write_text(json.dumps(manifest))
    shutil.rmtree(tmp_path / "tp" / "tp_rank_01")
    with pytest.raises(ConvertError, match=r"tp_rank_01/model\.safetensors: file not found"):
        open_checkpoint(tmp_path / "tp")


def test_a_model_section_edited_after_the_weights_is_refused(tmp_path: Path) -> None:
    """config.json's model section must be the one the weights were written for: a vocabulary
    size the padded rows of a tp file would hide, or a RoPE base no shape shows, is refused in
    one line naming the field; a training setting (dropout) may change."""
    save_model(_model(), tmp_path / "tp", to="tp", tp=2)
    config_path = tmp_path / "tp" / "config.json"
    manifest = json.loads(config_path.read_text())
    for field, value in (("vocab_size", 999), ("vocab_size", 1001), ("layernorm_eps", 1e-6)):
        config_path.write_text(json.dumps({**manifest,
                                           "model": {**manifest["model"], field: value}}))
        with pytest.raises(ConvertError, match=rf"config.json: model.{field} is {value!r}, where "
                                               rf"model.safetensors was written for "
                                               rf"{manifest['model'][field]!r}: the model section "
                                               "was edited after the weights were written"):
            open_checkpoint(tmp_path / "tp")
    config_path.write_text(json.dumps({**manifest, "model": {**manifest["model"],
                                                             "dropout": 0.1}}))
    assert open_checkpoint(tmp_path / "tp").config.dropout == 0.1

    rope = GPTConfig(**{**preset("tiny").to_dict(), "position": "rope"})
    save_model(GPT(rope, seed=1), tmp_path / "full")
    config_path = tmp_path / "full" / "config.json"
    manifest = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**manifest, "model": {**manifest["model"],
                                                             "rope_theta": 500000.0}}))
    with pytest.raises(ConvertError, match=r"model.rope_theta is 500000.0, where "
                                           r"model.safetensors was written for 10000.0"):
        convert_checkpoint(tmp_path / "full", tmp_path / "out", to="hf")
    assert not (tmp_path / "out").exists()


def test_convert_tp_replicated_tensors_must_agree(tmp_path: Path) -> None:
    save_model(_model(), tmp_path / "tp", to="tp", tp=2)
    path = tmp_path / "tp" / "tp_rank_01" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["ln_f.weight"] = tensors["ln_f.weight"] + 1.0  # a diverged replica
    save_file(tensors, str(path), metadata={"format": "pt"})
    config_path = tmp_path / "tp" / "config.json"
    manifest = json.loads(config_path.read_text())
    entry = manifest["files"]["tp_rank_01/model.safetensors"]["ln_f.weight"]
    entry["checksum"] = tensor_checksum(tensors["ln_f.weight"])  # checksums alone pass
    config_path.write_text(json.dumps(manifest))
    with pytest.raises(ConvertError, match=r"tp_rank_01/model\.safetensors: replicated tensor "
                                           r"'ln_f\.weight' differs from tp rank 0's copy"):
        load_state_dict(tmp_path / "tp")
    with pytest.raises(ConvertError, match=r"tp_rank_01/model\.safetensors: replicated tensor "
                                           r"'ln_f\.weight' differs from tp rank 0's copy"):
        convert_checkpoint(tmp_path / "tp", tmp_path / "out")  # merged file to file
    assert not (tmp_path / "out").exists()


def test_convert_tp_plan_for_mt_nlg_530b_without_memory() -> None:
    # Planning (what --dry-run prints) needs only shapes: 530B at TP 8 on the meta device.
    config = preset("mt-nlg-530b")
    specs = {name: TensorSpec(shape, torch.bfloat16)
             for name, shape in canonical_shapes(config).items()}
    writer = make_writer("tp", config, specs, tp=8)
    qkv = writer.targets("blocks.104.attn.qkv.weight")
    assert [ref.spec.shape for ref in qkv] == [(7680, 20480)] * 8  # 3 * 20480 / 8 rows
    assert writer.targets("embed.tokens.weight")[7].spec.shape == (6400, 20480)
    assert writer.targets("blocks.0.attn.proj.weight")[0].spec.shape == (20480, 2560)
    per_rank = sum(writer.targets(name)[3].spec.nbytes for name in specs)
    full = sum(spec.nbytes for spec in specs.values())
    assert full / 8 < per_rank < full / 8 * 1.01  # only LayerNorms, biases, positions repeat
