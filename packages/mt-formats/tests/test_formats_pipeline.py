"""Sharded (TP x PP) layouts: every pair of layouts gives the same model (bit-identical
round trips, equal logits), files load strictly into real mt_pipeline stages of a real
2-rank tensor-parallel model, vocabulary re-padding, and clear errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from mt_dist.testing import run_distributed
from mt_formats import ConvertError, convert_checkpoint, load_model, open_checkpoint, save_model
from mt_formats.tensors import tensor_checksum
from mt_model import GPT, GPTConfig, preset
from mt_pipeline import build_stage, uniform_partition
from mt_tensor_parallel import GPT_PLAN, apply_tensor_parallel

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[Path, GPT, torch.Tensor, torch.Tensor]:
    """The tiny model saved in every layout, its reference logits on a fixed batch."""
    root = tmp_path_factory.mktemp("layouts")
    model = GPT(preset("tiny"), seed=5).eval()
    for tp, pp in LAYOUTS:
        save_model(model, root / f"tp{tp}pp{pp}", to="tp", tp=tp, pp=pp)
    idx = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return root, model, model(idx), idx


@pytest.mark.parametrize("a", LAYOUTS, ids=lambda x: f"tp{x[0]}pp{x[1]}")
def test_convert_pipeline_every_pair_of_layouts(saved: tuple, tmp_path: Path,
                                                a: tuple[int, int]) -> None:
    root, _, reference, idx = saved
    source = root / f"tp{a[0]}pp{a[1]}"
    for b in LAYOUTS:
        if b == a:
            continue
        there, back = tmp_path / f"to{b}", tmp_path / f"back{b}"
        convert_checkpoint(source, there, to="tp", tp=b[0], pp=b[1])
        with torch.no_grad():
            logits = load_model(there)(idx)
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
        convert_checkpoint(there, back, to="tp", tp=a[0], pp=a[1])
        assert _files(back) == _files(source)  # A -> B -> A bit-identical, manifest included


def test_convert_pipeline_stage_files(saved: tuple) -> None:
    root, model, _, _ = saved
    manifest = json.loads((root / "tp2pp2" / "config.json").read_text())
    assert manifest["layout"] == {"tp": 2, "pp": 2, "pad_multiple": 128,
                                  "stage_layers": [[0, 2], [2, 4]]}
    first = load_file(str(root / "tp2pp2" / "pp_rank_00_tp_rank_01" / "model.safetensors"))
    last = load_file(str(root / "tp2pp2" / "pp_rank_01_tp_rank_01" / "model.safetensors"))
    assert sorted({k.split(".")[0] + (k.split(".")[1] if k[0] == "b" else "") for k in first}) \
        == ["blocks0", "blocks1", "embed"]
    assert sorted({k.split(".")[0] + (k.split(".")[1] if k[0] == "b" else "") for k in last}) \
        == ["blocks2", "blocks3", "embed", "ln_f"]
    assert "embed.positions.weight" not in last  # only the tied token embedding
    torch.testing.assert_close(first["embed.tokens.weight"], last["embed.tokens.weight"],
                               atol=0, rtol=0)
    assert first["embed.tokens.weight"].shape == (512, 64)  # 1000 -> 1024 rows, half each
    assert torch.equal(first["embed.tokens.weight"][:488], model.embed.tokens.weight[512:])


def _stage_logits(directory: str, idx: torch.Tensor) -> torch.Tensor:
    """On each TP rank: a real TP model whose two pipeline stages (mt_pipeline) load their
    files strictly; the logits of the whole model follow."""
    rank = dist.get_rank()
    config = GPTConfig.from_dict(json.loads((Path(directory) / "config.json").read_text())
                                 ["model"])
    model = apply_tensor_parallel(GPT(config, seed=None), dist.new_group([0, 1]), GPT_PLAN)
    plan = uniform_partition(config.n_layers, 2)
    for stage in plan.stages:
        path = Path(directory) / f"pp_rank_{stage.stage:02d}_tp_rank_{rank:02d}"
        build_stage(model, stage).load_state_dict(load_file(str(path / "model.safetensors")),
                                                  strict=True)
    with torch.no_grad():
        return model.eval()(idx)


def test_convert_pipeline_files_load_into_real_tp_pipeline_stages(saved: tuple,
                                                                  tmp_path: Path) -> None:
    root, _, reference, idx = saved
    convert_checkpoint(root / "tp4pp1", tmp_path / "tp2pp2", to="tp", tp=2, pp=2)
    results = run_distributed(_stage_logits, 2, str(tmp_path / "tp2pp2"), idx, timeout=120.0)
    logits = torch.cat(results, dim=-1)[..., :1000]  # vocab-parallel logits, drop padding
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)


def test_convert_pipeline_vocabulary_repadding(saved: tuple, tmp_path: Path) -> None:
    root, _, reference, idx = saved
    for (tp, pp), pad in itertools.product([(4, 1), (1, 2)], [1, 8, 300]):
        out = tmp_path / f"tp{tp}pp{pp}pad{pad}"
        convert_checkpoint(root / "tp2pp2", out, to="tp", tp=tp, pp=pp, pad_multiple=pad)
        rows = -(-1000 // (pad * tp)) * pad * tp // tp
        first = "tp_rank_00" if pp == 1 else "pp_rank_00_tp_rank_00"
        shards = load_file(str(out / first / "model.safetensors"))
        assert shards["embed.tokens.weight"].shape == (rows, 64)
        with torch.no_grad():
            torch.testing.assert_close(load_model(out)(idx), reference, atol=1e-5, rtol=0)
        convert_checkpoint(out, tmp_path / f"back{tp}{pp}{pad}", to="tp", tp=2, pp=2)
        assert _files(tmp_path / f"back{tp}{pp}{pad}") == _files(root / "tp2pp2")


def test_convert_pipeline_errors(saved: tuple, tmp_path: Path) -> None:
    root, model, _, _ = saved
    with pytest.raises(ConvertError, match=r"cannot split the model into pp=3 stages: .*"
                                           r"num_layers \(4\) divisible by num_stages \(3\)"):
        convert_checkpoint(root / "tp1pp1", tmp_path / "x", to="tp", pp=3)
    with pytest.raises(ConvertError, match="--pp 2 only applies to the tp and megatron"):
        convert_checkpoint(root / "tp1pp1", tmp_path / "x", to="hf", pp=2)
    assert not (tmp_path / "x").exists()
    save_model(model, tmp_path / "bad", to="tp", tp=1, pp=2)
    config_path = tmp_path / "bad" / "config.json"
    manifest = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**manifest, "layout": {**manifest["layout"],
                                                              "stage_layers": [[0, 1], [2, 4]]}}))
    with pytest.raises(ConvertError, match=r"stage_layers \[\[0, 1\], \[2, 4\]\] must be 2 "
                                           "contiguous ranges covering layers 0..3"):
        open_checkpoint(tmp_path / "bad")
    config_path.write_text(json.dumps(manifest))
    # a last stage whose copy of the tied embedding diverged (checksums updated to match)
    file = "pp_rank_01_tp_rank_00/model.safetensors"
    tensors = load_file(str(tmp_path / "bad" / file))
    tensors["embed.tokens.weight"][3, 3] += 1.0
    save_file(tensors, str(tmp_path / "bad" / file))
    manifest["files"][file]["embed.tokens.weight"]["checksum"] = tensor_checksum(
        tensors["embed.tokens.weight"])
    config_path.write_text(json.dumps(manifest))
    with pytest.raises(ConvertError, match=r"pp_rank_01_tp_rank_00/model\.safetensors: tied "
                                           r"tensor 'embed\.tokens\.weight' differs from "
                                           "pipeline stage 0's copy"):
        convert_checkpoint(tmp_path / "bad", tmp_path / "out")
    assert not (tmp_path / "out").exists()
