"""Whether the checkpoint `mt serve` loaded is still what its path holds.

A server keeps the weights it loaded; the folder it was given may change under it (a run's
``latest`` moving to a new step, a step folder replaced or edited). :class:`CheckpointWatch`
notes what the path held when the server started (the folder it resolves to, and every
file's name, size and modification time there: ``stat`` calls, no tensor read) and, at
most every few seconds when asked, whether that still holds (a change undone, as an
editor's temporary file gone again, is no longer one). The HTTP side then says so:
``/health`` answers 503 (an orchestrator restarts the server, which loads the change), the
model card names the folder it serves (``root``), and the change is announced once.
"""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from stat import S_ISREG

__all__ = ["CheckpointWatch", "checkpoint_state"]


def checkpoint_state(path: str | Path) -> tuple[str, str]:
    """(the folder ``path`` designates now, as the loader finds it: itself, or the step folder
    its ``latest`` names, or the newest complete one; a digest of the name, size and
    modification time of every file under that folder, a file gone while looked at counting
    as a change)."""
    from mt_checkpoint import CheckpointError, find_checkpoint

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the loader said which step it loaded
            folder = Path(find_checkpoint(path))
    except (CheckpointError, OSError):  # another format's folder, or none there now
        folder = Path(path)
    digest = hashlib.sha256()
    try:
        files = sorted(folder.rglob("*")) if folder.is_dir() else []
    except OSError:  # a folder gone while it was walked
        files = []
    for file in files:
        try:
            stat = file.stat()
        except OSError:
            digest.update(f"{file.relative_to(folder)}\0gone\n".encode())
            continue
        if S_ISREG(stat.st_mode):
            digest.update(f"{file.relative_to(folder)}\0{stat.st_size}\0"
                          f"{stat.st_mtime_ns}\n".encode())
    return str(folder.resolve()), digest.hexdigest()[:16]


class CheckpointWatch:
    """What ``path`` held when created (``folder``), and :meth:`change`."""

    def __init__(self, path: str | Path, announce: Callable[[str], None],
                 every: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = str(path)
        self.folder, self._loaded = checkpoint_state(path)
        self._announce, self._every, self._clock = announce, every, clock
        self._next = clock() + every
        self._change: str | None = None
        self._lock = threading.Lock()  # asked from the HTTP side's worker threads

    def change(self) -> str | None:
        """None while ``path`` holds what the server loaded; else one line saying what
        changed (looked at again at most every ``every`` seconds; announced when it is
        first seen, and again after ``path`` held the loaded checkpoint in between)."""
        with self._lock:
            return self._look()

    def _look(self) -> str | None:
        if self._clock() < self._next:
            return self._change
        self._next = self._clock() + self._every
        folder, state = checkpoint_state(self.path)
        if (folder, state) == (self.folder, self._loaded):
            self._change = None
        elif self._change is None:
            what = f"now designates {folder}" if folder != self.folder else "its files changed"
            self._change = (f"the checkpoint this server loaded ({self.folder}) is no longer "
                            f"what {self.path} holds ({what}): the server still answers with "
                            "the weights it loaded; restart mt serve to serve the change")
            self._announce(f"warning: {self._change}")
        return self._change
