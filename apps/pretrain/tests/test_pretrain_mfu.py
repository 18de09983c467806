"""MFU: the matmul probe, the utilization arithmetic, the progress line and the `mfu`
metrics key of a real (one-process, 2-step) run."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console

from mt_model import model_flops_per_token_training, preset
from mt_plan.mfu import measure_peak_flops, model_flops_utilization
from mt_pretrain.config.load import load_config
from mt_pretrain.config.schema import ConfigError
from mt_pretrain.launch import launch
from mt_pretrain.run.metrics import read_metrics
from mt_pretrain.run.progress import Reporter


def test_measure_peak_flops_is_a_plausible_cpu_rate() -> None:
    peak = measure_peak_flops(torch.float32, torch.device("cpu"), size=256, repeats=2)
    assert 1e8 < peak < 1e13  # a CPU core: between 0.1 GFLOP/s and 10 TFLOP/s
    with pytest.raises(ValueError, match="size 0"):
        measure_peak_flops(torch.float32, torch.device("cpu"), size=0)


@pytest.mark.parametrize("rate, sizes", [(1e9, [128, 256]), (1e11, [128, 256, 512, 1024])])
def test_probe_grows_only_while_a_matmul_stays_within_its_budget(
        monkeypatch: pytest.MonkeyPatch, rate: float, sizes: list[int]) -> None:
    """A slow dtype (fp16 on a CPU: about 1 GFLOP/s) is probed at 256, where one matmul
    takes 34 ms (1024 took 8 s to probe, at the start of every fp16 run); a fast one at the
    full size; ``budget_s=None`` takes the size asked for."""
    import mt_plan.mfu as mfu

    seen: list[int] = []
    monkeypatch.setattr(mfu, "_matmul_rate", lambda _d, _v, n, _r: seen.append(n) or rate)
    assert mfu.measure_peak_flops(torch.float16, torch.device("cpu")) == rate
    assert seen == sizes
    seen.clear()
    mfu.measure_peak_flops(torch.float16, torch.device("cpu"), size=512, budget_s=None)
    assert seen == [512]


def test_model_flops_utilization() -> None:
    assert model_flops_utilization(25e12, 100e12) == pytest.approx(0.25)
    assert math.isnan(model_flops_utilization(1.0, float("nan")))
    assert math.isnan(model_flops_utilization(1.0, 0.0))


def test_progress_line_shows_mfu() -> None:
    out = io.StringIO()
    reporter = Reporter(2, 0, True, False, 1, console=Console(file=out, width=200))

    class Stats:
        step, loss, lr, tokens_per_s, tflops_per_rank, grad_norm = 1, 5.0, 1e-3, 1000.0, 0.5, 1.0
        mfu = 0.123

    reporter.step(Stats())
    Stats.mfu = float("nan")
    Stats.step = 2
    reporter.step(Stats())
    lines = out.getvalue().splitlines()
    assert "1,000 tok/s MFU 12.3%" in lines[0]
    assert "MFU n/a" in lines[1]


def test_live_progress_line_keeps_step_bar_and_eta_on_80_columns() -> None:
    """On a terminal of 80 columns the live line stays one row with the step, the bar and
    the ETA; the numbers that do not fit are left out, the loss first to stay."""
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)
    reporter = Reporter(300, 0, True, True, 1, console=console)

    class Stats:
        step, loss, lr, tokens_per_s, tflops_per_rank = 7, 4.5432, 3e-4, 12345.0, 0.02
        grad_norm, mfu, peak_mem_gib = 1.0, 0.221, 0.43

    reporter.step(Stats())
    reporter.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # cursor controls
    last = [line for line in text.replace("\r", "\n").splitlines() if line.strip()][-1]
    assert len(last.rstrip()) <= 80, last
    assert "step" in last and "7/300" in last and "eta" in last and "loss 4.5432" in last, last
    assert "12,345 tok/s" in last, last


def test_pretrain_metrics_carry_mfu(tmp_path: Path, cache: Path) -> None:
    """--peak-tflops fixes the denominator: mfu == model FLOPs per token x tokens/s / peak."""
    config = load_config(None, {
        "model": "tiny", "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 4,
        "train_steps": 2, "eval_interval": 0, "sample_tokens": 0, "progress": False,
        "nproc": 1, "tp": 1, "pp": 1, "save": "none", "peak_tflops": 0.5,
        "out_dir": str(tmp_path), "cache_dir": str(cache)})
    launch(config, environ={}, timeout=120)
    records = read_metrics(tmp_path / "metrics.jsonl")
    flops = model_flops_per_token_training(preset("tiny").replace(seq_len=32))
    for r in records:
        assert r["mfu"] == pytest.approx(flops * r["tokens_per_s"] / 0.5e12, rel=1e-6)
    with pytest.raises(ConfigError, match="--peak-tflops must be > 0, got 0"):
        load_config(None, {"peak_tflops": 0.0})
