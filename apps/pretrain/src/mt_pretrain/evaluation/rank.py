"""One rank of `mt eval` with mt-eval's own engine: this rank's scoring session
(:mod:`mt_pretrain.evaluation.session`) -> tasks -> scores -> results (rank 0 reports)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from mt_dist import LaunchInfo
from mt_eval import TaskResult, evaluate, load_task
from mt_pretrain.evaluation.session import EvalSpec, ScoringSession

__all__ = ["EvalSpec", "eval_rank"]


@contextmanager
def _progress_bar(show: bool) -> Iterator[Callable[[int, int], None] | None]:
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
    tasks = [load_task(name) for name in spec.tasks]
    session = ScoringSession(spec, info)
    completed = False
    try:
        with _progress_bar(spec.progress and session.is_main) as progress:
            results = evaluate(tasks, session.encode, session.prefix, session.scorer,
                               spec.shots, spec.fewshot_seed, spec.limit, spec.batch_size,
                               progress)
        completed = True
        return results if session.is_main else None
    finally:
        session.close(completed)
