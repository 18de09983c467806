"""--max-restarts: a rank of a --nproc 4 run killed (SIGKILL) or stopped (SIGSTOP) at a random
moment; the run stops its other ranks, starts again from its newest complete checkpoint by
itself, exits 0, and ends with the per-step losses and the weights of a run that was never
interrupted, bit for bit (keyed dropout on, so the replayed steps must draw the same masks).
And the rules around it: a launcher's restarts are the launcher's, a restarted torchrun or
SLURM job resumes from its --save folder, a restart needs checkpoints to resume from."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from mt_formats import load_state_dict
from mt_pretrain.config.load import load_config
from mt_pretrain.config.schema import ConfigError
from mt_pretrain.launch import _after_launcher_restart
from mt_pretrain.run.metrics import read_metrics

STEPS = 16
NPROC = 4


def _flags(out: Path, cache: Path, *args: str) -> list[str]:
    return ["pretrain", "--model", "tiny", "--seq-len", "32", "--dropout", "0.1",
            "--global-batch-size", "8", "--micro-batch-size", "2", "--tp", "1", "--pp", "2",
            "--zero-stage", "1", "--eval-interval", "0", "--sample-tokens", "0",
            "--no-progress", "--save-interval", "2", "--train-steps", str(STEPS),
            "--out-dir", str(out), "--cache-dir", str(cache), *args]


def _mt(out: Path, cache: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "mt_pretrain", *_flags(out, cache, "--nproc", str(NPROC),
                                                         *args)]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.is_file() else []


def _outcome(out: Path) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    return read_metrics(out / "metrics.jsonl"), load_state_dict(out / "checkpoints")[1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Any:
    out = tmp_path_factory.mktemp("whole")
    done = subprocess.run(_mt(out, cache), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return _outcome(out)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_rank_restarts_the_run_from_its_newest_checkpoint(
        how: str, uninterrupted: Any, cache: Path, tmp_path: Path) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    # A moment within the step after ``after_step``, early enough that steps are left when
    # the kill lands (a step takes 0.1-0.3 s here).
    victim, after_step, delay = rng.randrange(NPROC), rng.randint(1, STEPS - 6), \
        0.3 * rng.random()
    where = f"seed {seed}: rank {victim} after step {after_step} + {delay:.2f} s"
    out = tmp_path / "run"
    # A stopped rank is found when its peers' collective times out (--timeout).
    timeout = "10" if how == "SIGSTOP" else "120"
    proc = subprocess.Popen(_mt(out, cache, "--max-restarts", "2", "--timeout", timeout),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 300
        while not (metrics.is_file() and len(read_metrics(metrics)) >= after_step):
            assert proc.poll() is None, (where, proc.communicate())
            assert time.monotonic() < deadline, (where, "training did not reach the step")
            time.sleep(0.05)
        time.sleep(delay)
        ranks = _children(proc.pid)
        assert len(ranks) == NPROC, (where, ranks)
        os.kill(ranks[victim], getattr(signal, how))
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (where, stdout + stderr)
    cause = f"rank {victim} of {NPROC} killed by SIGKILL" if how == "SIGKILL" else \
        f"rank {victim} of {NPROC} hung"
    lines = [line for line in stdout.splitlines() if line.startswith("restart ")]
    kept = out / "failure-0"  # every rank's traceback, or stack if it hung
    assert len(lines) == 1 and lines[0].startswith(
        f"restart 1 of 2 after {cause} (every rank's stack: {kept}): "), (where, stdout + stderr)
    assert sorted(p.name for p in kept.iterdir()) == [f"rank-{r}.txt" for r in range(NPROC)]
    if how == "SIGSTOP":  # the stopped rank's Python stack, dumped before it was killed
        assert "File " in (kept / f"rank-{victim}.txt").read_text(), where
    records, weights = _outcome(out)
    whole_records, whole_weights = uninterrupted
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), where
    assert [r["loss"] for r in records] == [r["loss"] for r in whole_records], where
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in whole_records], where
    restarted = [r for r in records if "restart" in r]
    assert len(restarted) <= 1, (where, restarted)  # none when it died after the last save
    if restarted:
        assert restarted[0]["restart"] == 1 and restarted[0]["restart_cause"] == cause, where
        assert restarted[0]["restart_world_size"] == NPROC, where
    assert weights.keys() == whole_weights.keys()
    assert all(torch.equal(weights[k], whole_weights[k]) for k in weights), where


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_torchrun_restarts_resume_from_the_save_folder(uninterrupted: Any, cache: Path,
                                                       tmp_path: Path) -> None:
    """torchrun --max-restarts 1 with mt's plain command line (no --load): a worker killed
    after step 5; torchrun starts the workers again, they resume from --save by themselves
    (TORCHELASTIC_RESTART_COUNT) and end as the run that was never interrupted."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(NPROC), "--max-restarts", "1", "-m", "mt_pretrain",
               *_flags(out, cache)]
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
        "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_RESTART_COUNT")}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, "OMP_NUM_THREADS": "1"})
    try:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 300
        while not (metrics.is_file() and len(read_metrics(metrics)) >= 5):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "training did not reach step 5"
            time.sleep(0.05)
        workers = [pid for pid in _children(proc.pid)
                   if b"mt_pretrain" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == NPROC, workers
        os.kill(workers[1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout + stderr
    assert "restart 1 after torchrun restarted the job: resumed from " in stdout, stdout
    records, weights = _outcome(out)
    whole_records, whole_weights = uninterrupted
    assert [r["loss"] for r in records] == [r["loss"] for r in whole_records]
    assert all(torch.equal(weights[k], whole_weights[k]) for k in whole_weights)


def _config(**options: Any) -> Any:
    return load_config(None, {"model": "tiny", "nproc": 2, **options})


def test_restart_rules() -> None:
    """--max-restarts needs checkpoints and a local run; a job its launcher restarted
    continues from its --save folder (never deleting it, whatever --overwrite said), unless
    --load names another."""
    with pytest.raises(ConfigError, match="--max-restarts must be >= 0, got -1"):
        _config(max_restarts=-1)
    with pytest.raises(ConfigError, match="--save none keeps none"):
        _config(max_restarts=1, save="none")
    with pytest.raises(ConfigError, match="under torchrun the launcher restarts them"):
        _after_launcher_restart(_config(max_restarts=1), "torchrun", {})
    config = _config(out_dir="runs/a", overwrite=True)
    same, restart = _after_launcher_restart(config, "torchrun", {})
    assert same is config and restart is None  # a first start: nothing to resume
    for name, who in (("TORCHELASTIC_RESTART_COUNT", "torchrun"),
                      ("SLURM_RESTART_COUNT", "SLURM")):
        resumed, restart = _after_launcher_restart(config, "torchrun", {name: "3"})
        assert resumed.checkpoint.load == str(Path("runs/a/checkpoints"))
        assert not resumed.checkpoint.overwrite
        assert restart is not None and (restart.count, restart.cause) == (
            3, f"{who} restarted the job")
    given = replace(config, checkpoint=replace(config.checkpoint, load="elsewhere/ck"))
    assert _after_launcher_restart(given, "torchrun", {"SLURM_RESTART_COUNT": "1"}) == (
        given, None)
