"""Layout features beyond the matrix (test_contract_matrix.py): compiled forward + loss
(torch.compile, through TP collectives and the pipeline executor), activation checkpointing
that replays dropout masks exactly, and the NaN stop. 6 steps each, 1-4 processes."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_pretrain

from mt_pretrain.run.train import NonFiniteLossError

COMMON: dict[str, Any] = {
    "model": "tiny", "seq_len": 32, "dropout": 0.0, "micro_batch_size": 2,
    "global_batch_size": 8, "train_steps": 6, "eval_interval": 3, "eval_iters": 1,
    "sample_tokens": 0, "progress": False, "log_interval": 100, "timeout": 120.0,
    "save": "none",
}


_run = partial(run_pretrain, COMMON)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Any:
    return _run(tmp_path_factory.mktemp("ref"), cache, nproc=1, tp=1, pp=1, zero_stage=0)


@pytest.mark.parametrize("layout", [
    # A cold compilation takes ~50 s per rank on 2 loaded cores while peers wait.
    {"nproc": 2, "tp": 1, "pp": 1, "zero_stage": 1, "compile": True, "timeout": 300.0},
    {"nproc": 4, "tp": 2, "pp": 2, "compile": True, "timeout": 300.0},
], ids=["compile-dp2", "compile-tp2-pp2"])
def test_compiled_layout_matches_one_process(layout: dict[str, Any], reference: Any,
                                             cache: Path, tmp_path: Path) -> None:
    summary = _run(tmp_path, cache, **layout)
    assert summary.losses == pytest.approx(reference.losses, rel=1e-5)
    assert summary.val_loss == pytest.approx(reference.val_loss, rel=1e-5)


@pytest.mark.parametrize("layout", [
    {"nproc": 4, "tp": 2, "pp": 2, "dp": 1, "zero_stage": 0},
    {"nproc": 2, "tp": 1, "pp": 1, "dp": 2, "zero_stage": 1},
], ids=["tp2-pp2", "dp2-zero1"])
def test_checkpointing_replays_dropout_exactly(layout: dict[str, Any], cache: Path,
                                               tmp_path: Path) -> None:
    """Dropout 0.1: with --activation-checkpointing a layout trains bit for bit as without,
    because the recomputation re-enters each layer's keyed RNG region (the default generator
    and the TP streams of attention dropout alike) and draws the forward's masks."""
    options = {**layout, "dropout": 0.1, "keep_weights": True}
    plain = _run(tmp_path / "plain", cache, **options)
    recomputed = _run(tmp_path / "ac", cache, activation_checkpointing=True, **options)
    assert recomputed.losses == plain.losses
    assert [r["grad_norm"] for r in recomputed.records] == [
        r["grad_norm"] for r in plain.records]
    assert recomputed.val_loss == plain.val_loss
    for name, weight in plain.weights.items():
        assert torch.equal(recomputed.weights[name], weight), name
    assert plain.losses[-1] < plain.losses[0]


def test_pretrain_nan_loss_stops_with_a_clear_error(cache: Path, tmp_path: Path) -> None:
    # An absurd learning rate without clipping blows the weights up after one step.
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 2 \(lr "):
        _run(tmp_path, cache, nproc=1, tp=1, pp=1, lr=1e30, clip_grad=0.0, warmup_tokens=0)


def test_llama_architecture_trains_like_one_process(cache: Path, tmp_path: Path) -> None:
    """The llama-test preset (RoPE, RMSNorm, SwiGLU, 4 query / 2 key-value heads, no biases,
    untied head) at DP 2 with ZeRO-1 trains like one process (losses, grad norms, every final
    weight); tensor and pipeline parallelism refuse it by name until they support it."""
    options = {"model": "llama-test", "keep_weights": True}
    one = _run(tmp_path / "one", cache, nproc=1, tp=1, pp=1, zero_stage=0, **options)
    two = _run(tmp_path / "two", cache, nproc=2, tp=1, pp=1, dp=2, zero_stage=1, **options)
    assert one.losses[-1] < one.losses[0]
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
    assert [r["grad_norm"] for r in two.records] == pytest.approx(
        [r["grad_norm"] for r in one.records], rel=1e-5)
    assert one.weights.keys() == two.weights.keys() and "head.weight" in one.weights
    for name, value in one.weights.items():  # the matrix's metric: relative L2 per tensor
        error = float((two.weights[name] - value).norm()) / float(value.norm())
        assert error < 1e-5, (name, error)
    from mt_pretrain.config.schema import ConfigError

    with pytest.raises(ConfigError, match=r"architecture \(position=rope.*not with --tp"):
        _run(tmp_path / "tp", cache, nproc=2, tp=2, pp=1, **options)
