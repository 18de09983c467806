"""Start the ranks of a run: under a launcher, or N local processes (``--nproc``).

Under torchrun, mpirun/mpiexec (mpi4py) or SLURM srun, this process is one rank: its place
comes from ``mt_dist.discover(os.environ)``. Otherwise ``--nproc N`` forks N local ranks
joined by gloo over a free TCP port on 127.0.0.1; the parent prepares the data once, waits,
forwards SIGTERM / SIGINT (the ranks save a checkpoint and stop), and if a rank dies it stops
the others and reports the first failure. This module and the CLI are the only places that
read ``os.environ``.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from mt_dist import LaunchInfo, discover, free_port
from mt_pretrain.checkpoint import CheckpointError
from mt_pretrain.config import ConfigError, PretrainConfig
from mt_pretrain.data import check_vocab, default_cache_dir, ensure_data
from mt_pretrain.plan import resolve, sharding_styles
from mt_pretrain.run import RunSummary, run_rank
from mt_pretrain.run_folder import claim_run_folder
from mt_pretrain.train import NonFiniteLossError

__all__ = ["Interrupted", "LaunchFailed", "launch", "spawn"]

# Failures every rank meets alike (bad config, damaged checkpoint, diverged loss): the parent
# re-raises them as they are, one line, no traceback.
_EXPECTED = (ConfigError, CheckpointError, NonFiniteLossError)
_EXPECTED_BY_NAME = {kind.__name__: kind for kind in _EXPECTED}
# After the first rank fails, give the others this long to report (their errors are usually
# consequences) before killing them.
_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1


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
    claim_run_folder(config)
    check_vocab(plan, ensure_data(config, plan, cache))  # once, here, not racing per rank
    # Building a meta GPT imports torch's Python reference ops (seconds); do it once before
    # forking so that every rank inherits them.
    sharding_styles(plan.model)
    if nproc == 1:
        single = LaunchInfo(0, 1, 0, 1, "127.0.0.1", free_port("127.0.0.1"), "single")
        return run_rank(config, single, cache, keep_weights)
    return spawn(config, nproc, cache, timeout, keep_weights)


def _child(config: PretrainConfig, info: LaunchInfo, cache: Path, conn: Connection,
           threads: int, parent: int, keep_weights: bool) -> None:
    _die_with_parent(parent)
    torch.set_num_threads(threads)
    try:
        result = run_rank(config, info, cache, keep_weights)
        if result is not None and result.weights is not None:
            # As numpy arrays: torch would share the tensors' memory by file descriptors,
            # which die with this process before the parent reads them.
            result.weights = {k: v.cpu().numpy() for k, v in result.weights.items()}
        conn.send(("ok", result))
    except _EXPECTED as err:
        # Expected failures (every rank sees the same one): a message, no traceback; the
        # parent raises the same kind of error.
        try:
            conn.send((type(err).__name__, str(err)))
        finally:
            os._exit(1)
    except BaseException as err:  # noqa: BLE001 - report everything to the parent
        text = traceback.format_exc()
        sys.stderr.write(f"[rank {info.rank}] {text}")
        sys.stderr.flush()
        try:
            conn.send(("error", f"{type(err).__name__}: {err}\n{text}"))
        finally:
            os._exit(1)
    finally:
        conn.close()


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this rank if the launcher dies (no orphans on a small box)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def spawn(config: PretrainConfig, nproc: int, cache: Path, timeout: float | None = None,
          keep_weights: bool = False) -> RunSummary | None:
    """Run ``nproc`` local ranks (forked when possible: no second torch import)."""
    method = "fork" if "fork" in mp.get_all_start_methods() and not \
        torch.cuda.is_initialized() else "spawn"
    ctx = mp.get_context(method)
    port = free_port("127.0.0.1")
    threads = max(1, (os.cpu_count() or 1) // nproc)
    procs, conns = [], []
    for rank in range(nproc):
        info = LaunchInfo(rank, nproc, rank, nproc, "127.0.0.1", port, "single")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, name=f"mt-rank{rank}",
                           args=(config, info, cache, send, threads, os.getpid(),
                                 keep_weights))
        proc.start()
        send.close()
        procs.append(proc)
        conns.append(recv)

    interrupts = []

    def forward(signum: int, _frame: Any) -> None:
        # The first interrupt asks the ranks to save and stop after their step; a second
        # one stops them at once.
        interrupts.append(signum)
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM if len(interrupts) == 1 else signal.SIGKILL)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            return _collect(procs, conns, timeout)
        except LaunchFailed:
            if len(interrupts) > 1:
                raise Interrupted("interrupted twice: the ranks were stopped at once, "
                                  "without a checkpoint of the current step") from None
            raise
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)


def _collect(procs: list[Any], conns: list[Connection],
             timeout: float | None) -> RunSummary | None:
    reports: dict[int, tuple[str, Any]] = {}
    failures: list[int] = []  # in order of arrival: the first is the likely root cause
    deadline = None if timeout is None else time.monotonic() + timeout
    grace_end: float | None = None
    while len(reports) < len(procs):
        now = time.monotonic()
        if grace_end is not None and now > grace_end:
            break
        if deadline is not None and now > deadline:
            raise LaunchFailed(f"the run did not finish within {timeout} s; ranks "
                               f"{[r for r in range(len(procs)) if r not in reports]} killed")
        pending = [r for r in range(len(procs)) if r not in reports]
        wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], timeout=1.0)
        for r in pending:
            if conns[r].poll():
                try:
                    reports[r] = conns[r].recv()
                except EOFError:
                    procs[r].join(1.0)
                    reports[r] = ("error", f"rank {r} died with exit code "
                                           f"{procs[r].exitcode} (no report)")
            elif not procs[r].is_alive():
                procs[r].join(1.0)
                reports[r] = ("error", f"rank {r} died with exit code "
                                           f"{procs[r].exitcode} (no report)")
            if r in reports and reports[r][0] != "ok" and r not in failures:
                failures.append(r)
                if grace_end is None:
                    grace_end = time.monotonic() + _GRACE_S
    silent = [r for r in range(len(procs)) if r not in reports]
    if silent and failures:
        # Peers failed (typically: a collective timed out) while these ranks said nothing:
        # they are stuck (stopped, deadlocked, in an endless loop); they are killed next.
        detail = reports[failures[0]][1]
        raise LaunchFailed(f"rank {silent[0]} of {len(procs)} hung: it gave no report while "
                           f"ranks {sorted(failures)} failed waiting for it (stuck ranks "
                           f"{silent} killed); rank {failures[0]} reported:\n{detail}")
    if failures and reports[failures[0]][0] in _EXPECTED_BY_NAME:
        kind, message = reports[failures[0]]
        raise _EXPECTED_BY_NAME[kind](message)
    if failures or silent:
        # A rank that died without a word (a signal, an OOM kill) comes first: its peers'
        # errors ("connection closed by peer") are consequences, whatever arrived first.
        died = [r for r in failures if procs[r].exitcode is not None and procs[r].exitcode < 0]
        first = died[0] if died else failures[0] if failures else silent[0]
        detail = reports.get(first, ("error", "no report"))[1]
        raise LaunchFailed(f"rank {first} of {len(procs)} failed first (failed ranks: "
                           f"{sorted(failures)}):\n{detail}")
    summary = reports[0][1]
    if summary is not None and summary.weights is not None:
        summary.weights = {k: torch.from_numpy(v) for k, v in summary.weights.items()}
    return summary
