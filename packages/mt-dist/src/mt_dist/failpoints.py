"""Fault injection: named points where a test can kill the process, as a crash would.

``MT_FAILPOINT=checkpoint.pointer`` (or ``name@rank`` for one rank only) makes
:func:`failpoint` SIGKILL the calling process when it reaches that point: no cleanup, no
``finally``, exactly like a power cut or an OOM kill. Tests use it to prove that a kill at
every phase of a checkpoint save leaves a resumable state. A stall point (``train.stall``)
instead runs one native operation of about half a minute, during which Python runs no signal
handler, as the attention of a very long sequence does; a slow point (``train.slow``) adds a
quarter of a second to every step of the rank, as a throttled GPU or a busy host would
(``checkpoint.snapshot``: three seconds before the copies of a background save, as a large
state's would take).
Unset, it costs one dict lookup. A helper process of a rank (the checkpoint writer of
``--async-save``) sets ``MT_FAILPOINT_PID`` to its rank's pid: a kill there kills the rank too.
Read by mt pretrain's checkpoint writer and training loop; the one module of mt-dist that
reads ``os.environ`` itself (the others are given the environment).
"""

from __future__ import annotations

import os
import signal
import sys
import time

__all__ = ["BACKGROUND", "POINTS", "SLOWS", "STALLS", "failpoint"]

#: The points, in the order a checkpoint save passes them.
POINTS = ("checkpoint.write", "checkpoint.meta", "checkpoint.replace", "checkpoint.rename",
          "checkpoint.pointer", "checkpoint.prune")
#: The start of a background write (--async-save), before the rank file: training has gone on.
BACKGROUND = ("checkpoint.background",)
#: Points that stall in native code instead of killing (before each training step).
STALLS = ("train.stall",)
#: Points that slow every pass by so many seconds: inside each training step's work, and
#: before a background save's copies of the state (longer than its writer's start).
SLOWS = {"train.slow": 0.25, "checkpoint.snapshot": 3.0}


def failpoint(name: str, rank: int) -> None:
    """Die here (SIGKILL) if ``MT_FAILPOINT`` names this point (and this rank, if given);
    stall or slow down instead at the points that do."""
    wanted = os.environ.get("MT_FAILPOINT")
    if not wanted:
        return
    point, _, only = wanted.partition("@")
    if point == name and (not only or int(only) == rank):
        if name in STALLS:
            _native_stall()
        elif name in SLOWS:
            time.sleep(SLOWS[name])
        else:
            if rank_pid := int(os.environ.get("MT_FAILPOINT_PID") or 0):
                os.kill(rank_pid, signal.SIGKILL)  # the rank this helper process serves
            os.kill(os.getpid(), signal.SIGKILL)


def _native_stall() -> None:
    """One float64 matmul of 8192 x 8192 (about 25 s on one core of a 2-core EPYC)."""
    import torch

    print("failpoint: stalling in a native operation", file=sys.stderr, flush=True)
    a = torch.ones(8192, 8192, dtype=torch.float64)
    torch.mm(a, a)
