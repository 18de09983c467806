"""`mt pretrain` at TP 2 x PP 2 x DP 2 with ZeRO-1 on 8 local processes trains exactly like
one process: the same per-step losses (fp32, dropout 0) on the same global batches of the
embedded corpus. Also checks the metrics JSONL and the sharded checkpoint the 3D run wrote.

Small and short (tiny preset, sequence 32, global batch 8, 20 steps): 8 processes share 2
cores here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mt_pretrain.config.load import load_config
from mt_pretrain.launch import launch
from mt_pretrain.run.metrics import read_metrics

STEPS = 20
COMMON: dict[str, Any] = {
    "model": "tiny", "seq_len": 32, "dropout": 0.0, "micro_batch_size": 2,
    "global_batch_size": 8, "train_steps": STEPS, "eval_interval": 0, "sample_tokens": 0,
    "progress": False, "log_interval": 100, "zero_stage": 1, "timeout": 120.0,
}


def _run(tmp: Path, cache: Path, **layout: Any) -> tuple[Any, list[dict[str, Any]]]:
    config = load_config(None, {**COMMON, **layout, "out_dir": str(tmp),
                                "cache_dir": str(cache)})
    summary = launch(config, environ={}, timeout=300)
    return summary, read_metrics(tmp / "metrics.jsonl")


def test_pretrain_3d_matches_one_process(tmp_path: Path, cache: Path) -> None:
    one, _ = _run(tmp_path / "one", cache, nproc=1, tp=1, pp=1, save="none")
    three_d, records = _run(tmp_path / "3d", cache, nproc=8, tp=2, pp=2, dp=2)
    assert len(one.losses) == len(three_d.losses) == STEPS
    for step, (a, b) in enumerate(zip(one.losses, three_d.losses), start=1):
        assert b == pytest.approx(a, rel=1e-4), f"step {step}: {a} vs {b}"
    assert three_d.losses[-1] < three_d.losses[0] - 0.5  # it learns

    # Metrics: one JSON object per step with the documented keys.
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert {"step", "loss", "lr", "global_batch_size", "tokens", "tokens_per_s"} <= set(r)
        assert r["global_batch_size"] == 8 and r["tokens"] == r["step"] * 8 * 32
        assert r["tokens_per_s"] > 0
    assert [r["loss"] for r in records] == pytest.approx(three_d.losses, rel=1e-12)

    # The final checkpoint: one file per rank, meta written, `latest` pointing at it.
    root = tmp_path / "3d" / "checkpoints"
    assert (root / "latest").read_text().strip() == f"step-{STEPS:08d}"
    folder = root / f"step-{STEPS:08d}"
    assert sorted(p.name for p in folder.glob("rank-*.pt")) == [
        f"rank-{r:05d}.pt" for r in range(8)]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["layout"]["tp"] == meta["layout"]["pp"] == meta["layout"]["dp"] == 2
    assert meta["data"] == {"consumed_samples": STEPS * 8, "step": STEPS}
    assert not list(root.glob(".*.tmp"))
