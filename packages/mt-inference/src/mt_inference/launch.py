"""The one launcher of the inference commands: a job (an evaluation, a generation, a bias
report, a server) of a placement runs as one rank under a launcher (torchrun, mpirun, srun:
mt-dist's ``discover``), on this process, or on ``--nproc`` local processes (mt-dist's
``supervise``); a checkpoint of another format is converted once first, in this process."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from mt_checkpoint import CheckpointError
from mt_data import DataError
from mt_dist import LaunchInfo, discover, free_port
from mt_dist.supervisor import supervise
from mt_eval import TaskError
from mt_inference.model import as_pretrain_checkpoint
from mt_inference.placement import Placement, PlacementError

__all__ = ["EXPECTED", "Job", "evaluate", "launch", "local_info"]

#: Failures every rank meets alike (a bad checkpoint, task, tokenizer or layout): raised in
#: the parent as they are, one line (ValueError and OSError always are).
EXPECTED = (CheckpointError, DataError, TaskError, PlacementError)

T = TypeVar("T")


class Job(Protocol):
    """What the launcher runs: a frozen spec with its placement."""

    placement: Placement


J = TypeVar("J", bound=Job)


def local_info(rank: int, nproc: int, port: int) -> LaunchInfo:
    """Rank ``rank`` of ``nproc`` local processes joined on 127.0.0.1:``port``."""
    return LaunchInfo(rank, nproc, rank, nproc, "127.0.0.1", port, "single")


def launch(job: J, rank: Callable[[J, LaunchInfo], T], environ: Mapping[str, str] | None = None,
           timeout: float | None = None) -> T | None:
    """``rank(job, info)`` on every rank of ``job.placement``; returns rank 0's value (None
    on the other ranks under a launcher). The checkpoint, if of another format, is converted
    once (under a launcher: once per rank) into a temporary mt checkpoint first."""
    info = discover(os.environ if environ is None else environ)
    placement = job.placement
    with as_pretrain_checkpoint(placement.checkpoint, placement.tokenizer) as (path, tok):
        job = replace(job, placement=replace(placement, checkpoint=path, tokenizer=tok))
        if info.launcher != "single":
            return rank(job, info)
        if placement.nproc == 1:
            return rank(job, local_info(0, 1, free_port("127.0.0.1")))
        threads = max(1, (os.cpu_count() or 1) // placement.nproc)
        return supervise(_local_rank, placement.nproc,
                         (rank, job, placement.nproc, free_port("127.0.0.1"), threads),
                         timeout, expected=EXPECTED)


def _local_rank(index: int, rank: Callable[[Any, LaunchInfo], T], job: Any, nproc: int,
                port: int, threads: int) -> T:
    import torch

    torch.set_num_threads(threads)
    return rank(job, local_info(index, nproc, port))


def evaluate(spec: Any, environ: Mapping[str, str] | None = None,
             timeout: float | None = None) -> Any:
    """`mt eval` ``spec`` (an :class:`~mt_inference.rank.EvalSpec`) with its task engine:
    mt-eval's (its tasks loaded first: a bad task file fails before any process starts; the
    results), or lm-evaluation-harness (lm-eval's results dict); None on ranks other than 0
    under a launcher."""
    from mt_eval import load_tasks
    from mt_inference.rank import eval_rank

    if spec.engine == "harness":
        from mt_inference.harness import harness_rank, include_paths, task_manager

        task_manager(include_paths(spec))  # built once here, shared by the forked ranks
        return launch(spec, harness_rank, environ, timeout)
    load_tasks(spec.tasks)
    return launch(spec, eval_rank, environ, timeout)
