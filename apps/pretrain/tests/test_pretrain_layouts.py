"""More layouts of `mt pretrain` against the one-process run: pipeline schedules (GPipe,
interleaved), sequence parallelism with activation checkpointing, ZeRO 2 and 3, compiled
forward + loss (torch.compile, through TP collectives and the pipeline executor), fp16
through the pipeline; per-step losses and the validation loss (which must not depend on the
layout either). 6 steps each, 1-4 processes."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
from conftest import run_pretrain

from mt_pretrain.train import NonFiniteLossError

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
    {"nproc": 4, "tp": 1, "pp": 4, "schedule": "gpipe"},
    {"nproc": 2, "tp": 1, "pp": 2, "schedule": "interleaved", "virtual_stages": 2},
    {"nproc": 4, "tp": 2, "pp": 2, "sequence_parallel": True, "activation_checkpointing": True},
    {"nproc": 2, "tp": 1, "pp": 1, "zero_stage": 2},
    {"nproc": 2, "tp": 2, "pp": 1, "zero_stage": 3},
    # A cold compilation takes ~50 s per rank on 2 loaded cores while peers wait.
    {"nproc": 2, "tp": 1, "pp": 1, "zero_stage": 1, "compile": True, "timeout": 300.0},
    {"nproc": 4, "tp": 2, "pp": 2, "compile": True, "timeout": 300.0},
], ids=["gpipe-pp4", "interleaved-pp2", "tp2-sp-ac-pp2", "zero2-dp2", "zero3-tp2",
        "compile-dp2", "compile-tp2-pp2"])
def test_pretrain_layout_matches_one_process(layout: dict[str, Any], reference: Any,
                                             cache: Path, tmp_path: Path) -> None:
    summary = _run(tmp_path, cache, **layout)
    assert summary.losses == pytest.approx(reference.losses, rel=1e-4)
    assert summary.val_loss == pytest.approx(reference.val_loss, rel=1e-4)


def test_pretrain_fp16_pipeline_reports_unscaled_loss(reference: Any, cache: Path,
                                                      tmp_path: Path) -> None:
    summary = _run(tmp_path, cache, nproc=2, tp=1, pp=2, precision="fp16")
    # fp16 rounding only: the loss scale (65536) must not leak into the reported loss.
    assert summary.losses == pytest.approx(reference.losses, rel=2e-3)


def test_pretrain_nan_loss_stops_with_a_clear_error(cache: Path, tmp_path: Path) -> None:
    # An absurd learning rate without clipping blows the weights up after one step.
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 2 \(lr "):
        _run(tmp_path, cache, nproc=1, tp=1, pp=1, lr=1e30, clip_grad=0.0, warmup_tokens=0)
