"""The names and plain files of torch DCP and Megatron-core ``torch_dist`` folders, without
``torch.distributed.checkpoint`` (whose import takes about a second): detecting a folder's
format, and ``mt.json``, the sidecar mt writes beside formats that carry no config or
checksums of their own (DCP, Megatron-core, GGUF). :mod:`mt_formats.dcp` and
:mod:`mt_formats.mcore` read and write the folders themselves."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mt_formats.crc import CHECKSUM_ALGORITHM, algorithm_of, digest
from mt_formats.errors import ConvertError
from mt_formats.manifest import read_json

__all__ = ["DCP_FORMAT", "MCORE_FORMAT", "METADATA_FILE", "METADATA_JSON", "SIDECAR",
           "check_files", "is_dcp_checkpoint", "is_mcore_checkpoint", "read_sidecar",
           "write_sidecar"]

DCP_FORMAT = "dcp"
MCORE_FORMAT = "mcore"
METADATA_FILE = ".metadata"
METADATA_JSON = "metadata.json"  # Megatron-core's: names its backend
SIDECAR = "mt.json"
SIDECAR_FORMAT = "mt-sidecar"  # mt.json beside files of formats without checksums


def is_dcp_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a DCP ``.metadata`` file."""
    return (Path(path) / METADATA_FILE).is_file()


def is_mcore_checkpoint(path: Path) -> bool:
    """A DCP folder whose ``metadata.json`` names the ``torch_dist`` backend."""
    path = Path(path)
    if not ((path / METADATA_JSON).is_file() and (path / METADATA_FILE).is_file()):
        return False
    try:
        return json.loads((path / METADATA_JSON).read_text("utf-8")).get(
            "sharded_backend") == "torch_dist"
    except (ValueError, AttributeError, UnicodeDecodeError):
        return False


#: The key of ``mt.json``'s own checksum (of the rest of it, :func:`_own_checksum`).
_OWN = "checksum"


def _own_checksum(body: dict[str, Any], algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """The checksum of ``body`` but its own checksum, as canonical JSON (keys sorted)."""
    rest = {key: value for key, value in body.items() if key != _OWN}
    return digest(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode(), algorithm)


def read_sidecar(root: Path) -> dict[str, Any] | None:
    """``mt.json`` of a folder mt wrote, checked against its own checksum (where it records
    one: the model config it holds is bound to the weights beside it), or None."""
    path = root / SIDECAR
    if not path.is_file():
        return None
    data = read_json(path)
    if data.get("format") != SIDECAR_FORMAT or data.get("format_version") != 1:
        raise ConvertError(f"{path}: format {data.get('format')!r} version "
                           f"{data.get('format_version')!r}; this mt reads "
                           f"{SIDECAR_FORMAT!r} version 1")
    if _OWN in data:  # absent in sidecars written before mt.json carried one
        recorded = data[_OWN]
        try:
            found = _own_checksum(data, algorithm_of(str(recorded)))
        except ConvertError as err:
            raise ConvertError(f"{path}: {_OWN}: {err}") from None
        if found != recorded:
            raise ConvertError(f"{path}: edited or damaged since mt wrote it (its contents "
                               f"give {found}, it records {recorded}): the model config it "
                               "holds describes the weights beside it; restore the file or "
                               "convert again")
    return data


def write_sidecar(directory: Path, body: dict[str, Any], files: tuple[str, ...] = ()) -> None:
    """``mt.json`` (durable: fsynced) beside a DCP folder's files; ``files``: small files
    already written beside it (``.metadata``, ``common.pt``), whose checksums it records
    under ``files`` (checked on reading by :func:`check_files`)."""
    sums = {name: digest((directory / name).read_bytes()) for name in files}
    sidecar = {"format": SIDECAR_FORMAT, "format_version": 1, **body,
               **({"files": sums} if sums else {})}
    with open(directory / SIDECAR, "w", encoding="utf-8") as file:
        file.write(json.dumps({**sidecar, _OWN: _own_checksum(sidecar)}, indent=1) + "\n")
        file.flush()
        os.fsync(file.fileno())


def check_files(root: Path, sidecar: dict[str, Any]) -> None:
    """The files ``mt.json`` records checksums of (:func:`write_sidecar`), read and checked:
    one missing, changed, or named outside the folder is refused in one line naming it."""
    files = sidecar.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ConvertError(f"{root / SIDECAR}: 'files' must map file names to checksums")
    for name, expected in files.items():
        path = root / name
        if Path(name).name != name or name in (".", ".."):
            raise ConvertError(f"{root / SIDECAR}: 'files' names {name!r}, not a file of "
                               f"{root}")
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ConvertError(f"{path}: cannot be read ({err.strerror}); {SIDECAR} records "
                               "its checksum") from None
        if digest(data, algorithm_of(expected)) != expected:
            raise ConvertError(f"{path}: checksum mismatch (recorded {expected} in "
                               f"{SIDECAR}): the file is corrupted")
