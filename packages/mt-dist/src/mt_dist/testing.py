"""Run a function in N local processes joined by a gloo process group (for tests).

``run_distributed(fn, 4, x)`` forks 4 processes; each one limits torch to one thread,
initializes a gloo default group, calls ``fn(x)`` and ships back its return value (or its
formatted traceback). The parent returns the values by rank, or raises an error carrying the
failing rank's traceback; a hang is killed after ``timeout`` seconds and reported with each
stuck rank's Python stack.

Why these choices:
- ``fork`` is the default start method: a spawned child re-imports torch (about 2 s each on a
  2-core machine), a forked one shares the already-imported modules copy-on-write.
- Rendezvous goes through a ``FileStore`` in a fresh temporary directory, not a TCP port:
  there is no "find a free port, close it, hope nobody takes it" race, and it sidesteps an
  occasional 5 s stall seen here when 4-8 clients connect to a ``TCPStore`` at once
  (gloo then binds its own ephemeral ports). Apps use ``init_distributed`` (tcp://).
- The processes are :class:`mt_dist.supervisor.LocalRanks`, the supervisor the apps use
  too: results travel as plain pickles, a dead rank is reported with its exit code.
- Nothing is printed or read from stdio, so pytest's output capturing cannot interfere.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mt_dist.launcher import finalize_distributed
from mt_dist.supervisor import LocalRanks, Outcome, default_start_method, preload_for_fork

__all__ = [
    "DistributedTestError",
    "DistributedTimeoutError",
    "default_start_method",
    "launch_local",
    "run_distributed",
]

# After the first failure, wait this long for other ranks' reports so the earliest failure
# (the likely root cause, by timestamp) is the one named first.
_ERROR_GRACE_S = 0.3


class DistributedTestError(RuntimeError):
    """A rank raised (or died). ``rank`` failed first; ``tracebacks`` maps rank -> text."""

    def __init__(self, message: str, rank: int | None, tracebacks: Mapping[int, str]) -> None:
        super().__init__(message)
        self.rank = rank
        self.tracebacks = dict(tracebacks)

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable despite the extra constructor arguments (e.g. raised in a nested harness).
        return (type(self), (str(self), self.rank, self.tracebacks))


class DistributedTimeoutError(DistributedTestError):
    """Some ranks had not finished when the timeout expired; they were killed."""


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local gloo ranks; return values by rank.

    Each process has ``torch.set_num_threads(1)`` and an initialized default process group.
    ``fn`` should be a module-level function (required if the platform must use spawn).
    Raises :class:`DistributedTestError` with the failing rank's traceback if any rank fails,
    and :class:`DistributedTimeoutError` (after killing every rank) on timeout.
    """
    return launch_local(fn, world_size, args=args, kwargs=kwargs, timeout=timeout)


def launch_local(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 180.0,
    start_method: str | None = None,
) -> list[Any]:
    """:func:`run_distributed` with explicit options (e.g. ``start_method="spawn"``)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if start_method in (None, "fork"):
        preload_for_fork()  # test ranks build optimizers: one import for all of them
    workdir = tempfile.mkdtemp(prefix="mt_dist_")
    store = os.path.join(workdir, "store")
    try:
        with LocalRanks(_gloo_rank, world_size, start_method=start_method, teardown=_leave,
                        name="mt-dist-rank",
                        args=(world_size, store, timeout, fn, tuple(args), dict(kwargs or {}))
                        ) as ranks:
            outcome = ranks.collect(timeout, _ERROR_GRACE_S)
            if outcome.timed_out:
                _raise_timeout(outcome, ranks.stacks(outcome.silent), timeout)
            if outcome.failures:
                _raise_failure(outcome)
            return outcome.values()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _gloo_rank(rank: int, world_size: int, store_path: str, timeout: float,
               fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One test rank: one torch thread, a gloo default group over a FileStore, ``fn``."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    store.set_timeout(timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        return fn(*args, **kwargs)
    finally:
        _end_children()


def _end_children() -> None:
    """Kill the processes ``fn`` started through multiprocessing and left running (e.g. the
    Manager behind megatron-core's checkpoint writer): a rank exits without cleanup, so they
    would outlive it, orphans holding memory."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join(5.0)


def _leave(ok: bool) -> None:
    # Leave together (see finalize_distributed); after a failure the parent kills this rank.
    finalize_distributed(completed=ok)


def _raise_failure(outcome: Outcome) -> None:
    first = outcome.root_cause()
    assert first is not None
    text = {r.rank: r.detail for r in outcome.failures}
    message = f"rank {first.rank} of {outcome.world_size} failed:\n{text[first.rank]}"
    others = [r.rank for r in outcome.failures if r.rank != first.rank]
    if others:
        last_lines = "\n".join(
            f"  rank {r}: {text[r].strip().splitlines()[-1] if text[r].strip() else ''}"
            for r in others
        )
        message += f"\nranks {others} failed later (likely as a consequence):\n{last_lines}"
    raise DistributedTestError(message, first.rank, text)


def _raise_timeout(outcome: Outcome, stacks: Mapping[int, str], timeout: float) -> None:
    stuck = list(outcome.silent)
    done = sorted(outcome.reports)
    dumps = "\n".join(f"--- rank {r} stack ---\n{stacks[r] or '(no stack dump)'}" for r in stuck)
    raise DistributedTimeoutError(
        f"run_distributed timed out after {timeout:g} s: ranks {stuck} of {outcome.world_size} "
        f"had not finished (ranks {done} had); all were killed\n{dumps}",
        stuck[0], dict(stacks),
    )
