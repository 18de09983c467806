"""`mt pretrain` under real launchers: torchrun (torch.distributed.run), mpiexec (mpi4py
discovery) and DeepSpeed's launcher start two ranks that find their places from the
launcher's environment and train exactly as the same layout started by `mt pretrain --nproc 2`
(bit-identical losses)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import run_pretrain

from mt_dist import free_port

OPTIONS: dict[str, Any] = {
    "model": "tiny", "seq_len": 32, "global_batch_size": 8, "micro_batch_size": 2, "tp": 1,
    "pp": 2, "train_steps": 3, "eval_interval": 3, "eval_iters": 1, "sample_tokens": 0,
    "save": "none", "progress": False, "timeout": 120.0,
}


def _flags(cache: Path, out: Path) -> list[str]:
    flags = []
    for key, value in OPTIONS.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return ["pretrain", *flags, "--cache-dir", str(cache), "--out-dir", str(out),
            "--metrics", str(out / "metrics.jsonl")]


def _environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        env.pop(name, None)  # only the launcher under test may place the ranks
    return env


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> list[float]:
    return run_pretrain(OPTIONS, tmp_path_factory.mktemp("ref"), cache, nproc=2).losses


def _launch(prefix: list[str], out: Path, cache: Path) -> tuple[str, list[float]]:
    """Run ``prefix pretrain ...`` (``prefix`` ends by naming the mt_pretrain module); its
    stdout and the per-step losses."""
    command = [*prefix, *_flags(cache, out)]
    proc = subprocess.run(command, env=_environment(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return proc.stdout, [json.loads(line)["loss"] for line in lines]


def test_torchrun(reference: list[float], cache: Path, tmp_path: Path) -> None:
    text, losses = _launch([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "2", "-m", "mt_pretrain"], tmp_path, cache)
    assert "2 ranks from torchrun: tp 1 x pp 2 x dp 1 on cpu" in text
    assert losses == reference


def test_mpiexec(reference: list[float], cache: Path, tmp_path: Path) -> None:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpiexec / mpi4py not installed (pip install mpi4py mpich)")
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    extra = (["--allow-run-as-root", "--oversubscribe"]
             if "Open MPI" in version.stdout + version.stderr else [])
    text, losses = _launch([mpiexec, *extra, "-n", "2", sys.executable, "-m", "mt_pretrain"],
                           tmp_path, cache)
    assert "2 ranks from mpi: tp 1 x pp 2 x dp 1 on cpu" in text
    assert losses == reference


def test_deepspeed_launcher(reference: list[float], cache: Path, tmp_path: Path) -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed (pip install deepspeed)")
    # The `deepspeed` command is this module; it sets LOCAL_SIZE instead of LOCAL_WORLD_SIZE.
    # Its default port (29500) is fixed: take a free one so parallel tests cannot collide.
    text, losses = _launch([sys.executable, "-m", "deepspeed.launcher.runner",
                            "--num_accelerators", "2", "--master_port",
                            str(free_port("127.0.0.1")), "--no_local_rank", "--module",
                            "mt_pretrain"], tmp_path, cache)
    assert "2 ranks from deepspeed: tp 1 x pp 2 x dp 1 on cpu" in text
    assert losses == reference


def test_a_launcher_variable_at_fault_is_one_line_in_a_narrow_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """80 columns (a SLURM log file): the error stays one line, unwrapped, and names the
    variables and their values."""
    from mt_pretrain.cli.pretrain import pretrain_main

    monkeypatch.setenv("COLUMNS", "80")
    code = pretrain_main(None, {"model": "tiny", "out_dir": str(tmp_path / "run")},
                         {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"})
    assert code == 2
    assert capsys.readouterr().err == (
        "error: master port 70000 is invalid for world size 2 (1-65535; 0 means 'any' and is "
        "allowed only for a single process) (from MASTER_PORT='70000', WORLD_SIZE='2')\n")
    assert not (tmp_path / "run").exists()


def test_a_lost_peer_under_a_launcher_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank whose peer died mid-run under torchrun / srun / mpirun: exit 1 and one line
    on every surviving rank, not gloo's RuntimeError with its traceback."""
    import mt_pretrain.run.rank as rank_module
    from mt_pretrain.cli.pretrain import pretrain_main

    def peer_died(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
                           "Read error [127.0.0.1]:33493: Connection reset by peer. This is "
                           "typically caused by a remote worker hanging or bugs")

    monkeypatch.setattr(rank_module, "_train", peer_died)
    monkeypatch.setenv("COLUMNS", "80")
    environ = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(free_port("127.0.0.1"))}
    code = pretrain_main(None, {"model": "tiny", "device": "cpu", "progress": False,
                                "out_dir": str(tmp_path / "run")}, environ)
    assert code == 1
    assert capsys.readouterr().err == (
        "error: rank 0 of 1 (torchrun) lost its peers mid-run: Read error "
        "[127.0.0.1]:33493: Connection reset by peer; another rank stopped, hung or lost its "
        "connection: its own log says why\n")
