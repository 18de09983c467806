"""Cross-app: a randomly initialised ``transformers.GPT2LMHeadModel`` saved with
``save_pretrained`` -> ``mt convert --to pretrain`` -> ``mt pretrain --load`` trains from it.

The first step's loss equals the loss the HF model computes on the same global batch of the
run's data (measured relative difference ~1e-7, asserted 1e-4), which shows the weights
arrived intact; the loss then falls. The converted folder also reads back (PretrainReader)
bit-identical to the HF weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from mt_convert import load_state_dict
from mt_convert.cli import app
from mt_data import DataLoaderState
from mt_model import preset
from mt_pretrain.config_io import load_config
from mt_pretrain.data import ensure_data, make_loaders, to_batch
from mt_pretrain.launch import launch
from mt_pretrain.plan import resolve

transformers = pytest.importorskip("transformers")

SEQ, STEPS = 32, 6
TINY = preset("tiny")


def _hf_model(folder: Path) -> torch.nn.Module:
    """A random GPT-2 with the shape and settings of mt's tiny preset (exact init_std and
    plain GeLU: `mt pretrain --load` refuses a model config that differs)."""
    config = transformers.GPT2Config(
        vocab_size=TINY.vocab_size, n_positions=SEQ, n_embd=TINY.hidden, n_layer=TINY.n_layers,
        n_head=TINY.n_heads, activation_function="gelu", initializer_range=TINY.init_std,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder)
    return model


def test_hf_to_pretrain_then_training_resumes(tmp_path: Path) -> None:
    hf = _hf_model(tmp_path / "hf")
    result = CliRunner().invoke(app, [str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--to",
                                      "pretrain"])
    assert result.exit_code == 0, result.output
    # The pretrain folder reads back as the same weights.
    config, back = load_state_dict(tmp_path / "ckpt")
    _, original = load_state_dict(tmp_path / "hf")
    assert config == TINY.replace(seq_len=SEQ)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)

    run = load_config(None, {
        "model": "tiny", "seq_len": SEQ, "dropout": 0.0, "micro_batch_size": 2,
        "global_batch_size": 4, "train_steps": STEPS, "eval_interval": 0, "sample_tokens": 0,
        "progress": False, "log_interval": 100, "timeout": 120.0, "nproc": 1, "tp": 1,
        "pp": 1, "zero_stage": 1, "save": "none", "load": str(tmp_path / "ckpt"),
        "out_dir": str(tmp_path / "run"), "cache_dir": str(tmp_path / "cache")})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = launch(run, environ={}, timeout=300)
    finally:
        torch.set_num_threads(threads)
    assert len(summary.losses) == STEPS

    # The run's first global batch, from its own (fresh) data loader.
    plan = resolve(run, 1)
    loader, _ = make_loaders(run, plan, ensure_data(run, tmp_path / "cache"), 0,
                             DataLoaderState())
    batch = to_batch(loader.next())
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
    hf_loss = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                    batch[:, 1:].reshape(-1)))
    assert summary.losses[0] == pytest.approx(hf_loss, rel=1e-4)
    assert summary.losses[-1] < summary.losses[0] - 0.1  # training goes on from it
