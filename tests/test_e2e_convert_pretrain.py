"""Cross-app: ``mt convert`` reads the checkpoints of a real ``mt pretrain`` run (TP 2 x PP 2,
4 gloo processes): the weights equal mt_pretrain's own consolidation, and ``--to hf`` works on a
step folder or on the checkpoints folder (its ``latest``). ``mt convert --tp --pp --dp
--zero-stage`` carries the AdamW state to another layout: ``mt pretrain --load`` of the result
continues with the losses of resuming from the original checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from mt_checkpoint import find_checkpoint, load_rank, merge_model, read_meta
from mt_convert.cli import app
from mt_formats import ConvertError, convert_checkpoint, load_state_dict, open_checkpoint
from mt_pretrain.config.load import load_config
from mt_pretrain.launch import launch


def consolidated_model(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The oracle, independent of mt-formats' reader: every (stage, TP slice) of DP replica 0
    read with mt-checkpoint and merged by its own resharding code."""
    folder = find_checkpoint(path)
    meta = read_meta(folder)
    parts = {(pp, tp): load_rank(folder, meta.layout.rank(pp, 0, tp))["model"]
             for pp in range(meta.layout.pp) for tp in range(meta.layout.tp)}
    return dict(meta.model), merge_model(parts, dict(meta.styles), meta.model["vocab_size"])


COMMON: dict[str, Any] = {
    "model": "tiny", "seq_len": 32, "dropout": 0.0, "micro_batch_size": 2,
    "global_batch_size": 4, "eval_interval": 0, "sample_tokens": 0, "progress": False,
    "log_interval": 100, "timeout": 120.0}


def _pretrain(out: Path, cache: Path, **options: Any) -> Any:
    config = load_config(None, {**COMMON, **options, "out_dir": str(out),
                                "cache_dir": str(cache)})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return launch(config, environ={}, timeout=300)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 steps at TP 2 x PP 2 x DP 1, ZeRO 0 (AdamW state after 2 steps is saved)."""
    out = tmp_path_factory.mktemp("pretrain")
    _pretrain(out, out / "cache", train_steps=2, nproc=4, tp=2, pp=2, dp=1, zero_stage=0,
              save_interval=2)
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


def test_convert_pretrain_carries_optimizer_to_another_layout(checkpoints: Path,
                                                              tmp_path: Path) -> None:
    """TP 2 x PP 2 x DP 1 (ZeRO 0) -> TP 1 x PP 1 x DP 2 (ZeRO 2): resuming from the
    converted checkpoint trains exactly like resuming from the original one."""
    cache = checkpoints.parent / "cache"
    layout = {"nproc": 2, "tp": 1, "pp": 1, "dp": 2, "zero_stage": 2, "train_steps": 4,
              "save": "none"}
    result = CliRunner().invoke(app, [str(checkpoints), str(tmp_path / "converted"), "--tp",
                                      "1", "--pp", "1", "--dp", "2", "--zero-stage", "2"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "converted").iterdir()) == [
        "meta.json", "rank-00000.pt", "rank-00001.pt"]
    reference = _pretrain(tmp_path / "ref", cache, load=str(checkpoints), **layout)
    resumed = _pretrain(tmp_path / "new", cache, load=str(tmp_path / "converted"), **layout)
    assert reference.start_step == resumed.start_step == 2
    assert len(resumed.losses) == 2
    assert resumed.losses == pytest.approx(reference.losses, rel=1e-5)
    # Dropping the optimizer is a choice, and it shows: fresh Adam moments train differently.
    dropped = CliRunner().invoke(app, [str(checkpoints), str(tmp_path / "dropped"), "--tp",
                                       "1", "--pp", "1", "--dp", "2", "--drop-optimizer"])
    assert dropped.exit_code == 0, dropped.output
    fresh = _pretrain(tmp_path / "fresh", cache, load=str(tmp_path / "dropped"), **layout)
    assert fresh.losses[0] == pytest.approx(reference.losses[0], rel=1e-5)  # same weights
    assert fresh.losses[1] != pytest.approx(reference.losses[1], rel=1e-5)


def test_convert_pretrain_optimizer_state_to_dcp(checkpoints: Path, tmp_path: Path) -> None:
    """The run's AdamW state (TP 2 x PP 2 shards) is written into DCP under torch's flattened
    optimizer keys (transformers' GPT-2 names, Conv1D's transposed storage): the moments and
    step counts of the same checkpoint resharded to one rank by ``--tp 1 --pp 1`` (whose
    resumed training the test above checks), bit for bit, and the run's Adam settings;
    ``--drop-optimizer`` writes none."""
    convert_checkpoint(checkpoints, tmp_path / "dcp", to="dcp")
    convert_checkpoint(checkpoints, tmp_path / "one", to="pretrain", tp=1, pp=1, dp=1,
                       zero_stage=0)
    train = read_meta(find_checkpoint(checkpoints)).config["train"]
    peak = train["lr"]
    with open_checkpoint(tmp_path / "dcp") as stored, open_checkpoint(tmp_path / "one") as one:
        assert stored.names() == one.names()
        for name in one.names():
            ours, want = stored.optimizer_state(name), one.optimizer_state(name)
            assert ours is not None and want is not None, name
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ours[key], want[key]), (name, key)
            assert float(ours["step"]) == float(want["step"]) == 2.0, name
            # Adam's settings: the run's, in the param groups of every stored parameter
            settings = stored.optimizer_settings(name)
            assert settings is not None and settings == one.optimizer_settings(name), name
            assert settings["betas"] == (train["adam_beta1"], train["adam_beta2"]), name
            assert settings["eps"] == train["adam_eps"] and settings["initial_lr"] == peak
            assert settings["weight_decay"] == (train["weight_decay"] if "weight" in name and
                                                "ln" not in name else 0.0), name
            assert 0 < settings["lr"] <= peak, name  # the last step's, on the schedule
    convert_checkpoint(checkpoints, tmp_path / "weights", to="dcp", drop_optimizer=True)
    with open_checkpoint(tmp_path / "weights") as stored:
        assert all(stored.optimizer_state(name) is None for name in stored.names())


def test_a_run_s_progress_goes_to_dcp_as_torchtitan_loads_it(checkpoints: Path,
                                                              tmp_path: Path) -> None:
    """``mt convert --to dcp`` of a run's checkpoint writes its step and tokens as
    torchtitan's ``train_state`` and ``lr_scheduler`` (a load that requires every key finds
    them); converted back to an mt step folder, the run's own schedule starts over, and the
    conversion says how far the source had trained."""
    import torch.distributed.checkpoint as dcp

    meta = read_meta(find_checkpoint(checkpoints))
    assert meta.step == 2 and meta.tokens > 0
    runner = CliRunner()
    there = runner.invoke(app, [str(checkpoints), str(tmp_path / "dcp"), "--to", "dcp"])
    assert there.exit_code == 0, there.output
    state = {"train_state": {"step": -1, "ntokens_seen": -1}, "lr_scheduler": {"last_epoch": -1}}
    dcp.load(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert state == {"train_state": {"step": 2, "ntokens_seen": meta.tokens},
                     "lr_scheduler": {"last_epoch": 2}}
    dry = runner.invoke(app, [str(tmp_path / "dcp"), str(tmp_path / "back"), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert f"the source's training: step 2, {meta.tokens:,} tokens" in dry.output, dry.output
    back = runner.invoke(app, [str(tmp_path / "dcp"), str(tmp_path / "back"), "--to",
                               "pretrain"])
    assert back.exit_code == 0, back.output
    assert f"had trained 2 steps, {meta.tokens:,} tokens" in back.output, back.output
    assert read_meta(tmp_path / "back").step == 0
