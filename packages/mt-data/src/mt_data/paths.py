"""Where a command's output may not go: onto, into or around one of its inputs, or over a
folder the command did not write.

Every mt command that writes a file or folder asks :func:`output_clash` before it starts
(and before any ``--overwrite`` / ``--force`` deletes anything), so that no output ever
replaces, deletes or hides something the same command reads. A command that writes into an
existing folder, or deletes one to replace it, first asks :func:`foreign_output` whether the
folder holds anything the command did not write (names it does not use): the one rule of
"mt's own output", with or without ``--overwrite``, so that no user file is ever deleted or
overwritten by a command pointed at the wrong folder. A command that writes one file asks
:func:`existing_file` before it starts: a file already there is replaced only with
``--overwrite``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from fnmatch import fnmatchcase
from pathlib import Path

__all__ = ["blocking_file", "existing_file", "foreign_entries", "foreign_message",
           "foreign_output", "output_clash", "unwritable"]

#: How many of the foreign entries a message names.
SHOWN = 3


def output_clash(flag: str, output: str | Path, inputs: Iterable[str | Path]) -> str | None:
    """One line saying how ``output`` (given as ``flag``) collides with one of ``inputs``
    (is it, holds it, or lies inside it), or None when it does not."""
    out = Path(output).resolve()
    for given in inputs:
        path = Path(given).resolve()
        if path == out or out in path.parents or path in out.parents:
            how = "is" if path == out else "holds" if out in path.parents else "lies inside"
            return (f"{flag} {output} {how} the input {given}: writing there would destroy "
                    f"what this command reads; choose another {flag}")
    return None


def blocking_file(output: str | Path) -> Path | None:
    """The file that stands where a folder on the way to ``output`` would be created (the
    nearest existing parent of ``output``, when it is not a folder), or None."""
    for parent in Path(output).absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def existing_file(flag: str, path: str | Path, overwrite: bool) -> str | None:
    """Why the file ``path`` (given as ``flag``) may not be written over, or None: it exists
    and ``overwrite`` (the command's ``--overwrite``) is off, or it is no regular file (a
    device, a pipe), which no output replaces. An absent path or a folder (which
    :func:`unwritable` words) is None."""
    path = Path(path)
    if not os.path.lexists(path) or path.is_dir():
        return None
    if path.exists() and not path.is_file():
        return f"{flag} {path} is not a regular file; name a file to write"
    if not overwrite:
        return f"{flag} {path} already exists; pass --overwrite to replace it"
    return None


def _foreign(entry: Path, patterns: Iterable[str]) -> list[str]:
    """What of ``entry`` no pattern matches (see :func:`foreign_entries`): nothing, the entry
    itself, or, in a folder named as one the patterns write into, its entries no inner
    pattern matches (``release/notes.txt``)."""
    folder = entry.is_dir() and not entry.is_symlink()
    name = entry.name + ("/" if folder else "")
    inner = []
    for pattern in patterns:
        head, nested, rest = pattern.partition("/")
        if folder == bool(nested) and fnmatchcase(entry.name, head):
            if not rest:
                return []
            inner.append(rest)
    return [name + found for found in foreign_entries(entry, inner)] if inner else [name]


def _matches(entry: Path, patterns: Iterable[str]) -> bool:
    return not _foreign(entry, patterns)


def foreign_entries(folder: str | Path, owned: Iterable[str],
                    among: Iterable[str] | None = None) -> list[str]:
    """The entries of ``folder`` (sorted; a folder's name ends in ``/``) that no pattern of
    ``owned`` matches: what the command owning those names did not write. Patterns are
    shell globs of names (``shard-*.arrow``); one ending in ``/`` matches folders only
    (whatever they hold), one of the form ``folder/inner`` folders only, every entry of which
    an ``inner`` pattern must match (``iter_*/mp_rank_*/model_optim_rng.pt``: a user's folder
    named like one a command writes is not its own), the others files (and links) only; a
    foreign entry inside such a folder is named with it (``release/notes.txt``). With
    ``among``, only the entries matching one of those patterns are considered (what a command
    would delete). An absent folder has none."""
    folder, owned = Path(folder), tuple(owned)
    if not folder.is_dir():
        return []
    found = []
    for entry in sorted(folder.iterdir()):
        if among is None or _matches(entry, among):
            found += _foreign(entry, owned)
    return found


def foreign_message(flag: str, output: str | Path, foreign: list[str], command: str,
                    option: str = "--overwrite", choose: str | None = None) -> str:
    """One line refusing to write into, or with ``option`` to delete, ``output`` (given as
    ``flag``; "" for a positional argument or a folder inside one), which holds ``foreign``
    (names ``command`` did not write): it names a few of them and the way out (``choose``:
    what to choose instead, default ``flag``)."""
    named = ", ".join(foreign[:SHOWN]) + (f" and {len(foreign) - SHOWN} more"
                                          if len(foreign) > SHOWN else "")
    where = f"{flag} {output}".strip()
    return (f"{where} holds {named}, which {command} did not write: {command} writes only "
            f"into a new or empty folder or one it wrote, and {option} deletes only folders "
            f"it wrote; move them away or choose another {choose or flag or 'destination'}")


def foreign_output(flag: str, output: str | Path, owned: Iterable[str], command: str,
                   option: str = "--overwrite", choose: str | None = None) -> str | None:
    """:func:`foreign_message` for an existing ``output`` that is a file or holds an entry
    no pattern of ``owned`` matches (see :func:`foreign_entries`); None for an absent, empty
    or own folder."""
    path = Path(output)
    if path.exists() and not path.is_dir():
        where = f"{flag} {output}".strip()
        return (f"{where} is a file, not a folder {command} wrote: {command} writes only a "
                f"new or empty folder or one it wrote, and {option} replaces only such a "
                f"folder; choose another {choose or flag or 'destination'}")
    foreign = foreign_entries(path, owned)
    return foreign_message(flag, output, foreign, command, option, choose) if foreign else None


def unwritable(flag: str, path: Path, folder: bool = False) -> str | None:
    """Why ``path`` (given as ``flag``; a file, or with ``folder`` a folder the command
    creates and fills) cannot be written, or None: checked before a command's work starts,
    so that a result that cannot be written is said then, not after hours of work. The
    folders missing on the way are created by the command, so the nearest one that exists
    must be a folder it may write in. (A ``folder`` that is a file is the caller's to
    word.)"""
    if not folder and path.is_dir():
        return f"{flag} {path} is a folder; name the file to write"
    probe = path if folder and path.is_dir() else path.parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{flag} {path}: {probe} is a file, not a folder; name a path in a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{flag} {path}: no permission to write in {probe}"
    try:  # what access() cannot tell: a file system that takes no new files (/proc, /sys)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        return f"{flag} {path}: cannot create a file in {probe} ({err.strerror})"
    return None
