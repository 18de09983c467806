"""A rank slowed down (a quarter of a second more work per step, the ``train.slow`` fault
point: a throttled GPU, a busy host) in a --nproc 2 data-parallel run is named in one line and
in the metrics; every step's metrics hold each rank's seconds of work."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mt_pretrain.run.metrics import read_metrics


def test_a_slow_rank_is_named(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [sys.executable, "-m", "mt_pretrain", "pretrain", "--model", "tiny", "--seq-len",
               "32", "--global-batch-size", "4", "--micro-batch-size", "2", "--nproc", "2",
               "--train-steps", "10", "--eval-interval", "0", "--sample-tokens", "0",
               "--no-progress", "--save", "none", "--straggler-steps", "4", "--out-dir",
               str(out), "--cache-dir", str(cache)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MT_FAILPOINT": "train.slow@1"})
    assert done.returncode == 0, done.stdout + done.stderr
    named = [line for line in done.stdout.splitlines() if "straggler" in line]
    assert len(named) == 1, done.stdout
    assert named[0].startswith(f"rank 1 on {socket.gethostname()} is a straggler: its steps' "
                               "work takes "), named
    assert named[0].endswith("medians over the last 4 steps; peers: ranks 0, the same layers "
                             "on other data)"), named
    records = read_metrics(out / "metrics.jsonl")
    assert all(len(r["busy_s_per_rank"]) == 2 for r in records)
    assert all(r["busy_s_per_rank"][1] > r["busy_s_per_rank"][0] + 0.2 for r in records)
    assert [r["step"] for r in records if "stragglers" in r] == [4]
    assert records[3]["stragglers"] == [1]


def test_straggler_flags_are_checked() -> None:
    from mt_pretrain.config.load import load_config
    from mt_pretrain.config.schema import ConfigError

    for bad in (1.0, float("nan"), float("inf"), 0.5):
        with pytest.raises(ConfigError, match="--straggler-factor must be a finite number "
                                              "above 1"):
            load_config(None, {"straggler_factor": bad})
    with pytest.raises(ConfigError, match="--straggler-steps must be >= 0, got -1"):
        load_config(None, {"straggler_steps": -1})
