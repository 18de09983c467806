"""A run that survives its machines: local ranks started again after a failure, and a process
that learns its launcher restarted it.

:func:`supervise_restarting` is :func:`~mt_dist.supervisor.supervise` that, when a rank dies,
hangs or raises what no one expected (:class:`~mt_dist.exits.LaunchFailed`), keeps every
rank's last words (traceback, or the Python stack of a hung rank) in a folder and starts the
ranks again, at most ``max_restarts`` times: what to resume from is the caller's (its
``args`` are built anew for each attempt). An elastic run (``elastic`` given) leaves the
slots of the ranks at fault out of the next attempt and continues on as many of the others
as ``elastic`` allows. :func:`launcher_restart` reads the restart count
torchrun (``TORCHELASTIC_RESTART_COUNT``) or SLURM (``SLURM_RESTART_COUNT``, a requeued job)
give a restarted process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mt_dist.exits import LaunchFailed
from mt_dist.supervisor import supervise

__all__ = ["RESTART_COUNTS", "Restart", "agreed_restart", "keep_last_words", "launcher_restart",
           "supervise_restarting"]

#: How a launcher tells a process it was restarted: its count of restarts so far.
RESTART_COUNTS = {"TORCHELASTIC_RESTART_COUNT": "torchrun", "SLURM_RESTART_COUNT": "SLURM"}


@dataclass(frozen=True)
class Restart:
    """A run started again after a failure: the ``count``-th restart (of ``limit``; 0: the
    launcher's own, unbounded here), what failed (``cause``, a few words) and where every
    rank's traceback or stack of the failed attempt was kept (``stacks``, or ""). An elastic
    restart runs on ``slots`` (rank r on slot ``slots[r]``: the GPU index of a local run)
    out of the ``started`` the run began with; empty when every slot is kept."""

    count: int
    limit: int
    cause: str
    stacks: str = ""
    slots: tuple[int, ...] = ()
    started: int = 0

    def line(self, resumed: str) -> str:
        """The one line a run prints: which restart, after what, on how many ranks, from
        where."""
        of = f" of {self.limit}" if self.limit else ""
        kept = f" (every rank's stack: {self.stacks})" if self.stacks else ""
        fewer = f"continuing on {len(self.slots)} of {self.started} ranks, " if \
            0 < len(self.slots) < self.started else ""
        return f"restart {self.count}{of} after {self.cause}{kept}: {fewer}{resumed}"


def launcher_restart(environ: Mapping[str, str]) -> Restart | None:
    """The restart this process is, when its launcher restarted it (else None). A count that
    is not a whole number >= 0 is refused (``ValueError`` naming the variable): read as 0, a
    restarted job would not know it continues a run."""
    for name, who in RESTART_COUNTS.items():
        count = environ.get(name, "0").strip()
        if not (count.isascii() and count.isdigit()):
            raise ValueError(f"{name}={environ[name]!r} is not a restart count (a whole "
                             "number >= 0, as the launcher sets it)")
        if int(count) > 0:
            return Restart(int(count), 0, f"{who} restarted the job")
    return None


def agreed_restart(restart: Restart | None, launcher: str, device: Any) -> Restart | None:
    """The restart every rank of the job agrees it is (collective over the default group):
    under an elastic launcher an agent that joined the job later counts its own restarts
    from 0 while its peers continue a run, so the job is a restart for every rank when it is
    one for any, numbered by the largest count. ``restart``: this rank's own view;
    ``device``: where the default group's collectives run."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return restart
    count = torch.tensor([restart.count if restart else 0], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    largest = int(count.item())
    if largest == 0 or (restart is not None and restart.count == largest):
        return restart
    who = dict((v.lower(), v) for v in RESTART_COUNTS.values()).get(launcher, launcher)
    return Restart(largest, 0, f"{who} restarted the job")


def keep_last_words(err: LaunchFailed, folder: Path) -> Path | None:
    """``err``'s every-rank tracebacks and stacks, one ``rank-N.txt`` each, in ``folder``;
    None when there are none or the folder cannot be written."""
    if not err.stacks:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for rank, text in sorted(err.stacks.items()):
            (folder / f"rank-{rank}.txt").write_text(text + "\n", encoding="utf-8")
    except OSError:
        return None
    return folder


def supervise_restarting(target: Callable[..., Any], nproc: int,
                         args: Callable[[Restart | None], tuple[Any, ...]],
                         max_restarts: int, last_words: Path,
                         timeout: float | None = None,
                         expected: tuple[type[BaseException], ...] = (),
                         elastic: Callable[[int], int | None] | None = None) -> Any:
    """``supervise(target, nproc, args(restart))``, started again after a failed attempt at
    most ``max_restarts`` times (``args`` learns which restart it builds for); each failed
    attempt's last words go to ``last_words/failure-<attempt>``. The last failure is raised
    with where they were kept.

    ``elastic``: the ranks at fault are taken out of the run (a GPU that failed is not
    trusted again); given how many slots are left, it says how many ranks the next attempt
    runs on (None: too few, the failure is raised).
    """
    restart, slots = None, tuple(range(nproc))
    while True:
        try:
            return supervise(target, len(slots), args(restart), timeout, expected=expected)
        except LaunchFailed as err:
            done = restart.count if restart is not None else 0
            kept = keep_last_words(err, last_words / f"failure-{done}")
            size = len(slots)
            if elastic is not None:
                slots = tuple(s for r, s in enumerate(slots) if r not in err.ranks)
                size = elastic(len(slots)) or 0
            if done >= max_restarts or size < 1:
                where = f"\n(every rank's stack: {kept})" if kept else ""
                why = "" if size else f"\n({len(slots)} ranks left: too few to continue)"
                raise LaunchFailed(f"{err}{where}{why}", err.cause, err.stacks,
                                   err.ranks) from None
            slots = slots[:size]
            restart = Restart(done + 1, max_restarts, err.cause, str(kept) if kept else "",
                              slots if elastic is not None else (), nproc)
