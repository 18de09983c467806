"""Cross-app: ``mt pretrain --engine deepspeed`` (ZeRO-1, 2 gloo processes, 3 steps) saves a
DeepSpeed checkpoint; ``mt convert`` refuses it with the ``ds_to_universal`` command to run,
and after DeepSpeed's ``ds_to_universal`` converts it: the weights equal the DeepSpeed
engine's module weights bit for bit and the converted model's logits equal those of a GPT
holding the engine's weights (fp32, asserted 1e-5)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mt_convert.cli import app
from mt_formats import load_model
from mt_model import GPT
from mt_pretrain.config.load import load_config
from mt_pretrain.launch import launch

STEPS = 3


def test_pretrain_deepspeed_checkpoint_converts_exactly(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    config = load_config(None, {
        "model": "tiny", "seq_len": 32, "dropout": 0.0, "micro_batch_size": 2,
        "global_batch_size": 4, "train_steps": STEPS, "eval_interval": 0, "sample_tokens": 0,
        "progress": False, "log_interval": 100, "timeout": 120.0, "nproc": 2, "tp": 1,
        "pp": 1, "zero_stage": 1, "engine": "deepspeed", "out_dir": str(tmp_path / "run"),
        "cache_dir": str(tmp_path / "cache")})
    summary = launch(config, environ={}, timeout=300)
    assert len(summary.losses) == STEPS
    root = tmp_path / "run" / "checkpoints"
    step = root / f"step-{STEPS:08d}"

    runner = CliRunner()
    native = runner.invoke(app, [str(root), str(tmp_path / "out"), "--model", "tiny"])
    assert native.exit_code == 2 and "ds_to_universal" in native.output, native.output
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "mt" / "torch_extensions")}
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", str(step), "--output_folder", str(root / "universal"),
                    "--inject_missing_state", "--num_extract_workers", "1",
                    "--num_merge_workers", "1"],
                   check=True, capture_output=True, timeout=180, env=env)

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
