"""Start the ranks of a run: under a launcher, or N local processes (``--nproc``).

Under torchrun, mpirun/mpiexec (mpi4py) or SLURM srun, this process is one rank: its place
comes from ``mt_dist.discover(os.environ)``. Otherwise ``--nproc N`` forks N local ranks
joined by gloo over a free TCP port on 127.0.0.1 (mt-dist's ``LocalRanks`` supervises them);
the parent prepares the data once, waits, forwards SIGTERM / SIGINT (the ranks save a
checkpoint and stop), and if a rank fails it stops the others and reports the root cause.
This module and the CLI are the only places that read ``os.environ``.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from mt_checkpoint import sharding_styles
from mt_data.tokenizer import TokenizerError
from mt_dist import LaunchInfo, discover, free_port
from mt_dist.supervisor import LocalRanks, Outcome
from mt_eval import TaskError, TaskResult, load_task
from mt_pretrain.config.engines import engine_of
from mt_pretrain.config.resolve import resolve
from mt_pretrain.config.schema import ConfigError, PretrainConfig
from mt_pretrain.data.inputs import check_vocab, default_cache_dir, ensure_data
from mt_pretrain.engines.checkpoint import CheckpointError
from mt_pretrain.evaluation.bias import BiasSpec, bias_rank
from mt_pretrain.evaluation.generation import GenerateSpec, generate_rank
from mt_pretrain.evaluation.model import as_pretrain_checkpoint
from mt_pretrain.evaluation.rank import EvalSpec, eval_rank
from mt_pretrain.run.folder import claim_run_folder, run_folder_lock
from mt_pretrain.run.rank import RunSummary, run_rank
from mt_pretrain.run.train import NonFiniteLossError
from mt_pretrain.run.warnings_line import one_line_warnings
from mt_pretrain.serving.rank import ServeSpec

__all__ = ["Interrupted", "LaunchFailed", "launch", "launch_bias", "launch_eval",
           "launch_generate", "launch_serve", "spawn", "supervise"]

T = TypeVar("T")

# Failures every rank meets alike (bad config, damaged checkpoint, diverged loss): the parent
# re-raises them as they are, one line, no traceback.
_EXPECTED = (ConfigError, CheckpointError, NonFiniteLossError, TaskError, TokenizerError)
# The operating system's refusals (disk full, permissions, a path that is not there): the
# message names the file, so they are one line too (exit 1: a failed run, not bad flags).
_OS_ERRORS = (OSError, FileNotFoundError, PermissionError, IsADirectoryError,
              NotADirectoryError, FileExistsError)
_EXPECTED_BY_NAME = {kind.__name__: kind for kind in (*_EXPECTED, *_OS_ERRORS)}
# After the first rank fails, give the others this long to report (their errors are usually
# consequences) before killing them.
_GRACE_S = 5.0


class LaunchFailed(RuntimeError):
    """A rank of a local multi-process run failed; the message holds its traceback."""


class Interrupted(RuntimeError):
    """A second SIGINT / SIGTERM stopped the run at once."""


def launch(config: PretrainConfig, environ: Mapping[str, str] | None = None,
           timeout: float | None = None, keep_weights: bool = False) -> RunSummary | None:
    """Run ``config``: as one rank under a launcher, else on ``--nproc`` local processes.

    Returns rank 0's summary (None on other ranks under a launcher); ``keep_weights`` puts
    the final full fp32 weights into it (for comparisons such as ``mt matrix``).
    """
    environ = os.environ if environ is None else environ
    cache = Path(config.data.cache_dir) if config.data.cache_dir else default_cache_dir(environ)
    info = discover(environ)
    if info.launcher != "single":
        return run_rank(config, info, cache, keep_weights)
    nproc = config.world_size_hint()
    plan = resolve(config, nproc)  # fail before starting anything
    ckpt = config.checkpoint
    with run_folder_lock(ckpt.save_dir or ckpt.out_dir):  # no --overwrite of a running run
        claim_run_folder(ckpt)
    # Once, here, not racing per rank.
    check_vocab(plan, ensure_data(config.data, plan.gpt.vocab_size, cache))
    # Building a meta GPT imports torch's Python reference ops (seconds); do it once before
    # forking so that every rank inherits them.
    sharding_styles(plan.model, plan.topology.tp)
    if nproc == 1:
        single = LaunchInfo(0, 1, 0, 1, "127.0.0.1", free_port("127.0.0.1"), "single")
        return run_rank(config, single, cache, keep_weights)
    engine_of(config).load().preload(config)  # likewise, the engine's own imports
    return spawn(config, nproc, cache, timeout, keep_weights)


def launch_eval(spec: EvalSpec, environ: Mapping[str, str] | None = None,
                timeout: float | None = None) -> list[TaskResult] | dict | None:
    """Run `mt eval` ``spec``: as one rank under a launcher, else on ``spec.nproc`` local
    processes. Returns rank 0's results (mt-eval's task results, or lm-eval's results dict
    with the harness engine; None on other ranks under a launcher)."""
    environ = os.environ if environ is None else environ
    info = discover(environ)
    if spec.engine == "mt":
        for task in spec.tasks:  # fail here, before starting anything
            load_task(task)
    # Another format is converted once here (under a launcher: once per rank).
    with as_pretrain_checkpoint(spec.checkpoint, spec.tokenizer) as (checkpoint, tokenizer):
        spec = replace(spec, checkpoint=checkpoint, tokenizer=tokenizer)
        if info.launcher != "single":
            return _engine_rank(spec, info)
        if spec.nproc == 1:
            return _engine_rank(spec, LaunchInfo(0, 1, 0, 1, "127.0.0.1",
                                                 free_port("127.0.0.1"), "single"))
        threads = max(1, (os.cpu_count() or 1) // spec.nproc)
        return supervise(_eval_rank, spec.nproc,
                         (spec, spec.nproc, free_port("127.0.0.1"), threads), timeout)


def _engine_rank(spec: EvalSpec, info: LaunchInfo) -> list[TaskResult] | dict | None:
    """One rank of ``spec``'s task engine: mt-eval's, or lm-evaluation-harness."""
    if spec.engine == "harness":
        from mt_pretrain.evaluation.harness import harness_rank  # lm-eval: the harness extra

        return harness_rank(spec, info)
    return eval_rank(spec, info)


def _eval_rank(rank: int, spec: EvalSpec, nproc: int, port: int,
               threads: int) -> list[TaskResult] | dict | None:
    torch.set_num_threads(threads)
    return _engine_rank(spec, LaunchInfo(rank, nproc, rank, nproc, "127.0.0.1", port,
                                         "single"))


def launch_generate(spec: GenerateSpec, environ: Mapping[str, str] | None = None,
                    timeout: float | None = None) -> list[dict] | None:
    """Run `mt generate` ``spec`` at its layout: as one rank under a launcher, else on
    ``spec.nproc`` local processes. Returns every prompt's row on rank 0 (None on other ranks
    under a launcher)."""
    info = discover(os.environ if environ is None else environ)
    with as_pretrain_checkpoint(spec.checkpoint, spec.tokenizer) as (checkpoint, tokenizer):
        spec = replace(spec, checkpoint=checkpoint, tokenizer=tokenizer)
        if info.launcher != "single":
            return generate_rank(spec, info)
        threads = max(1, (os.cpu_count() or 1) // spec.nproc)
        return supervise(_generate_rank, spec.nproc,
                         (spec, spec.nproc, free_port("127.0.0.1"), threads), timeout)


def launch_bias(spec: BiasSpec, environ: Mapping[str, str] | None = None,
                timeout: float | None = None) -> dict | None:
    """Run `mt bias` ``spec`` at its layout: as one rank under a launcher, else on
    ``spec.nproc`` local processes. Returns the report on rank 0 (None on other ranks under a
    launcher)."""
    info = discover(os.environ if environ is None else environ)
    with as_pretrain_checkpoint(spec.checkpoint, spec.tokenizer) as (checkpoint, tokenizer):
        spec = replace(spec, checkpoint=checkpoint, tokenizer=tokenizer)
        if info.launcher != "single":
            return bias_rank(spec, info)
        if spec.nproc == 1:
            return bias_rank(spec, LaunchInfo(0, 1, 0, 1, "127.0.0.1", free_port("127.0.0.1"),
                                              "single"))
        threads = max(1, (os.cpu_count() or 1) // spec.nproc)
        return supervise(_bias_rank, spec.nproc,
                         (spec, spec.nproc, free_port("127.0.0.1"), threads), timeout)


def _bias_rank(rank: int, spec: BiasSpec, nproc: int, port: int, threads: int
               ) -> dict | None:
    torch.set_num_threads(threads)
    return bias_rank(spec, LaunchInfo(rank, nproc, rank, nproc, "127.0.0.1", port, "single"))


def launch_serve(spec: ServeSpec, environ: Mapping[str, str] | None = None) -> None:
    """Run `mt serve` ``spec``: on this process with the model whole, as one rank under a
    launcher, or on ``spec.nproc`` local processes (rank 0 listens)."""
    from mt_pretrain.serving.rank import serve_rank

    info = discover(os.environ if environ is None else environ)
    if info.rank == 0:  # refused now, not after the model is read
        _check_port(spec.host, spec.port)
    if info.launcher == "single" and spec.nproc == 1 and spec.tp == spec.pp == 1:
        serve_rank(spec, None)
        return
    with as_pretrain_checkpoint(spec.checkpoint, spec.tokenizer) as (checkpoint, tokenizer):
        spec = replace(spec, checkpoint=checkpoint, tokenizer=tokenizer,
                       model_name=spec.name)
        if info.launcher != "single":
            serve_rank(spec, info)
            return
        threads = max(1, (os.cpu_count() or 1) // spec.nproc)
        supervise(_serve_rank, spec.nproc, (spec, spec.nproc, free_port("127.0.0.1"), threads))


def _check_port(host: str, port: int) -> None:
    """OSError naming the address when ``host:port`` cannot be listened on."""
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise OSError(f"cannot serve on {host}:{port}: {err.strerror or err}") from None


def _serve_rank(rank: int, spec: ServeSpec, nproc: int, port: int, threads: int) -> None:
    from mt_pretrain.serving.rank import serve_rank

    torch.set_num_threads(threads)
    serve_rank(spec, LaunchInfo(rank, nproc, rank, nproc, "127.0.0.1", port, "single"))


def _generate_rank(rank: int, spec: GenerateSpec, nproc: int, port: int,
                   threads: int) -> list[dict] | None:
    torch.set_num_threads(threads)
    return generate_rank(spec, LaunchInfo(rank, nproc, rank, nproc, "127.0.0.1", port,
                                          "single"))


def _rank(rank: int, config: PretrainConfig, nproc: int, port: int, cache: Path,
          threads: int, keep_weights: bool) -> RunSummary | None:
    torch.set_num_threads(threads)
    one_line_warnings()  # a spawned rank speaks as the command does
    info = LaunchInfo(rank, nproc, rank, nproc, "127.0.0.1", port, "single")
    return run_rank(config, info, cache, keep_weights)


def spawn(config: PretrainConfig, nproc: int, cache: Path, timeout: float | None = None,
          keep_weights: bool = False) -> RunSummary | None:
    """Run ``nproc`` local ranks (forked when possible: no second torch import)."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    return supervise(_rank, nproc, (config, nproc, free_port("127.0.0.1"), cache, threads,
                                    keep_weights), timeout)


def supervise(target: Callable[..., T], nproc: int, args: tuple[Any, ...],
              timeout: float | None = None) -> T:
    """Run ``target(rank, *args)`` on ``nproc`` local processes; returns rank 0's value.

    SIGTERM / SIGINT are forwarded (the first asks the ranks to stop after their step, a
    second kills them); a failure of any rank stops the others and is raised here with its
    root cause (an expected failure, such as a bad config, as itself: one line).
    """
    interrupts: list[int] = []
    with LocalRanks(target, nproc, args=args) as ranks:

        def forward(signum: int, _frame: Any) -> None:
            interrupts.append(signum)
            ranks.signal(signal.SIGTERM if len(interrupts) == 1 else signal.SIGKILL)
            if len(interrupts) == 1:
                print("interrupted: the ranks stop after their current step (a training run "
                      "saves a checkpoint first); interrupt again to stop them at once",
                      file=sys.stderr, flush=True)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            outcome = ranks.collect(timeout, _GRACE_S)
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
        if len(interrupts) > 1 and outcome.failures:
            raise Interrupted("interrupted twice: the ranks were stopped at once, "
                              "without a checkpoint of the current step")
        _raise_failure(outcome, timeout)
        return outcome.reports[0].value


def _raise_failure(outcome: Outcome, timeout: float | None) -> None:
    n, silent, first = outcome.world_size, list(outcome.silent), outcome.root_cause()
    if outcome.timed_out:
        raise LaunchFailed(f"the run did not finish within {timeout} s; ranks {silent} killed")
    if first is None:
        return
    failed = sorted(r.rank for r in outcome.failures)
    if silent:
        # Peers failed (typically: a collective timed out) while these ranks said nothing:
        # they are stuck (stopped, deadlocked, in an endless loop); they are killed next.
        raise LaunchFailed(f"rank {silent[0]} of {n} hung: it gave no report while ranks "
                           f"{failed} failed waiting for it (stuck ranks {silent} killed); "
                           f"rank {first.rank} reported:\n{first.detail}")
    if first.kind in _EXPECTED_BY_NAME:
        raise _EXPECTED_BY_NAME[first.kind](first.message)
    raise LaunchFailed(f"rank {first.rank} of {n} failed first (failed ranks: {failed}):\n"
                       f"{first.detail}")
