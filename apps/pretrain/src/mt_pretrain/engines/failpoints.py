"""Fault injection: named points where a test can kill the process, as a crash would.

``MT_FAILPOINT=checkpoint.pointer`` (or ``name@rank`` for one rank only) makes
:func:`failpoint` SIGKILL the calling process when it reaches that point: no cleanup, no
``finally``, exactly like a power cut or an OOM kill. Tests use it to prove that a kill at
every phase of a checkpoint save leaves a resumable state. Unset, it costs one dict lookup.
Besides launch.py and the CLI, this is the only module that reads the environment.
"""

from __future__ import annotations

import os
import signal

__all__ = ["POINTS", "failpoint"]

#: The points, in the order a checkpoint save passes them.
POINTS = ("checkpoint.write", "checkpoint.meta", "checkpoint.replace", "checkpoint.rename",
          "checkpoint.pointer", "checkpoint.prune")


def failpoint(name: str, rank: int) -> None:
    """Die here (SIGKILL) if ``MT_FAILPOINT`` names this point (and this rank, if given)."""
    wanted = os.environ.get("MT_FAILPOINT")
    if not wanted:
        return
    point, _, only = wanted.partition("@")
    if point == name and (not only or int(only) == rank):
        os.kill(os.getpid(), signal.SIGKILL)
