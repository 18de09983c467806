"""--min-nproc: an elastic --nproc 4 run (tp 1 x pp 1 x dp 4, ZeRO 1, keyed dropout on)
loses a random rank at a random moment, then another: it continues from its newest checkpoint
at dp 3, then at dp 2, the global batch kept by more micro-batches per rank and the ZeRO
optimizer state resharded, and ends within the correctness contract's fp32 limits of the run
that was never interrupted (per-step loss and grad norm, every parameter): the same samples
in the same steps. And the rules: --min-nproc needs --max-restarts, refuses --dp, a layout
that cannot shrink, and a launcher's run."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mt_dist import free_port
from mt_formats import load_state_dict
from mt_model import gradient_free_slices
from mt_pretrain.config.load import load_config
from mt_pretrain.config.resolve import elastic_world
from mt_pretrain.config.schema import ConfigError
from mt_pretrain.contract.runner import FP32, Trace, compare
from mt_pretrain.launch import _after_launcher_restart
from mt_pretrain.run.metrics import read_metrics

STEPS = 14
TORCHRUN_STEPS = 30
NPROC = 4
FLAGS = ["--model", "tiny", "--seq-len", "32", "--dropout", "0.1", "--global-batch-size", "12",
         "--micro-batch-size", "1", "--tp", "1", "--pp", "1", "--zero-stage", "1",
         "--eval-interval", "0", "--sample-tokens", "0", "--no-progress", "--save-interval",
         "2", "--train-steps", str(STEPS), "--nproc", str(NPROC)]


def _mt(out: Path, cache: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "mt_pretrain", "pretrain", *FLAGS, "--out-dir", str(out),
            "--cache-dir", str(cache), *args]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.is_file() else []


def _trace(out: Path) -> Trace:
    return Trace(read_metrics(out / "metrics.jsonl"), None,
                 load_state_dict(out / "checkpoints")[1], 0.0)


def _kill_one(proc: subprocess.Popen[str], metrics: Path, ranks: int, restarts: int,
              step: int, rng: random.Random, where: str) -> int:
    """Waits until the attempt on ``ranks`` ranks (after ``restarts`` restarts) has written
    step ``step``, then SIGKILLs one of its ranks at random; returns the victim's rank."""
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, (where, proc.communicate())
        assert time.monotonic() < deadline, (where, f"no step {step} on {ranks} ranks")
        records = read_metrics(metrics) if metrics.is_file() else []
        children = _children(proc.pid)
        if len(records) >= step and len(children) == ranks and sum(
                "restart" in r for r in records) == restarts:
            break
        time.sleep(0.05)
    time.sleep(rng.random() * 0.2)  # within the next step (0.1-0.3 s here)
    victim = rng.randrange(ranks)
    os.kill(children[victim], signal.SIGKILL)
    return victim


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_an_elastic_run_loses_two_ranks_and_ends_as_the_whole_run(
        cache: Path, tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    done = subprocess.run(_mt(whole, cache), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    first = rng.randint(2, 5)
    second = rng.randint(first + 3, STEPS - 5)
    out = tmp_path / "elastic"
    proc = subprocess.Popen(_mt(out, cache, "--max-restarts", "2", "--min-nproc", "2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    try:
        victims = [_kill_one(proc, metrics, 4, 0, first, rng, f"seed {seed}")]
        victims.append(_kill_one(proc, metrics, 3, 1, second, rng, f"seed {seed}"))
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    where = f"seed {seed}: rank {victims[0]} of 4 after step {first}, rank {victims[1]} " \
            f"of 3 after step {second}"
    assert proc.returncode == 0, (where, stdout + stderr)
    lines = [line for line in stdout.splitlines() if line.startswith("restart ")]
    assert len(lines) == 2, (where, stdout)
    # An early kill may come before the checkpoint of step 2 is complete: then the
    # run starts again from step 0 (and says so), as correct as resuming.
    assert lines[0].startswith(f"restart 1 of 2 after rank {victims[0]} of 4 killed by SIGKILL"
                               f" (every rank's stack: {out / 'failure-0'}): continuing on 3 "
                               "of 4 ranks, "), (where, lines)
    fresh = f"no checkpoint in {out / 'checkpoints'} yet: starting at step 0"
    assert "resumed from " in lines[0] or fresh in lines[0], (where, lines)
    assert lines[1].startswith(f"restart 2 of 2 after rank {victims[1]} of 3 killed by SIGKILL"
                               f" (every rank's stack: {out / 'failure-1'}): continuing on 2 "
                               "of 4 ranks, resumed from "), (where, lines)
    for ranks in (4, 3, 2):
        assert f"{ranks} ranks from --nproc: tp 1 x pp 1 x dp {ranks} on cpu" in stdout, where
    trace, reference = _trace(out), _trace(whole)
    assert [r["step"] for r in trace.records] == list(range(1, STEPS + 1)), where
    assert [r["global_batch_size"] for r in trace.records] == [12] * STEPS, where
    restarted = [r for r in trace.records if "restart" in r]
    assert [(r["restart"], r["restart_world_size"]) for r in restarted] == [(1, 3), (2, 2)], (
        where, restarted)
    tiny = load_config(None, {"model": "tiny", "seq_len": 32}).model.gpt_config()
    diff = compare(trace, reference, gradient_free_slices(tiny))
    assert diff.within(FP32), (where, diff)


def _agent(out: Path, cache: Path, port: int, host: bool, log: Path) -> subprocess.Popen[str]:
    """One torchrun agent of an elastic job of 1 to 2 nodes, one worker: mt's flags without
    --nproc. Both agents of the test run on this host, so which one hosts the rendezvous store
    is said (``is_host``); torch 2.13's agents keep the address of the workers' store of the
    first round they saw, which a node joining later never finds: each round's own store
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``, as the torchrun launch template sets). The
    agents log at INFO, where torchrun says it saw a node waiting to join."""
    flags = [f for f in FLAGS if f not in ("--nproc", str(NPROC))]
    assert len(flags) == len(FLAGS) - 2
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", "mt-elastic-test", "--max-restarts", "3",
               "--monitor-interval", "1", "--rdzv-conf",
               f"join_timeout=120,last_call_timeout=2,is_host={str(host).lower()}",
               "-m", "mt_pretrain", "pretrain", *flags, "--train-steps", str(TORCHRUN_STEPS),
               "--out-dir", str(out), "--cache-dir", str(cache)]
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
        "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_RESTART_COUNT")}
    env.update(OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="INFO")
    with open(log, "w") as handle:
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True)


def _tree(pid: int) -> list[int]:
    return [pid, *(p for child in _children(pid) for p in _tree(child))]


def _wait_for(what: str, ready: Any, agents: list[subprocess.Popen[str]],
              logs: list[Path]) -> None:
    deadline = time.monotonic() + 300
    while not ready():
        for agent, log in zip(agents, logs, strict=True):
            assert agent.poll() is None, (what, log.read_text()[-3000:])
        assert time.monotonic() < deadline, (what, logs[0].read_text()[-3000:])
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_torchrun_elastic_job_shrinks_and_grows_back(cache: Path, tmp_path: Path) -> None:
    """Two torchrun agents (--nnodes 1:2, one worker each) train one job at dp 2; the second
    agent's node is lost (agent and worker SIGKILLed) after step 4: torchrun restarts the job
    on the first alone, which resumes from its newest checkpoint at dp 1; a new agent joins:
    torchrun restarts the job on both, at dp 2 again (its worker continues the run too,
    though its agent never restarted anything). Both agents exit 0, and the run ends within
    the correctness contract's fp32 limits of the run that was never interrupted: the same
    samples in the same steps, the global batch kept."""
    whole = tmp_path / "whole"
    command = _mt(whole, cache, "--train-steps", str(TORCHRUN_STEPS), "--nproc", "2")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out, port = tmp_path / "elastic", free_port("127.0.0.1")
    metrics = out / "metrics.jsonl"
    logs = [tmp_path / name for name in ("first.log", "second.log", "third.log")]

    def steps() -> list[dict[str, Any]]:
        return read_metrics(metrics) if metrics.is_file() else []

    first = _agent(out, cache, port, True, logs[0])
    second = _agent(out, cache, port, False, logs[1])
    third = None
    try:
        _wait_for("step 4 on 2 ranks", lambda: len(steps()) >= 4 and len(
            _tree(second.pid)) >= 2, [first, second], logs[:2])
        for pid in _tree(second.pid):  # the node is lost: its agent and its worker
            os.kill(pid, signal.SIGKILL)
        second.wait()
        def two_after_restart() -> bool:
            records = steps()
            shrunk = [i for i, r in enumerate(records) if "restart" in r]
            return bool(shrunk) and len(records) >= shrunk[0] + 2

        _wait_for("2 steps on 1 rank", two_after_restart, [first], logs[:1])
        # The run alone must not end before the third node has joined (on a busy machine
        # its agent's start took longer than the run's remaining steps): its workers pause
        # until the first agent has seen the newcomer waiting (which it logs at INFO).
        paused = _tree(first.pid)[1:]
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        try:
            third = _agent(out, cache, port, False, logs[2])
            _wait_for("the third node waiting", lambda: "new nodes from group_rank=" in
                      logs[0].read_text(), [first, third], [logs[0], logs[2]])
        finally:
            for pid in paused:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert first.wait(timeout=400) == 0, logs[0].read_text()[-3000:]
        assert third.wait(timeout=400) == 0, logs[2].read_text()[-3000:]
    finally:
        for agent in (first, second, third):
            if agent is not None and agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    trace, reference = _trace(out), _trace(whole)
    assert [r["step"] for r in trace.records] == list(range(1, TORCHRUN_STEPS + 1))
    assert [r["global_batch_size"] for r in trace.records] == [12] * TORCHRUN_STEPS
    causes = {r.get("restart_cause") for r in trace.records if "restart" in r}
    assert causes == {"torchrun restarted the job"}, trace.records
    # The ranks of each attempt after the first, as its first metrics record says (the
    # start-up line says it too, but global rank 0 prints it, and after the regrow that may
    # be the third agent's worker: torchrun ranks agents by process id, which wraps). Each
    # attempt once (the first agent may start alone for a moment): no attempt failed but
    # the one that lost a node.
    resized = [r["restart_world_size"] for r in trace.records if "restart" in r]
    assert resized in ([1, 2], [2, 1, 2]), trace.records
    tiny = load_config(None, {"model": "tiny", "seq_len": 32}).model.gpt_config()
    diff = compare(trace, reference, gradient_free_slices(tiny))
    assert diff.within(FP32), diff


def _config(**options: Any) -> Any:
    return load_config(None, {"model": "tiny", "nproc": 4, "max_restarts": 1,
                              "global_batch_size": 12, "micro_batch_size": 1, **options})


def test_elastic_rules() -> None:
    """The sizes an elastic run continues on, and what it refuses before starting."""
    config = _config(min_nproc=2)
    assert [elastic_world(config, left) for left in (4, 3, 2, 1)] == [4, 3, 2, None]
    # 8 samples in micro-batches of 1 do not split over 3 ranks: down to 2.
    assert elastic_world(_config(min_nproc=2, global_batch_size=8), 3) == 2
    assert elastic_world(_config(min_nproc=1, tp=2), 3) == 2  # tp 2 divides 2, not 3
    with pytest.raises(ConfigError, match="give --max-restarts N"):
        _config(min_nproc=2, max_restarts=0)
    with pytest.raises(ConfigError, match="--min-nproc 5 exceeds --nproc 4"):
        _config(min_nproc=5)
    with pytest.raises(ConfigError, match="give --nproc N"):
        load_config(None, {"model": "tiny", "max_restarts": 1, "min_nproc": 1})
    with pytest.raises(ConfigError, match="leave out --dp 4"):
        _config(min_nproc=2, dp=4)
    with pytest.raises(ConfigError, match="no world size from 3 down to 3 fits the layout"):
        _config(min_nproc=3, tp=2)
    with pytest.raises(ConfigError, match="--max-restarts and --min-nproc restart the ranks"):
        _after_launcher_restart(config, "torchrun", {})
