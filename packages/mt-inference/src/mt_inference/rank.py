"""One rank of `mt eval`: its spec, and with mt-eval's own engine this rank's scoring session
(:mod:`mt_inference.session`) -> tasks -> scores -> results (rank 0 reports); with
lm-evaluation-harness, :func:`mt_inference.harness.harness_rank`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from mt_dist import LaunchInfo
from mt_eval import TaskResult, evaluate, load_tasks
from mt_inference.placement import Placement
from mt_inference.session import ScoringSession

__all__ = ["EvalSpec", "eval_rank", "progress_bar"]


@dataclass(frozen=True)
class EvalSpec:
    """One `mt eval` run (the command's options)."""

    placement: Placement
    tasks: tuple[str, ...]
    shots: int | None = None
    fewshot_seed: int = 1234
    batch_size: int = 16
    limit: int | None = None
    progress: bool = True
    engine: str = "mt"
    """Task engine: mt (mt-eval's) or harness (lm-evaluation-harness)."""
    include_path: str | None = None
    """Extra folder of lm-eval task YAMLs (the harness engine)."""
    data_dir: str | None = None
    """Local copies of the tasks' datasets (the harness engine)."""
    log_samples: bool = False
    suite: str | None = None
    """A suite of lm-eval tasks at its shot counts (:mod:`mt_inference.suites`)."""


@contextmanager
def progress_bar(show: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar over requests (rank 0, when asked), as a ``progress(done, total)``
    callback."""
    if not show:
        yield None
        return
    with Progress(TextColumn("scoring"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("requests", total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=min(done, total), total=total)

        yield update


def eval_rank(spec: EvalSpec, info: LaunchInfo) -> list[TaskResult] | None:
    """Evaluate with mt-eval's engine as rank ``info.rank``; returns the results on rank 0,
    None elsewhere."""
    tasks = load_tasks(spec.tasks)
    session = ScoringSession(spec.placement, info)
    completed = False
    try:
        with progress_bar(spec.progress and session.is_main) as progress:
            results = evaluate(tasks, session.encode, session.prefix, session.scorer,
                               spec.shots, spec.fewshot_seed, spec.limit, spec.batch_size,
                               progress)
        completed = True
        return results if session.is_main else None
    finally:
        session.close(completed)
