"""``config.json`` of mt's own checkpoint formats: model config + layout + checksums.

Shape of the file (``format_version`` 1)::

    {
      "format": "mt-consolidated" | "mt-sharded",
      "format_version": 1,
      "writer": "mt-convert 0.1.0",
      "model": {GPTConfig.to_dict()},
      "layout": {...format specific, e.g. {"tp": 2, "pp": 1, "pad_multiple": 128}},
      "files": {"model.safetensors": {"<tensor>": {"dtype": "F32", "shape": [..],
                                                    "sha256": "<hex>"}}}
    }

Each safetensors file also carries its own digests in its header metadata, so a file
copied out of its directory can still be verified.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mt_convert.errors import ConvertError
from mt_convert.safetensors_io import (
    SafetensorsReader,
    TensorSpec,
    check_names,
    dtype_from_name,
    dtype_name,
)
from mt_model import GPTConfig

__all__ = [
    "CONFIG_FILE",
    "FORMAT_VERSION",
    "FileEntries",
    "Manifest",
    "open_checked",
    "read_manifest",
    "write_manifest",
]

CONFIG_FILE = "config.json"
FORMAT_VERSION = 1
WRITER = "mt-convert 0.1.0"

FileEntries = dict[str, tuple[TensorSpec, str]]
"""Tensor name -> (spec, sha256) for one file."""


class Manifest:
    """A parsed, validated ``config.json`` of an mt checkpoint."""

    def __init__(self, path: Path, format: str, config: GPTConfig, layout: dict[str, Any],
                 files: dict[str, FileEntries]) -> None:
        self.path = path
        self.format = format
        self.config = config
        self.layout = layout
        self.files = files

    def checksums(self, file: str) -> dict[str, str]:
        """Tensor name -> expected sha256 for ``file``."""
        return {name: sha for name, (_, sha) in self.files[file].items()}


def write_manifest(directory: Path, format: str, config: GPTConfig, layout: Mapping[str, Any],
                   files: Mapping[str, FileEntries]) -> Path:
    """Write ``directory/config.json`` (fsynced) and return its path."""
    body = {
        "format": format,
        "format_version": FORMAT_VERSION,
        "writer": WRITER,
        "model": config.to_dict(),
        "layout": dict(layout),
        "files": {
            file: {name: {"dtype": dtype_name(spec.dtype), "shape": list(spec.shape),
                          "sha256": sha} for name, (spec, sha) in entries.items()}
            for file, entries in files.items()
        },
    }
    path = Path(directory) / CONFIG_FILE
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(_format(body))
        handle.flush()
        os.fsync(handle.fileno())
    return path


def _format(body: dict[str, Any]) -> str:
    """Indented JSON with one line per tensor entry (readable and diffable even for the
    thousands of tensors of a large model)."""
    head = json.dumps({k: v for k, v in body.items() if k != "files"}, indent=2)
    blocks = []
    for file, entries in body["files"].items():
        lines = [f"      {json.dumps(name)}: {json.dumps(entry)}"
                 for name, entry in entries.items()]
        blocks.append(f"    {json.dumps(file)}: {{\n" + ",\n".join(lines) + "\n    }")
    return head[:-2] + ',\n  "files": {\n' + ",\n".join(blocks) + "\n  }\n}\n"


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file, with errors naming the file."""
    if not path.is_file():
        raise ConvertError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConvertError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _entry(path: Path, file: str, name: str, raw: Any) -> tuple[TensorSpec, str]:
    try:
        shape = tuple(int(size) for size in raw["shape"])
        spec = TensorSpec(shape, dtype_from_name(str(raw["dtype"])))
        sha = str(raw["sha256"])
    except ConvertError as err:
        raise ConvertError(f"{path}: files.{file}.{name}: {err}") from None
    except (KeyError, TypeError, ValueError) as err:
        raise ConvertError(f"{path}: files.{file}.{name} is malformed (needs dtype, shape, "
                           f"sha256): {err!r}") from None
    if len(sha) != 64:
        raise ConvertError(f"{path}: files.{file}.{name}.sha256 is not a sha256 hex digest")
    return spec, sha


def read_manifest(directory: Path, expected_format: str) -> Manifest:
    """Read and validate ``directory/config.json`` of an ``expected_format`` checkpoint."""
    path = Path(directory) / CONFIG_FILE
    data = read_json(path)
    if data.get("format") != expected_format:
        raise ConvertError(f"{path}: format is {data.get('format')!r}, expected "
                           f"{expected_format!r}")
    if data.get("format_version") != FORMAT_VERSION:
        raise ConvertError(f"{path}: format_version {data.get('format_version')!r} is not "
                           f"supported (this mt-convert reads version {FORMAT_VERSION})")
    try:
        config = GPTConfig.from_dict(data["model"])
    except KeyError:
        raise ConvertError(f"{path}: no 'model' section") from None
    except (TypeError, ValueError) as err:
        raise ConvertError(f"{path}: invalid model config: {err}") from None
    layout, files = data.get("layout", {}), data.get("files")
    if not isinstance(layout, dict) or not isinstance(files, dict):
        raise ConvertError(f"{path}: 'layout' and 'files' must be JSON objects")
    parsed: dict[str, FileEntries] = {}
    for file, entries in files.items():
        if not isinstance(entries, dict):
            raise ConvertError(f"{path}: files.{file} must be a JSON object")
        parsed[file] = {name: _entry(path, file, name, raw) for name, raw in entries.items()}
    return Manifest(path, expected_format, config, layout, parsed)


def open_checked(root: Path, manifest: Manifest, file: str,
                 expected: Mapping[str, tuple[int, ...]]) -> SafetensorsReader:
    """Open ``root/file`` and check it against the manifest and the expected shapes.

    Names are compared three ways (expected model, manifest, file header), then each
    tensor's header shape and dtype against the manifest; no tensor data is read.
    """
    if file not in manifest.files:
        raise ConvertError(f"{manifest.path}: no entry for file {file!r}")
    entries = manifest.files[file]
    check_names(manifest.path, list(entries), list(expected))
    reader = SafetensorsReader(Path(root) / file, manifest.checksums(file))
    try:
        check_names(reader.path, reader.keys(), list(expected))
        for name, shape in expected.items():
            spec = reader.spec(name)
            if spec != entries[name][0] or spec.shape != tuple(shape):
                raise ConvertError(
                    f"{reader.path}: tensor {name!r} is {spec.describe()}, the manifest says "
                    f"{entries[name][0].describe()} and the model config needs "
                    f"{list(shape)}")
    except BaseException:
        reader.close()
        raise
    return reader
