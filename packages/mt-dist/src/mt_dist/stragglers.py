"""Stragglers: a rank persistently slower than the ranks that do the same work.

Each step every rank times its own work (:class:`BusyClock`: its forward, backward and
optimizer step, less the time it waited for its peers in the data-parallel collectives), and
one all-gather gives every rank the table (:func:`gather_busy`).
:class:`StragglerWatch` keeps the last ``window`` rows and compares each rank with its peers:
the ranks of its data-parallel group, which hold the same layers and the same slices of them
and so do the same work (comparing a pipeline's first stage with its last would name the
stage that computes the loss). A rank whose median over the window exceeds ``factor`` times
its peers' median is named, once, until it recovers.

What it can show: the waits left out are the host's, in the asynchronous collectives (gloo
on CPU, shown there). The blocking collectives inside the model (tensor-, context- and
pipeline-parallel exchanges) count as work, so a slow rank's model-parallel peers may be
named with it. On CUDA an NCCL collective is waited for by the GPU's stream, not the host,
so a peer's wait shows as work later (at the host's next synchronisation): there the line
may name a slow rank's peers too. With one data-parallel rank there are no peers: nothing
is named.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mt_dist.collectives import Handle

__all__ = ["BusyClock", "Straggler", "StragglerWatch", "gather_busy"]


class BusyClock:
    """Seconds of one rank's own work: the wall time between :meth:`start` and :meth:`stop`
    (as many intervals as a step has) less the time it spent blocked waiting for its peers
    in the asynchronous collectives of data parallelism and ZeRO
    (:attr:`mt_dist.collectives.Handle.blocked`), where a fast rank waits for a slow one."""

    def __init__(self) -> None:
        self._total = 0.0
        self._began = self._blocked = 0.0

    def start(self) -> None:
        self._began, self._blocked = time.perf_counter(), Handle.blocked

    def stop(self) -> None:
        self._total += (time.perf_counter() - self._began) - (Handle.blocked - self._blocked)

    def take(self) -> float:
        """The seconds counted since the last :meth:`take`; starts counting anew."""
        total, self._total = self._total, 0.0
        return total


def gather_busy(seconds: float, device: torch.device) -> list[float]:
    """Every rank's ``seconds``, in rank order, on every rank (one all-gather of a float64
    per rank; a collective of the world group). Without a process group: this rank's."""
    local = torch.tensor([seconds], dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [seconds]
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, local)
    return [float(r) for r in torch.cat(rows).tolist()]


@dataclass(frozen=True)
class Straggler:
    """A rank named slow: its median busy seconds over the window, its peers' median, and
    the ranks it was compared with."""

    rank: int
    seconds: float
    peers_seconds: float
    peers: tuple[int, ...]
    steps: int

    @property
    def ratio(self) -> float:
        return self.seconds / self.peers_seconds if self.peers_seconds > 0 else float("inf")

    def line(self, host: str = "") -> str:
        """One line naming the rank, how much slower, than whom, over how many steps."""
        where = f" on {host}" if host else ""
        peers = ", ".join(str(p) for p in self.peers[:8])
        more = f", ... ({len(self.peers) - 8} more)" if len(self.peers) > 8 else ""
        return (f"rank {self.rank}{where} is a straggler: its steps' work takes "
                f"{self.ratio:.2f}x its peers' ({self.seconds:.3f} s against "
                f"{self.peers_seconds:.3f} s, medians over the last {self.steps} steps; "
                f"peers: ranks {peers}{more}, the same layers on other data)")


class StragglerWatch:
    """Names ranks persistently slower than their data-parallel peers.

    ``groups``: the ranks that do the same work, each a sequence of global ranks (the
    data-parallel groups); ``window``: steps a verdict is taken over; ``factor``: how much
    slower than its peers' median a rank's median must be.
    """

    def __init__(self, groups: Sequence[Sequence[int]], window: int = 20,
                 factor: float = 1.5) -> None:
        if window < 1 or not factor > 1.0:
            raise ValueError(f"need window >= 1 and factor > 1, got {window} and {factor}")
        self.groups = [tuple(g) for g in groups if len(g) > 1]
        self.window, self.factor = window, factor
        self._rows: deque[list[float]] = deque(maxlen=window)
        self.slow: set[int] = set()

    def add(self, busy: Sequence[float]) -> tuple[list[Straggler], list[int]]:
        """One step's busy seconds by rank; returns (ranks that just became stragglers,
        ranks that just recovered), both empty until the window is full."""
        self._rows.append(list(busy))
        if len(self._rows) < self.window:
            return [], []
        medians = [statistics.median(column) for column in zip(*self._rows)]
        now: dict[int, Straggler] = {}
        for group in self.groups:
            for rank in group:
                peers = tuple(r for r in group if r != rank)
                typical = statistics.median(medians[r] for r in peers)
                if medians[rank] > self.factor * typical:
                    now[rank] = Straggler(rank, medians[rank], typical, peers, self.window)
        new = [s for r, s in sorted(now.items()) if r not in self.slow]
        recovered = sorted(self.slow - now.keys())
        self.slow = set(now)
        return new, recovered
