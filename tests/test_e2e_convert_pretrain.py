"""Cross-app: ``mt convert`` reads the checkpoints of a real ``mt pretrain`` run (TP 2 x PP 2,
4 gloo processes): the weights equal mt_pretrain's own consolidation, and ``--to hf`` works on a
step folder or on the checkpoints folder (its ``latest``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mt_convert import ConvertError, convert_checkpoint, load_state_dict, open_checkpoint
from mt_convert.cli import app
from mt_pretrain.checkpoint import consolidated_model
from mt_pretrain.config_io import load_config
from mt_pretrain.launch import launch


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pretrain")
    config = load_config(None, {
        "model": "tiny", "seq_len": 32, "dropout": 0.0, "micro_batch_size": 2,
        "global_batch_size": 4, "train_steps": 2, "eval_interval": 0, "sample_tokens": 0,
        "progress": False, "log_interval": 100, "timeout": 120.0, "nproc": 4, "tp": 2,
        "pp": 2, "dp": 1, "zero_stage": 0, "save_interval": 2, "out_dir": str(out),
        "cache_dir": str(out / "cache")})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        launch(config, environ={}, timeout=300)
    finally:
        torch.set_num_threads(threads)
    return out / "checkpoints"


def test_convert_pretrain_weights_match_mt_pretrain(checkpoints: Path, tmp_path: Path) -> None:
    model_dict, reference = consolidated_model(checkpoints)
    result = convert_checkpoint(checkpoints / "step-00000002", tmp_path / "full")
    assert result.source_format == "pretrain" and result.tensors == len(reference)
    config, state = load_state_dict(tmp_path / "full")
    assert config.to_dict() == model_dict
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in reference)


def test_convert_pretrain_cli_to_hf(checkpoints: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, [str(checkpoints), str(tmp_path / "hf"), "--to", "hf"])
    assert result.exit_code == 0, result.output
    _, hf = load_state_dict(tmp_path / "hf")
    _, reference = consolidated_model(checkpoints)
    assert all(torch.equal(hf[k], reference[k]) for k in reference)
    with open_checkpoint(checkpoints) as reader:
        sources = reader.sources("embed.tokens.weight")
    assert [(ref.file, ref.spec.shape) for ref in sources] == [
        ("rank-00000.pt", (512, 64)), ("rank-00001.pt", (512, 64)),
        ("rank-00002.pt", (512, 64)), ("rank-00003.pt", (512, 64))]  # both ends, tied


def test_convert_pretrain_missing_rank_is_an_error(checkpoints: Path, tmp_path: Path) -> None:
    broken = tmp_path / "step"
    shutil.copytree(checkpoints / "step-00000002", broken)
    (broken / "rank-00003.pt").unlink()
    with pytest.raises(ConvertError, match=r"rank-00003\.pt: file not found \(incomplete"):
        convert_checkpoint(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()
