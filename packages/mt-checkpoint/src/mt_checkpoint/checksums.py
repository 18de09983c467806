"""Checksums of everything a training checkpoint holds, checked when it is read.

Every rank file's size and CRC-32C (computed while it is written, hardware-accelerated by the
``crc32c`` package) is recorded beside it in a hidden sidecar, which the publish step folds
into ``meta.json`` (``files``); ``meta.json`` carries the CRC-32C of its own content. A
reader verifies a rank file against ``meta.json`` before unpickling anything, so flipped
bytes are one line naming the file, never silently loaded numbers.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import crc32c

from mt_checkpoint.names import CheckpointError

__all__ = ["ChecksumWriter", "collect_sums", "crc_text", "file_sum", "json_crc", "verify_file"]

_CHUNK = 1 << 24


def crc_text(crc: int) -> str:
    """The stored form of a CRC-32C: ``"crc32c:1a2b3c4d"``."""
    return f"crc32c:{crc:08x}"


class ChecksumWriter:
    """A binary file wrapper that checksums what passes through ``write``."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.crc, self.size = raw, 0, 0
        self.error: OSError | None = None
        """The first failed write (torch's writer reports it only as a position mismatch)."""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = crc32c.crc32c(view, self.crc)
        self.size += len(view)
        try:
            return self.raw.write(view)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.raw.flush()

    def record(self, path: Path) -> None:
        """Store the size and checksum of ``path`` (just written through this wrapper) in
        its sidecar, for :func:`collect_sums`."""
        side = _sidecar(path)
        tmp = side.with_name(side.name + ".tmp")  # whole or absent: a writer waits for it
        tmp.write_text(json.dumps({"bytes": self.size, "crc32c": crc_text(self.crc)}),
                       encoding="utf-8")
        tmp.replace(side)


def json_crc(body: dict[str, Any]) -> str:
    """The checksum of a JSON object's canonical text (sorted keys, no spaces): stored inside
    the object itself, it survives re-indentation but not a changed value."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return crc_text(crc32c.crc32c(canonical.encode("utf-8")))


def _sidecar(path: Path) -> Path:
    return path.with_name(f".{path.name}.sum")


def not_recorded(folder: Path, names: list[str]) -> list[str]:
    """Those of ``names`` in ``folder`` whose checksum is not recorded yet (still being
    written)."""
    return [name for name in names if not _sidecar(folder / name).is_file()]


def collect_sums(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """The recorded size and checksum of each of ``names`` in ``folder`` (their sidecars are
    removed); a file written without one is an error naming it."""
    sums = {}
    for name in names:
        side = _sidecar(folder / name)
        try:
            sums[name] = json.loads(side.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{folder / name}: no checksum recorded ({err})") from None
    for name in names:
        _sidecar(folder / name).unlink()
    return sums


def file_sum(path: Path) -> tuple[int, str]:
    """(bytes, checksum) of the file at ``path``, read in 16 MiB pieces."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = crc32c.crc32c(chunk, crc)
            size += len(chunk)
    return size, crc_text(crc)


def verify_file(path: Path, sums: dict[str, dict[str, Any]], source: str = "meta.json"
                ) -> None:
    """Check ``path`` against its entry in a ``meta.json``'s ``files`` (``sums``; ``source``
    names where they were read). A checkpoint written before checksums (no ``files``) is
    read with a warning; a file the checksums do not list, of another size or checksum is a
    :class:`CheckpointError`."""
    if not sums:
        warnings.warn(f"{path.parent}: written before checkpoints carried checksums; its "
                      "files are not verified", stacklevel=3)
        return
    entry = sums.get(path.name)
    if entry is None:
        raise CheckpointError(f"{path}: not listed in {path.parent.name}/{source}'s checksums")
    size, crc = file_sum(path)
    if size == 0:
        why = "empty"
    elif size != entry.get("bytes"):
        why = f"damaged or truncated ({size:,} bytes: {source} recorded {entry.get('bytes')})"
    elif crc != entry.get("crc32c"):
        why = (f"damaged (its checksum is {crc}, {source} recorded {entry.get('crc32c')}: "
               "bytes changed on disk)")
    else:
        return
    raise CheckpointError(f"{path}: {why}; load an earlier step folder of "
                          f"{path.parent.parent} instead")
