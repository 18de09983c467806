"""Whether the checkpoint `mt serve` loaded is still what its path holds.

A server keeps the weights it loaded; the folder it was given may change under it (a run's
``latest`` moving to a new step, a step folder replaced or edited). :class:`CheckpointWatch`
notes what the path held when the server started (the folder it resolves to, and every
file's name, size and modification time there: a few ``stat`` calls, no reading) and, at
most every few seconds when asked, whether that still holds. The HTTP side then says so:
``/health`` answers 503 (an orchestrator restarts the server, which loads the change), the
model card names the folder it serves (``root``), and the change is announced once.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["CheckpointWatch", "checkpoint_state"]

_META, _LATEST = "meta.json", "latest"  # an mt pretrain step folder's, and a run's pointer


def checkpoint_state(path: str | Path) -> tuple[str, str]:
    """(the folder ``path`` designates now: itself, or the step folder its ``latest`` names;
    a digest of the name, size and modification time of every file under that folder)."""
    folder = Path(path)
    pointer = folder / _LATEST
    if not (folder / _META).is_file() and pointer.is_file():
        folder = folder / pointer.read_text(encoding="utf-8", errors="replace").strip()
    digest = hashlib.sha256()
    if folder.is_dir():
        for file in sorted(folder.rglob("*")):
            if file.is_file():
                stat = file.stat()
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

    def change(self) -> str | None:
        """None while ``path`` holds what the server loaded; else one line saying what
        changed (looked at again at most every ``every`` seconds; once changed, it stays
        changed, and the first time is announced)."""
        if self._change is None and self._clock() >= self._next:
            self._next = self._clock() + self._every
            folder, state = checkpoint_state(self.path)
            if (folder, state) != (self.folder, self._loaded):
                what = (f"now designates {folder}" if folder != self.folder else
                        "its files changed")
                self._change = (f"the checkpoint this server loaded ({self.folder}) is no "
                                f"longer what {self.path} holds ({what}): the server still "
                                "answers with the weights it loaded; restart mt serve to "
                                "serve the change")
                self._announce(f"warning: {self._change}")
        return self._change
