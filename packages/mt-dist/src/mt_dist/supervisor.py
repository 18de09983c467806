"""One local process supervisor: start N ranks, collect their reports, name the root cause.

``mt_dist.testing`` (tests) and :func:`supervise` (``mt pretrain --nproc``, and the
inference commands' ``--nproc``) run their ranks through :class:`LocalRanks`; which failures
are raised as themselves (bad input every rank meets alike) is the caller's to say.

- Each rank runs ``target(rank, *args, **kwargs)`` in its own process (forked where possible:
  a spawned child re-imports torch, seconds each on a small machine) and sends back one
  :class:`Report` as a plain pickle over a pipe (not torch's shared-memory reductions, which
  need the sender alive until the receiver maps the tensor).
- On Linux the kernel kills a rank whose parent dies: no orphans keep spinning.
- A rank that dies without a report (a signal, ``os._exit``, a native crash) gets one from
  the parent, with its exit code. After the first failure the others get ``grace_s`` to
  report (their errors are usually consequences), then collection ends.
- :meth:`Outcome.root_cause`: a rank killed by a signal comes first (its peers' "connection
  closed" errors are consequences, whichever report arrived first), else the earliest failure
  by the child's clock (``time.monotonic`` is system-wide on Linux).
- :meth:`LocalRanks.stacks` asks ranks that gave no report for their Python stacks
  (faulthandler on SIGUSR1), to show where a hung rank is stuck.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
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
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from mt_dist.exits import Interrupted, LaunchFailed

__all__ = ["LocalRanks", "Outcome", "Report", "default_start_method", "preload_for_fork",
           "supervise"]

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# After asking stuck ranks to dump their stacks (SIGUSR1), wait at most this long for the
# dumps (a rank continued on a busy machine may take seconds to be scheduled), and take a
# dump as finished once its size holds for this long.
_STACK_DUMP_WAIT_S = 10.0
_STACK_DUMP_SETTLE_S = 0.1


@dataclass(frozen=True)
class Report:
    """What one rank ended with: its return value, its exception, or its death."""

    rank: int
    ok: bool
    time: float  # time.monotonic() when it reported (or when the parent saw it die)
    value: Any = None
    kind: str = ""  # the exception's type name; "" when ok or died
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None  # set when the rank died without a report
    errno: int | None = None  # an OSError's: a full disk fails the run, a missing file is input

    @property
    def detail(self) -> str:
        """The traceback when there is one, else the message."""
        return self.traceback or self.message

    @property
    def killed_by_signal(self) -> bool:
        return self.exitcode is not None and self.exitcode < 0


@dataclass(frozen=True)
class Outcome:
    """Every report collected, the ranks that gave none, and whether time ran out."""

    world_size: int
    reports: Mapping[int, Report]
    silent: tuple[int, ...]  # no report when collection ended (still running: stuck?)
    timed_out: bool

    @property
    def failures(self) -> list[Report]:
        """Failed ranks, earliest first."""
        return sorted((r for r in self.reports.values() if not r.ok), key=lambda r: r.time)

    def root_cause(self) -> Report | None:
        """A rank killed by a signal, else the earliest failure; None when none failed."""
        failures = self.failures
        died = [r for r in failures if r.killed_by_signal]
        return (died or failures or [None])[0]

    def values(self) -> list[Any]:
        """Return values by rank (only meaningful when every rank succeeded)."""
        return [self.reports[r].value for r in range(self.world_size)]


def default_start_method() -> str:
    """``"fork"`` where the platform has it (fast), else ``"spawn"``.

    Also ``"spawn"`` once this process has initialized CUDA, which a forked child cannot use.
    """
    if torch.cuda.is_initialized() or "fork" not in mp.get_all_start_methods():
        return "spawn"
    return "fork"


def preload_for_fork() -> None:
    """Import, in a process about to fork ranks that train, what torch imports lazily in each
    of them: ``torch._dynamo``, which an optimizer's constructor imports, with sympy, which
    ops on meta tensors import. The forked ranks inherit it instead of importing it each
    (seconds a process on a small CPU machine, where the ranks share the cores).

    Nothing where ranks are not forked, nor on CUDA builds of torch: there the import is not
    shown to stay clear of CUDA, and a forked rank cannot use CUDA that its parent started.
    """
    if torch.backends.cuda.is_built() or default_start_method() != "fork":
        return
    importlib.import_module("torch._dynamo")


@dataclass
class _Rank:
    proc: Any  # multiprocessing.process.BaseProcess
    conn: Connection
    stack_file: str
    report: Report | None = field(default=None)


class LocalRanks:
    """``world_size`` local processes, each running ``target(rank, *args, **kwargs)``.

    ``teardown(ok)``, when given, runs in each rank after its report is sent (e.g. leaving a
    process group, which must not happen before the root cause reached the parent). Use as a
    context manager: leaving it kills and reaps every rank still running.
    """

    def __init__(self, target: Callable[..., Any], world_size: int, *,
                 args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                 start_method: str | None = None,
                 teardown: Callable[[bool], None] | None = None, name: str = "mt-rank") -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        ctx = mp.get_context(start_method or default_start_method())
        # A forkserver child's parent is the server, not us: skip the parent-death check.
        parent = None if ctx.get_start_method() == "forkserver" else os.getpid()
        self.world_size = world_size
        self._workdir = tempfile.mkdtemp(prefix="mt_ranks_")
        self._ranks: list[_Rank] = []
        try:
            for rank in range(world_size):
                recv, send = ctx.Pipe(duplex=False)
                stack_file = os.path.join(self._workdir, f"rank{rank}.stack")
                proc = ctx.Process(target=_rank_main, name=f"{name}{rank}", args=(
                    target, rank, tuple(args), dict(kwargs or {}), send, parent, stack_file,
                    teardown))
                with warnings.catch_warnings():
                    # Python >= 3.12 warns when forking a process that has threads; torch's
                    # idle intra-op pool threads are harmless here.
                    warnings.filterwarnings("ignore", message=r".*fork\(\).*",
                                            category=DeprecationWarning)
                    proc.start()
                send.close()  # the parent's copy: EOF then means the rank is gone
                self._ranks.append(_Rank(proc, recv, stack_file))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every rank still running."""
        for r in self._ranks:
            if r.proc.is_alive():
                os.kill(r.proc.pid, signum)

    def collect(self, timeout: float | None, grace_s: float) -> Outcome:
        """Wait for every report, at most ``timeout`` seconds (None: no limit); after the
        first failure, at most ``grace_s`` more."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = set(range(self.world_size))
        grace_end: float | None = None
        timed_out = False
        while pending:
            now = time.monotonic()
            if grace_end is not None and now >= grace_end:
                break
            if grace_end is None and deadline is not None and now >= deadline:
                timed_out = True
                break
            end = grace_end if grace_end is not None else deadline
            waitables: list[Any] = [self._ranks[r].conn for r in pending]
            waitables += [self._ranks[r].proc.sentinel for r in pending]
            wait(waitables, timeout=None if end is None else end - now)
            for rank in sorted(pending):
                report = self._poll(rank)
                if report is None:
                    continue
                pending.discard(rank)
                if not report.ok and grace_end is None:
                    grace_end = time.monotonic() + grace_s
        reports = {i: r.report for i, r in enumerate(self._ranks) if r.report is not None}
        return Outcome(self.world_size, reports, tuple(sorted(pending)), timed_out)

    def stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Python stacks of ``ranks`` (still running; a stopped one is continued first), ""
        where none could be dumped."""
        asked = []
        for rank in ranks:
            proc = self._ranks[rank].proc
            if proc.is_alive() and hasattr(signal, "SIGUSR1"):
                os.kill(proc.pid, signal.SIGCONT)
                os.kill(proc.pid, signal.SIGUSR1)
                asked.append(rank)
        deadline, sizes = time.monotonic() + _STACK_DUMP_WAIT_S, {}
        while asked and time.monotonic() < deadline:
            time.sleep(_STACK_DUMP_SETTLE_S)
            now = {rank: _size(self._ranks[rank].stack_file) for rank in asked}
            if all(now[rank] and now[rank] == sizes.get(rank) for rank in asked):
                break  # every dump written, none still growing
            sizes = now
        return {rank: _read(self._ranks[rank].stack_file) for rank in ranks}

    def close(self) -> None:
        """Kill every rank still running, reap them all, remove the scratch folder."""
        for r in self._ranks:
            if r.proc.is_alive():
                r.proc.kill()
        for r in self._ranks:
            r.proc.join(5.0)
            r.conn.close()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def _poll(self, rank: int) -> Report | None:
        r = self._ranks[rank]
        if r.report is not None:
            return r.report
        if r.conn.poll():
            try:
                r.report = pickle.loads(r.conn.recv_bytes())
                return r.report
            except EOFError:
                pass  # closed without a report: it died
        elif r.proc.is_alive():
            return None
        r.proc.join(1.0)
        code = r.proc.exitcode
        r.report = Report(rank, False, time.monotonic(), exitcode=code, message=(
            f"rank {rank} died with exit code {code} without a report (killed by a signal, "
            "os._exit or a crash in native code)"))
        return r.report


def _rank_main(target: Callable[..., Any], rank: int, args: tuple[Any, ...],
               kwargs: dict[str, Any], conn: Connection, parent: int | None, stack_file: str,
               teardown: Callable[[bool], None] | None) -> None:
    """Body of one rank: run ``target``, send the report, tear down."""
    _die_with_parent(parent)
    if parent is not None and hasattr(os, "setpgid"):
        # A process group of its own: a terminal's Ctrl-C reaches the supervising parent
        # only, which decides what the ranks get (else every rank sees the terminal's
        # SIGINT and the parent's forwarded signal: two interrupts for one key press).
        os.setpgid(0, 0)
    with open(stack_file, "w") as stack_out:
        if hasattr(faulthandler, "register"):
            faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
        try:
            value = target(rank, *args, **kwargs)
            payload = pickle.dumps(Report(rank, True, time.monotonic(), value=value))
            ok = True
        except BaseException as err:  # noqa: BLE001 - even SystemExit goes to the parent
            payload = pickle.dumps(Report(rank, False, time.monotonic(), kind=type(err).__name__,
                                          message=str(err), traceback=traceback.format_exc(),
                                          errno=getattr(err, "errno", None)))
            ok = False
        conn.send_bytes(payload)
        if teardown is not None:
            teardown(ok)
        conn.close()
        if hasattr(faulthandler, "unregister"):
            faulthandler.unregister(signal.SIGUSR1)  # before stack_out is closed
    if not ok:
        # Reported; do not risk hanging in the interpreter's exit (threads of a broken
        # process group): leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _die_with_parent(parent: int | None) -> None:
    """Have the kernel kill this rank if the parent dies (e.g. killed by a test timeout)."""
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


_OS_ERRORS = (OSError, FileNotFoundError, PermissionError, IsADirectoryError,
              NotADirectoryError, FileExistsError)
# After the first rank fails, give the others this long to report (their errors are usually
# consequences) before killing them.
_GRACE_S = 5.0


def supervise(target: Callable[..., Any], nproc: int, args: tuple[Any, ...],
              timeout: float | None = None,
              expected: tuple[type[BaseException], ...] = ()) -> Any:
    """Run ``target(rank, *args)`` on ``nproc`` local processes; returns rank 0's value.

    SIGTERM / SIGINT are forwarded (the first asks the ranks to stop after their step, a
    second kills them: :class:`~mt_dist.exits.Interrupted`); a failure of any rank stops the
    others and is raised here with its root cause: one of ``expected`` (failures every rank
    meets alike: a bad config, a damaged checkpoint) or of the operating system's refusals as
    itself, one line; anything else as :class:`~mt_dist.exits.LaunchFailed` with the rank's
    traceback.
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
        # Hung ranks (no report while others failed, or time ran out): their stacks, asked
        # for before the ranks are killed.
        stacks = ranks.stacks(outcome.silent) if outcome.silent and (
            outcome.failures or outcome.timed_out) else {}
        _raise_failure(outcome, timeout, {kind.__name__: kind
                                          for kind in (*expected, *_OS_ERRORS)}, stacks)
        return outcome.reports[0].value


def _raise_failure(outcome: Outcome, timeout: float | None,
                   expected: Mapping[str, type[BaseException]],
                   stacks: Mapping[int, str]) -> None:
    n, silent, first = outcome.world_size, list(outcome.silent), outcome.root_cause()
    last_words = {**{r.rank: r.detail for r in outcome.failures},
                  **{r: stacks.get(r) or "no stack: the rank did not answer (stopped?)"
                     for r in silent}}
    if outcome.timed_out:
        raise LaunchFailed(f"the run did not finish within {timeout} s; ranks {silent} killed",
                           f"the run did not finish within {timeout} s", last_words)
    if first is None:
        return
    failed = sorted(r.rank for r in outcome.failures)
    if silent:
        # Peers failed (typically: a collective timed out) while these ranks said nothing:
        # they are stuck (stopped, deadlocked, in an endless loop); they are killed next.
        raise LaunchFailed(f"rank {silent[0]} of {n} hung: it gave no report while ranks "
                           f"{failed} failed waiting for it (stuck ranks {silent} killed); "
                           f"rank {first.rank} reported:\n{first.detail}",
                           f"rank {silent[0]} of {n} hung", last_words, tuple(silent))
    if first.kind in expected:
        err = expected[first.kind](first.message)
        if isinstance(err, OSError):
            err.errno = first.errno  # what mt_dist.exits decides the exit status by
        raise err
    raise LaunchFailed(f"rank {first.rank} of {n} failed first (failed ranks: {failed}):\n"
                       f"{first.detail}", f"rank {first.rank} of {n} {_how(first)}",
                       last_words, (first.rank,))


def _how(report: Report) -> str:
    """How a rank failed, in a few words."""
    if report.killed_by_signal:
        try:
            return f"killed by {signal.Signals(-report.exitcode).name}"
        except ValueError:
            return f"killed by signal {-report.exitcode}"
    if report.exitcode is not None:
        return f"exited with code {report.exitcode} without a report"
    line = report.message.splitlines()[0] if report.message else ""
    return f"raised {report.kind}" + (f": {line}" if line else "")
