"""Cross-app: ``mt pretrain --engine deepspeed`` (ZeRO-1, 2 gloo processes, 3 steps) saves a
DeepSpeed checkpoint; ``mt convert`` refuses it with the ``ds_to_universal`` command to run,
and after DeepSpeed's ``ds_to_universal`` converts it: the weights equal the DeepSpeed
engine's module weights bit for bit and the converted model's logits equal those of a GPT
holding the engine's weights (fp32, asserted 1e-5).

The same from a TP 2 x PP 2 run (DeepSpeed's ``PipelineModule`` names, tensor-parallel
slices joined by the ``universal_checkpoint_info`` mt writes, no ``--inject_missing_state``):
the weights equal the run's own final weights bit for bit, and Adam's moments equal those of
the run's rank files joined by mt's own ``merge_shards``, bit for bit; without the rules
(``--inject_missing_state`` on a checkpoint stripped of them) mt refuses the folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from mt_checkpoint import sharding_styles
from mt_convert.cli import app
from mt_formats import load_model
from mt_formats.deepspeed_universal import DeepSpeedUniversalReader
from mt_model import GPT
from mt_pretrain.config.load import load_config
from mt_pretrain.launch import launch
from mt_tensor_parallel import merge_shards

STEPS = 3
UNIVERSAL = "universal"


def _train(out: Path, cache: Path, **layout: int) -> Any:
    """``mt pretrain --engine deepspeed`` (ZeRO-1, tiny, 3 steps of 4 sequences), saving at
    the end; the summary holds the final full weights."""
    config = load_config(None, {
        "model": "tiny", "seq_len": 32, "dropout": 0.0, "micro_batch_size": 2,
        "global_batch_size": 4, "train_steps": STEPS, "eval_interval": 0, "sample_tokens": 0,
        "progress": False, "log_interval": 100, "timeout": 120.0, "zero_stage": 1,
        "engine": "deepspeed", "out_dir": str(out), "cache_dir": str(cache), **layout})
    summary = launch(config, environ={}, timeout=300, keep_weights=True)
    assert len(summary.losses) == STEPS
    return summary


def _to_universal(step: Path, out: Path, *extra: str) -> None:
    """DeepSpeed's own converter, as a user runs it."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "mt" / "torch_extensions")}
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", str(step), "--output_folder", str(out),
                    "--num_extract_workers", "1", "--num_merge_workers", "1", *extra],
                   check=True, capture_output=True, timeout=180, env=env)


def test_pretrain_deepspeed_checkpoint_converts_exactly(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    _train(tmp_path / "run", tmp_path / "cache", nproc=2, tp=1, pp=1)
    root = tmp_path / "run" / "checkpoints"
    step = root / f"step-{STEPS:08d}"
    runner = CliRunner()
    native = runner.invoke(app, [str(root), str(tmp_path / "out"), "--model", "tiny"])
    assert native.exit_code == 2 and "ds_to_universal" in native.output, native.output
    _to_universal(step, root / UNIVERSAL)

    # `latest_universal` (written by ds_to_universal) is followed; tiny's heads, seq 32 read
    # from the position embedding.
    result = runner.invoke(app, [str(root), str(tmp_path / "mt"), "--model", "tiny"])
    assert result.exit_code == 0, result.output
    model = load_model(tmp_path / "mt").eval()
    assert model.config.seq_len == 32 and model.config.n_heads == 4
    module = torch.load(step / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    state = model.state_dict()
    assert state.keys() == module.keys()
    assert all(torch.equal(state[k], module[k]) for k in module)
    reference = GPT(model.config, seed=None).eval()
    reference.load_state_dict(module)
    probe = torch.randint(0, model.config.vocab_size, (2, 32),
                          generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (model(probe) - reference(probe)).abs().max() <= 1e-5


def _native_moments(step: Path, tp: int, config: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Adam's moments of every parameter from the run's own ZeRO-1 files (DP 1: each rank's
    flat fp32 partition holds its whole stage), joined over TP by mt's ``merge_shards``: an
    implementation of the join independent of DeepSpeed's."""
    slices: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for path in sorted(step.glob("zero_pp_rank_0_mp_rank_*_optim_states.pt")):
        mp = int(path.name.split("mp_rank_")[1][:2])  # pp * tp + tp rank
        model = torch.load(step / f"mp_rank_{mp:02d}_model_states.pt", weights_only=False)
        state = torch.load(path, weights_only=False)["optimizer_state_dict"]
        for group, mapping in enumerate(state["param_slice_mappings"]):
            flat = state["base_optimizer_state"]["state"][group]
            for ds_name, fragment in mapping.items():
                shape = model["param_shapes"][group][ds_name]
                name = model["mt_names"][ds_name]
                for key in ("exp_avg", "exp_avg_sq"):
                    part = flat[key][fragment.start:fragment.start + fragment.numel]
                    slices.setdefault(name, {}).setdefault(key, {})[mp % tp] = part.view(shape)
    styles = sharding_styles(config, tp)
    return {name: {key: merge_shards(styles[name], [parts[r] for r in range(tp)],
                                     vocab_size=config.vocab_size)
                   for key, parts in moments.items()}
            for name, moments in slices.items()}


def test_tp2_pp2_checkpoint_converts_exactly(tmp_path: Path) -> None:
    """TP 2 x PP 2 through DeepSpeed's pipeline engine, its checkpoint made universal by
    ``ds_to_universal`` with mt's rules: mt reads the run's own weights and Adam moments,
    bit for bit; without the rules, a refusal."""
    pytest.importorskip("deepspeed")
    summary = _train(tmp_path / "run", tmp_path / "cache", nproc=4, tp=2, pp=2)
    step = tmp_path / "run" / "checkpoints" / f"step-{STEPS:08d}"
    _to_universal(step, tmp_path / UNIVERSAL)
    folders = {p.name for p in (tmp_path / UNIVERSAL / "zero").iterdir() if p.is_dir()}
    assert "3.attn.qkv.weight" in folders and "tied_modules.embed.inner.tokens.weight" in folders

    runner = CliRunner()
    result = runner.invoke(app, [str(tmp_path / UNIVERSAL), str(tmp_path / "mt")])
    assert result.exit_code == 0, result.output  # the config from the checkpoint (mt_model)
    model = load_model(tmp_path / "mt").eval()
    state = model.state_dict()
    assert state.keys() == summary.weights.keys()
    assert all(torch.equal(state[k], summary.weights[k]) for k in state)
    reference = GPT(model.config, seed=None).eval()
    reference.load_state_dict(summary.weights)
    probe = torch.randint(0, model.config.vocab_size, (2, 32),
                          generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (model(probe) - reference(probe)).abs().max() <= 1e-5

    # Adam's moments: DeepSpeed's join by mt's rules equals mt's own join of the rank files.
    reader = DeepSpeedUniversalReader(tmp_path / UNIVERSAL)
    native = _native_moments(step, 2, model.config)
    assert sorted(native) == sorted(reader.names())
    for name, moments in native.items():
        joined = reader.optimizer_state(name)
        assert joined is not None and int(joined["step"]) == STEPS, name
        for key, tensor in moments.items():
            assert torch.equal(joined[key], tensor), (name, key)

    # Adam's settings: ds_to_universal keeps the engine's two param groups (matrices with
    # the run's weight decay, biases and norms without), which mt tells apart by that.
    native_groups = torch.load(next(step.glob("zero_pp_rank_0_mp_rank_00_optim_states.pt")),
                               weights_only=False)["optimizer_state_dict"][
                                   "base_optimizer_state"]["param_groups"]
    for name, group in (("blocks.0.attn.qkv.weight", 0), ("blocks.0.ln1.weight", 1)):
        expected = {key: native_groups[group][key] for key in ("lr", "eps", "weight_decay")}
        settings = reader.optimizer_settings(name)
        assert settings == {**expected, "betas": (0.9, 0.95)}, (name, settings)
    assert native_groups[0]["weight_decay"] == 0.1 and native_groups[1]["weight_decay"] == 0

    # Without mt's rules DeepSpeed joins every slice along dimension 0: refused in one line.
    for states in step.glob("mp_rank_*_model_states.pt"):
        data = torch.load(states, weights_only=False)
        data.pop("universal_checkpoint_info")
        torch.save(data, states)
    _to_universal(step, tmp_path / "blind", "--inject_missing_state")
    blind = runner.invoke(app, [str(tmp_path / "blind"), str(tmp_path / "bad")])
    assert blind.exit_code == 2, blind.output
    assert "without universal_checkpoint_info" in blind.output, blind.output
    assert not (tmp_path / "bad").exists()
