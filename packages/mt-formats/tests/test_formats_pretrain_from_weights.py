"""``--to pretrain``: an ``mt pretrain`` step folder (tp = pp = dp = 1, step 0) that reads back
bit-identical and whose rank file is a complete one-rank optimizer shard of the weights.
(``tests/test_e2e_convert_hf_resume.py`` resumes a real ``mt pretrain`` run from one.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mt_formats import ConvertError, convert_checkpoint, load_state_dict, save_model
from mt_model import GPT, preset


def test_to_pretrain_round_trip_and_optimizer_shard(tmp_path: Path) -> None:
    model = GPT(preset("tiny").replace(n_layers=2), seed=3)
    save_model(model, tmp_path / "full")
    result = convert_checkpoint(tmp_path / "full", tmp_path / "step", to="pretrain")
    assert result.target_format == "pretrain"
    assert sorted(p.name for p in (tmp_path / "step").iterdir()) == ["meta.json",
                                                                     "rank-00000.pt"]
    config, state = load_state_dict(tmp_path / "step")  # detected: meta.json
    assert config == model.config
    reference = model.state_dict()
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in reference)

    meta = json.loads((tmp_path / "step" / "meta.json").read_text())
    assert meta["format"] == "mt-pretrain/1" and meta["step"] == 0
    assert meta["data"] == {"consumed_samples": 0, "step": 0}
    assert meta["layout"]["tp"] == meta["layout"]["pp"] == meta["layout"]["dp"] == 1
    assert set(meta["stage_params"]["0"]) == set(reference)
    rank = torch.load(tmp_path / "step" / "rank-00000.pt", weights_only=True)
    shard = rank["optimizer"]
    assert shard["format"] == "mt-zero-shard/1" and len(shard["param_groups"]) == 2
    for piece, master in zip(shard["pieces"], shard["master"]):
        name = piece["name"]
        assert torch.equal(master, reference[name].reshape(-1)), name
        assert piece["group"] == (0 if reference[name].dim() >= 2 else 1)
        assert tuple(shard["shapes"][name]) == tuple(reference[name].shape)


def test_to_pretrain_refuses_layout_options(tmp_path: Path) -> None:
    save_model(GPT(preset("tiny").replace(n_layers=1), seed=1), tmp_path / "full")
    with pytest.raises(ConvertError, match="--tp 2 only applies to the tp and megatron"):
        convert_checkpoint(tmp_path / "full", tmp_path / "step", to="pretrain", tp=2)
    assert not (tmp_path / "step").exists()
