"""Checksums of a checkpoint folder whose files another library wrote (DeepSpeed's engine):
a manifest, ``mt-checksums.json``, listing every file's size and CRC-32C, with the manifest's
own CRC-32C inside it; checked before the folder is loaded.

The work is shared out: with ``rank`` and ``world`` each process checksums or verifies every
``world``-th file of the sorted list, so a folder of many shards is read once in all, in
parallel, rather than once per rank.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from mt_checkpoint.checksums import file_sum, json_crc, verify_file
from mt_checkpoint.format import write_synced
from mt_checkpoint.names import MANIFEST, CheckpointError

__all__ = ["folder_files", "read_manifest", "sum_files", "verify_files", "write_manifest"]


def folder_files(folder: Path) -> list[str]:
    """The files of ``folder`` a manifest lists: every visible file below it (as paths
    relative to it), the manifest itself excepted, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.startswith("."))


def sum_files(folder: Path, names: list[str], rank: int = 0, world: int = 1
              ) -> dict[str, dict[str, Any]]:
    """Size and checksum of this process's share of ``names`` (every ``world``-th)."""
    sums = {}
    for name in names[rank::world]:
        size, crc = file_sum(folder / name)
        sums[name] = {"bytes": size, "crc32c": crc}
    return sums


def write_manifest(folder: Path, sums: dict[str, dict[str, Any]]) -> None:
    """Write ``folder``'s manifest (atomically, durably) from every file's sums."""
    body = {"files": dict(sorted(sums.items()))}
    write_synced(folder / MANIFEST, json.dumps({**body, "crc32c": json_crc(body)}, indent=1))


def read_manifest(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The sums of ``folder``'s manifest; None (with a warning) for a folder written before
    manifests; a damaged manifest is a :class:`CheckpointError` naming it."""
    path = folder / MANIFEST
    if not path.is_file():
        warnings.warn(f"{folder}: written without mt's checksums ({MANIFEST}); its files are "
                      "not verified", stacklevel=2)
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        body = {"files": data["files"]}
        ok = data.get("crc32c") == json_crc(body)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: damaged (not the checksummed JSON mt wrote); load an "
                              f"earlier step folder of {folder.parent} instead")
    return dict(data["files"])


def verify_files(folder: Path, sums: dict[str, dict[str, Any]], rank: int = 0,
                 world: int = 1) -> str | None:
    """Check this process's share of the files ``sums`` lists; the first problem as one line
    (a file missing, truncated or changed), or None."""
    for name in sorted(sums)[rank::world]:
        path = folder / name
        if not path.is_file():
            return f"{path}: missing (the checksums of {folder.name} list it)"
        try:
            verify_file(path, {path.name: sums[name]}, MANIFEST)
        except CheckpointError as err:
            return str(err)
    return None
