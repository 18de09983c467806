"""The output folder of `mt data prepare`: only a new, empty or its own folder
(:data:`PREPARE_OUTPUT`) is written into or emptied, with or without --overwrite; an unfinished
run in it resumes only when its inputs and settings are the same and unchanged; one run at a
time holds it."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mt_data.errors import PrepareError
from mt_data.fingerprint import check_recorded, same_run
from mt_data.group_counts import GROUPS_FILE
from mt_data.paths import foreign_entries, foreign_message
from mt_data.shards import (
    FORMAT,
    INDEX_FILE,
    PROGRESS_FILE,
    VERIFIED_FILE,
    atomic_write_json,
)

__all__ = ["PREPARE_OUTPUT", "check_output", "is_dataset_index", "output_lock",
           "refuse_foreign"]


PREPARE_OUTPUT = (INDEX_FILE, PROGRESS_FILE, GROUPS_FILE, "dropped.json", "shard-*.arrow",
                  ".*.tmp", "work/", "cache/")
"""The names ``prepare`` writes in its output folder (shards, index, records, the work
folder, readers' caches, temporary files): a folder holding anything else is not its own."""

DATASET_CACHE = ("gpt-*.npz", "max-token-id.json", VERIFIED_FILE, ".*.tmp", ".*.tmp.npz")
"""The names a dataset's readers write in its ``cache/`` folder (sample indexes, the largest
token id, verified checksums, their temporary files): a ``cache/`` holding anything else is
not a dataset's."""


def is_dataset_index(path: Path) -> bool:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(index, dict) and (index.get("format") == FORMAT or "shards" in index)


def refuse_foreign(output: Path) -> None:
    """``output`` must be absent, empty or a folder ``prepare`` wrote (with or without
    --overwrite: a plain run writes into it and deletes its ``work/`` at the end)."""
    foreign = foreign_entries(output, PREPARE_OUTPUT)
    if (output / INDEX_FILE).is_file() and not is_dataset_index(output / INDEX_FILE):
        foreign.append(INDEX_FILE)
    work = output / "work"
    if work.is_dir() and not work.is_symlink() and any(work.iterdir()) and \
            not (work / "config.json").is_file():
        foreign.append("work/")  # not a work folder of prepare's (it writes config.json first)
    cache = output / "cache"
    if cache.is_dir() and not cache.is_symlink() and foreign_entries(cache, DATASET_CACHE):
        foreign.append("cache/")  # not the cache of a dataset's readers
    if foreign:
        raise PrepareError(foreign_message("--output", output, sorted(foreign),
                                           "mt data prepare"))


def check_output(output: Path, fingerprint: dict[str, Any], overwrite: bool) -> None:
    if overwrite:  # its contents: the folder itself (and its lock) stays
        for entry in output.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    work = output / "work"
    work.mkdir(parents=True, exist_ok=True)
    mark = work / "config.json"
    recorded = json.loads(json.dumps(fingerprint))  # tuples -> lists, as stored
    if mark.exists():
        try:
            earlier = json.loads(mark.read_text())
        except (ValueError, RecursionError):
            earlier = {}
        if not isinstance(earlier, dict) or not same_run(earlier, recorded):
            raise PrepareError(
                f"{output} holds an unfinished run with other inputs or settings; "
                f"rerun the same command to resume, or pass --overwrite"
            )
        check_recorded(earlier, recorded, output, finished=False)
    else:
        atomic_write_json(mark, recorded)


@contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """Hold an exclusive lock on the output folder itself while preparing into it: a second
    `prepare` into the same folder is refused at once. The kernel drops the lock when its
    holder ends, killed or not."""
    fd = os.open(output, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PrepareError(f"{output} is being prepared by another process: wait for it "
                               "to end, or choose another --output") from None
        yield
    finally:
        os.close(fd)
