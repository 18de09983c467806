"""Where a command will write, checked before its work starts: a result that cannot be written
is found then, in one line naming the flag, not after an evaluation of hours as a traceback."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["unwritable"]


def unwritable(flag: str, path: Path, folder: bool = False) -> str | None:
    """Why ``path`` (given as ``flag``; a file, or with ``folder`` a folder the command
    creates and fills) cannot be written, or None. The folders missing on the way are
    created by the command, so the nearest one that exists must be a folder it may write
    in. (A ``folder`` that is a file is the caller's to word.)"""
    if not folder and path.is_dir():
        return f"{flag} {path} is a folder; name the file to write"
    probe = path if folder and path.is_dir() else path.parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{flag} {path}: {probe} is a file, not a folder; name a path in a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{flag} {path}: no permission to write in {probe}"
    return None
