"""What `mt data prepare` records of each file it reads, and how it tells that one changed.

A run's fingerprint holds, per file read, its size, its modified time (nanoseconds) and
:func:`sample_sha256`; a finished dataset or an unfinished run whose files no longer match is
refused (never served stale, never resumed with chunks of the old input), and a file that
changes while the run reads it is refused before the dataset is published.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mt_data.errors import PrepareError

__all__ = ["changed_file", "check_recorded", "check_unchanged", "file_record", "same_run",
           "sample_sha256", "what_changed"]


SAMPLE_EDGE = 1 << 20
"""Bytes of a file's head, and of its tail, that :func:`sample_sha256` reads."""
SAMPLE_BLOCK = 64 << 10
SAMPLE_BLOCKS = 32
"""Evenly spaced blocks of ``SAMPLE_BLOCK`` bytes between the head and the tail it reads."""


def sample_sha256(path: Path, size: int) -> str:
    """SHA-256 over a file's ``size`` and a fixed sample of its bytes: the first and last
    ``SAMPLE_EDGE`` bytes and ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BLOCK`` bytes evenly spaced
    between them (a file of up to 4 MiB is read whole).

    Why a sample: the fingerprint is taken on every run, the "already complete" check
    included, and a full hash of a 100 GB corpus reads 100 GB (minutes, each time); the
    sample reads 4 MiB per file whatever its size (milliseconds). With the size and the
    modified time (nanoseconds) recorded beside it, an edit in place is caught when it changes
    the size, the modified time (every editor, ``cp``, ``>>``, a rewrite) or a sampled byte (an
    edit that also restores the modified time); what escapes is an edit that keeps the size
    and the modified time and touches no sampled byte."""
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    whole = 2 * SAMPLE_EDGE + SAMPLE_BLOCKS * SAMPLE_BLOCK
    with open(path, "rb") as f:
        if size <= whole:
            digest.update(f.read(whole))
        else:
            digest.update(f.read(SAMPLE_EDGE))
            middle = size - 2 * SAMPLE_EDGE
            step = (middle - SAMPLE_BLOCK) // max(SAMPLE_BLOCKS - 1, 1)
            for k in range(SAMPLE_BLOCKS):
                f.seek(SAMPLE_EDGE + k * step)
                digest.update(f.read(SAMPLE_BLOCK))
            f.seek(size - SAMPLE_EDGE)
            digest.update(f.read(SAMPLE_EDGE))
    return digest.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """What the fingerprint records of one file read: path, size, modified time, sample."""
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sample_sha256": sample_sha256(path, stat.st_size)}


def same_run(recorded: dict[str, Any], fingerprint: dict[str, Any]) -> bool:
    """Same inputs and settings (the files' records aside)."""
    def strip(fp: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in fp.items() if k != "files"}
    return strip(recorded) == strip(json.loads(json.dumps(fingerprint)))  # tuples as lists


def what_changed(before: dict[str, Any], now: dict[str, Any]) -> str:
    what = []
    if before.get("size") != now["size"]:
        what.append(f"size {before.get('size', 0):,} -> {now['size']:,} bytes")
    if before.get("mtime_ns") != now["mtime_ns"]:
        what.append("modified time")
    if before.get("sample_sha256") != now["sample_sha256"]:
        what.append("content")
    return ", ".join(what)


def changed_file(recorded: list[dict[str, Any]], files: list[dict[str, Any]]) -> str | None:
    """How the first file read differs from its record: ``PATH, which changed since it was
    read (size A -> B bytes, modified time, content)``; None when every file matches."""
    old = {r.get("path"): r for r in recorded if isinstance(r, dict)}
    for record in files:
        before = old.pop(record["path"], None)
        if before is None:
            return f"{record['path']}, which it did not read (added since)"
        what = what_changed(before, record)
        if what:
            return f"{record['path']}, which changed since it was read ({what})"
    if old:
        return f"{next(iter(old))}, which is no longer read (removed since)"
    return None


def check_unchanged(fingerprint: dict[str, Any]) -> None:
    """Raise :class:`PrepareError` when a file read changed while the run read it."""
    for record in fingerprint["files"]:
        path = Path(record["path"])
        try:
            now = file_record(path)
        except FileNotFoundError:
            raise PrepareError(f"{path} was removed while it was being prepared; restore it "
                               "and rerun with --overwrite") from None
        what = what_changed(record, now)
        if what:
            raise PrepareError(f"{path} changed while it was being prepared ({what}): the "
                               "dataset would mix two versions of it; rerun with --overwrite "
                               "once it no longer changes")


def check_recorded(recorded: dict[str, Any], fingerprint: dict[str, Any], output: Path,
                   finished: bool) -> None:
    """Raise :class:`PrepareError` unless the files ``recorded`` by a finished dataset (or
    an unfinished run, ``finished`` False) in ``output`` are the files on disk now."""
    if finished:
        what, harm, way = ("was prepared by an earlier mt-data", "whether they changed since "
                           "cannot be checked", "pass --overwrite to prepare it again")
    else:
        what, harm, way = ("holds an unfinished run of an earlier mt-data", "whether they "
                           "changed since cannot be checked, and resuming could mix chunks of "
                           "another input into the dataset", "pass --overwrite to start again")
    if not isinstance(recorded.get("files"), list):
        raise PrepareError(f"{output} {what}, which recorded no size, modified time or "
                           f"content of its inputs: {harm}; {way}, or choose another --output")
    change = changed_file(recorded["files"], fingerprint["files"])
    if change and finished:
        raise PrepareError(f"{output} was prepared from {change}: serving it would be stale; "
                           f"{way}, or choose another --output")
    if change:
        raise PrepareError(f"{output} holds an unfinished run of {change}: resuming would mix "
                           f"what it read before into the new dataset; {way}, or choose "
                           "another --output")
