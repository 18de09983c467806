"""The `mt` command as a user runs it, in a subprocess: a short run of the shipped 3D demo
config (8 local processes) with validation, checkpoint and a generated sample; `mt plot` of
its metrics; SIGTERM saving a checkpoint and exiting cleanly; a dead rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mt_pretrain.run.metrics import read_metrics

SMALL = ["--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2",
         "--timeout", "120", "--no-progress"]


def _mt(*args: str) -> list[str]:
    return [sys.executable, "-m", "mt_pretrain", *args]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mt-cache")


def test_mt_pretrain_default_layout_then_plot(tmp_path: Path, cache: Path) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        _mt("pretrain", "--config", "demo-3d", *SMALL, "--train-steps", "16", "--eval-interval",
            "8",
            "--sample-tokens", "12", "--out-dir", str(out), "--cache-dir", str(cache)),
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    assert "trained steps 1-16: loss" in text
    assert "validation loss" in text
    assert f"checkpoint {out / 'checkpoints' / 'step-00000016'}" in text
    sample = text.split("sample: ", 1)[1]
    assert sample.startswith("The whale") and len(sample.split()) > 2
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 17))  # one object per step
    assert records[-1]["loss"] < records[0]["loss"]
    assert [r["step"] for r in records if "val_loss" in r] == [8, 16]

    png = tmp_path / "loss.png"
    plotted = subprocess.run(_mt("plot", str(out / "metrics.jsonl"), "-o", str(png)),
                             capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0, plotted.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_mt_pretrain_sigterm_saves_and_exits(tmp_path: Path, cache: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        _mt("pretrain", *SMALL, "--nproc", "4", "--tp", "1", "--pp", "2", "--train-steps",
            "100000", "--eval-interval", "0", "--out-dir", str(out), "--cache-dir", str(cache)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 180
    try:
        while not (metrics.is_file() and len(read_metrics(metrics)) >= 3):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout + stderr
    assert "stopped by signal after step" in stdout
    step = int(stdout.split("stopped by signal after step ", 1)[1].split()[0])
    assert 3 <= step < 100000
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == f"step-{step:08d}"
    assert len(list((root / f"step-{step:08d}").glob("rank-*.pt"))) == 4
    assert [r["step"] for r in read_metrics(metrics)][-1] == step


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.is_file() else []


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_mt_pretrain_dead_rank_fails_fast(tmp_path: Path, cache: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        _mt("pretrain", *SMALL, "--nproc", "4", "--tp", "2", "--pp", "2", "--train-steps",
            "100000", "--eval-interval", "0", "--out-dir", str(out), "--cache-dir", str(cache),
            "--save", "none"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 180
    try:
        while not (metrics.is_file() and len(read_metrics(metrics)) >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        ranks = _children(proc.pid)
        assert len(ranks) >= 4, ranks
        killed_at = time.monotonic()
        os.kill(ranks[-1], signal.SIGKILL)  # a peer dies without a word
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stdout + stderr
    assert time.monotonic() - killed_at < 60
    assert re.search(r"rank \d of 4 failed first", stderr), stderr
    assert "died with exit code -9" in stderr, stderr


def test_under_a_launcher_only_rank_0_speaks_for_errors_every_rank_shares(
        tmp_path: Path) -> None:
    """Two ranks placed as torchrun places them, with a layout neither can run: the error
    once (rank 0), exit 2 on both."""
    port = str(29_000 + os.getpid() % 1000)
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(_mt("pretrain", "--tp", "3", "--out-dir",
                                          str(tmp_path / "run")),
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    lead, other = (" ".join((out + err).split()) for out, err in outputs)
    assert lead.startswith("error: invalid layout: world size 2 is not divisible by tp 3"), lead
    assert other == "", other
