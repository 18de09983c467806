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
- Results travel as plain pickles over a pipe (not torch's shared-memory reductions, which
  need the sender alive until the receiver maps the tensor).
- Nothing is printed or read from stdio, so pytest's output capturing cannot interfere.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from mt_dist.launcher import finalize_distributed

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
# After asking stuck ranks to dump their stacks (SIGUSR1), wait this long for the dumps.
_STACK_DUMP_WAIT_S = 0.3
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


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


def default_start_method() -> str:
    """``"fork"`` where the platform has it (fast), else ``"spawn"``.

    Also ``"spawn"`` once this process has initialized CUDA, which a forked child cannot use.
    """
    if torch.cuda.is_initialized() or "fork" not in mp.get_all_start_methods():
        return "spawn"
    return "fork"


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


@dataclass
class _Child:
    rank: int
    proc: mp.process.BaseProcess
    conn: Connection
    stack_file: str
    report: tuple[str, float, Any] | None = field(default=None)


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
    ctx = mp.get_context(start_method or default_start_method())
    deadline = time.monotonic() + timeout
    workdir = tempfile.mkdtemp(prefix="mt_dist_")
    store_path = os.path.join(workdir, "store")
    children: list[_Child] = []
    try:
        for rank in range(world_size):
            children.append(
                _start_child(ctx, rank, world_size, store_path, fn, args, kwargs, timeout)
            )
        return _collect(children, deadline, timeout)
    finally:
        for child in children:
            if child.proc.is_alive():
                child.proc.kill()
        for child in children:
            child.proc.join(5.0)
            child.conn.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _start_child(
    ctx: Any,
    rank: int,
    world_size: int,
    store_path: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    timeout: float,
) -> _Child:
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    # A forkserver child's parent is the server, not us: skip the parent-death check there.
    parent_pid = None if ctx.get_start_method() == "forkserver" else os.getpid()
    stack_file = os.path.join(os.path.dirname(store_path), f"rank{rank}.stack")
    proc = ctx.Process(
        target=_child_main,
        args=(rank, world_size, child_conn, parent_pid, store_path, stack_file, fn, tuple(args),
              dict(kwargs or {}), timeout),
        name=f"mt-dist-rank{rank}",
    )
    with warnings.catch_warnings():
        # Python >= 3.12 warns when forking a process that has threads; torch's idle
        # intra-op pool threads are harmless here (each child pins torch to one thread).
        warnings.filterwarnings("ignore", message=r".*fork\(\).*", category=DeprecationWarning)
        proc.start()
    child_conn.close()  # the parent's copy; EOF on parent_conn then means the child is gone
    return _Child(rank=rank, proc=proc, conn=parent_conn, stack_file=stack_file)


def _child_main(
    rank: int,
    world_size: int,
    conn: Connection,
    parent_pid: int | None,
    store_path: str,
    stack_file: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
) -> None:
    """Body of one rank: init gloo, run ``fn``, report ``(status, time, payload)``."""
    _die_with_parent(parent_pid)
    with open(stack_file, "w") as stack_out:
        if hasattr(faulthandler, "register"):
            # Lets the parent ask for this rank's Python stack when it hangs.
            faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
        try:
            torch.set_num_threads(1)
            store = dist.FileStore(store_path, world_size)
            store.set_timeout(timedelta(seconds=timeout))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout))
            report = ("ok", time.monotonic(), pickle.dumps(fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - everything, even SystemExit, goes to the parent
            report = ("error", time.monotonic(), traceback.format_exc())
        # Report before tearing down the group: peers notice the teardown and fail too,
        # and the root cause must reach the parent first.
        conn.send_bytes(pickle.dumps(report))
        # Leave together (see finalize_distributed); after a failure the parent kills this rank.
        finalize_distributed(completed=report[0] == "ok")
        conn.close()
        if hasattr(faulthandler, "unregister"):
            faulthandler.unregister(signal.SIGUSR1)  # before stack_out is closed


def _die_with_parent(parent_pid: int | None) -> None:
    """Have the kernel kill this rank if the parent dies (e.g. pytest killed by a timeout),
    so orphaned ranks never keep spinning on a small shared machine. Linux only."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _collect(children: list[_Child], deadline: float, timeout: float) -> list[Any]:
    """Wait for every rank's report; raise on a failure or at the deadline."""
    pending = {child.rank for child in children}
    grace_end: float | None = None  # set by the first failure
    while pending:
        now = time.monotonic()
        if grace_end is not None and now >= grace_end:
            break
        if grace_end is None and now >= deadline:
            _raise_timeout(children, pending, timeout)
        end = deadline if grace_end is None else grace_end
        waitables: list[Any] = [children[r].conn for r in pending]
        waitables += [children[r].proc.sentinel for r in pending]
        wait(waitables, timeout=end - now)
        for rank in sorted(pending):
            child = children[rank]
            if not _poll_report(child):
                continue
            pending.discard(rank)
            if child.report is not None and child.report[0] != "ok" and grace_end is None:
                grace_end = time.monotonic() + _ERROR_GRACE_S
    errors = {c.rank: c for c in children if c.report is not None and c.report[0] != "ok"}
    if errors:
        _raise_failure(errors, len(children))
    return [pickle.loads(c.report[2]) for c in children]  # type: ignore[index]


def _poll_report(child: _Child) -> bool:
    """Read ``child``'s report if it sent one or died; True once a report is known."""
    if child.report is not None:
        return True
    if child.conn.poll():
        try:
            child.report = pickle.loads(child.conn.recv_bytes())
            return True
        except EOFError:
            pass  # the child closed the pipe without a report: treat as died
    elif child.proc.is_alive():
        return False
    child.proc.join(1.0)
    child.report = (
        "error", time.monotonic(),
        f"rank {child.rank} exited with code {child.proc.exitcode} without reporting a result "
        "(killed by a signal, os._exit, or a crash in native code)\n",
    )
    return True


def _raise_failure(errors: dict[int, _Child], world_size: int) -> None:
    order = sorted(errors.values(), key=lambda c: c.report[1])  # type: ignore[index]
    first = order[0]
    text = {c.rank: str(c.report[2]) for c in order}  # type: ignore[index]
    message = f"rank {first.rank} of {world_size} failed:\n{text[first.rank]}"
    others = [c.rank for c in order[1:]]
    if others:
        last_lines = "\n".join(
            f"  rank {r}: {text[r].strip().splitlines()[-1] if text[r].strip() else ''}"
            for r in others
        )
        message += f"\nranks {others} failed later (likely as a consequence):\n{last_lines}"
    raise DistributedTestError(message, first.rank, text)


def _raise_timeout(children: list[_Child], pending: set[int], timeout: float) -> None:
    stuck = sorted(pending)
    for rank in stuck:
        if children[rank].proc.is_alive() and hasattr(signal, "SIGUSR1"):
            os.kill(children[rank].proc.pid, signal.SIGUSR1)
    time.sleep(_STACK_DUMP_WAIT_S)
    stacks = {rank: _read(children[rank].stack_file) for rank in stuck}
    done = [c.rank for c in children if c.rank not in pending]
    dumps = "\n".join(f"--- rank {r} stack ---\n{stacks[r] or '(no stack dump)'}" for r in stuck)
    raise DistributedTimeoutError(
        f"run_distributed timed out after {timeout:g} s: ranks {stuck} of {len(children)} had "
        f"not finished (ranks {done} had); all were killed\n{dumps}",
        stuck[0], stacks,
    )


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
