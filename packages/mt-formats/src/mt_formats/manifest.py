"""``config.json`` of mt's own checkpoint formats: model config + layout + checksums.

Shape of the file (``format_version`` 3)::

    {
      "format": "mt-consolidated" | "mt-sharded",
      "format_version": 3,
      "writer": "mt-convert 0.1.0",
      "model": {GPTConfig.to_dict()},
      "layout": {...format specific, e.g. {"tp": 2, "pp": 1, "pad_multiple": 128}},
      "files": {"model.safetensors": {"<tensor>": {"dtype": "F32", "shape": [..],
                                                    "checksum": "crc32c:<8 hex>"}}}
    }

Older versions are still read and verified: version 2 entries carry ``"checksum":
"crc32:<8 hex>"`` (zlib's CRC-32), version 1 entries ``"sha256": "<64 hex>"``. Each version
accepts only its own checksum kind (:data:`CHECKSUM_KINDS`); anything else is refused with
a message naming the file, the entry and what that version supports.

Each safetensors file also carries its own digests in its header metadata, so a file
copied out of its directory can still be verified, and the model config it was written for
(``mt.model``): a ``model`` section edited afterwards (a vocabulary size the padded rows of a
sharded file would hide, a RoPE base no shape shows) is refused when the file is opened.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mt_formats.crc import algorithm_of
from mt_formats.errors import ConvertError
from mt_formats.safetensors_io import SafetensorsReader
from mt_formats.tensors import TensorSpec, check_names, dtype_from_name, dtype_name
from mt_model import GPTConfig

__all__ = [
    "CONFIG_FILE",
    "FORMAT_VERSION",
    "FileEntries",
    "MODEL_KEY",
    "Manifest",
    "model_metadata",
    "open_checked",
    "read_manifest",
    "write_manifest",
]

CONFIG_FILE = "config.json"
FORMAT_VERSION = 3
CHECKSUM_KINDS: Mapping[int, tuple[str, ...]] = types.MappingProxyType(
    {1: ("sha256",), 2: ("crc32",), 3: ("crc32c",)})
"""Checksum kinds (:func:`mt_formats.crc.algorithm_of`) each format version records."""
READABLE_VERSIONS = tuple(CHECKSUM_KINDS)
WRITER = "mt-convert 0.3.0"

MODEL_KEY = "mt.model"
"""Safetensors ``__metadata__`` key holding the JSON model config a file's weights are for."""

FileEntries = dict[str, tuple[TensorSpec, str]]
"""Tensor name -> (spec, checksum string of :func:`mt_formats.crc.digest`)."""


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
        """Tensor name -> expected checksum string for ``file``."""
        return {name: sha for name, (_, sha) in self.files[file].items()}


def write_manifest(directory: Path, format: str, config: GPTConfig, layout: Mapping[str, Any],
                   files: Mapping[str, FileEntries]) -> Path:
    """Write ``directory/config.json`` (fsynced) and return its path. Every checksum must
    be of the kind this version records (``crc32c``): a manifest never mixes kinds."""
    for file, entries in files.items():
        for name, (_, checksum) in entries.items():
            if algorithm_of(checksum) not in CHECKSUM_KINDS[FORMAT_VERSION]:
                raise ConvertError(f"{Path(directory) / CONFIG_FILE}: files.{file}.{name}: "
                                   f"cannot record {checksum!r} in format_version "
                                   f"{FORMAT_VERSION} (it records "
                                   f"{'/'.join(CHECKSUM_KINDS[FORMAT_VERSION])})")
    body = {
        "format": format,
        "format_version": FORMAT_VERSION,
        "writer": WRITER,
        "model": config.to_dict(),
        "layout": dict(layout),
        "files": {
            file: {name: {"dtype": dtype_name(spec.dtype), "shape": list(spec.shape),
                          "checksum": sha} for name, (spec, sha) in entries.items()}
            for file, entries in files.items()
        },
    }
    path = Path(directory) / CONFIG_FILE
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(_format(body))
        handle.flush()
        os.fsync(handle.fileno())
    return path


def model_metadata(config: GPTConfig) -> dict[str, str]:
    """The ``__metadata__`` entry recording the model config a safetensors file is for."""
    return {MODEL_KEY: json.dumps(config.to_dict(), sort_keys=True)}


#: Model fields the weights do not depend on (training settings, and the sequence length:
#: learned positions show it in their shape, RoPE does not fix it): editable.
_FREE_FIELDS = frozenset({"dropout", "attention_dropout", "init_std", "scaled_output_init",
                          "seq_len"})


def _check_model(manifest: Manifest, reader: SafetensorsReader) -> None:
    """The manifest's model section is the config ``reader``'s file was written for, in
    every field the weights' meaning depends on (files written before :data:`MODEL_KEY`
    existed carry none: nothing to compare)."""
    raw = reader.metadata.get(MODEL_KEY)
    if raw is None:
        return
    try:
        written = GPTConfig.from_dict(json.loads(raw)).to_dict()
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise ConvertError(f"{reader.path}: malformed {MODEL_KEY} metadata: {err}") from None
    given = manifest.config.to_dict()
    changed = [key for key in given
               if key not in _FREE_FIELDS and given[key] != written.get(key)]
    if changed:
        key = changed[0]
        raise ConvertError(
            f"{manifest.path}: model.{key} is {given[key]!r}, where {reader.path.name} was "
            f"written for {written.get(key)!r}" + (f" ({len(changed) - 1} more field(s) "
                                                   "differ)" if len(changed) > 1 else "")
            + ": the model section was edited after the weights were written; put back the "
            "values they were written for")


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


def _entry(path: Path, file: str, name: str, raw: Any, version: int
           ) -> tuple[TensorSpec, str]:
    key = "sha256" if version == 1 else "checksum"
    try:
        shape = tuple(int(size) for size in raw["shape"])
        spec = TensorSpec(shape, dtype_from_name(str(raw["dtype"])))
        sha = str(raw[key])
    except ConvertError as err:
        raise ConvertError(f"{path}: files.{file}.{name}: {err}") from None
    except (KeyError, TypeError, ValueError) as err:
        raise ConvertError(f"{path}: files.{file}.{name} is malformed (format_version "
                           f"{version} needs dtype, shape, {key}): {err!r}") from None
    try:
        algorithm = algorithm_of(sha)
    except ConvertError as err:
        raise ConvertError(f"{path}: files.{file}.{name}.{key}: {err}") from None
    if algorithm not in CHECKSUM_KINDS[version]:
        raise ConvertError(f"{path}: files.{file}.{name}.{key} is a {algorithm} checksum; "
                           f"format_version {version} records "
                           f"{' / '.join(CHECKSUM_KINDS[version])} (this mt-convert reads "
                           + ", ".join(f"{v}: {'/'.join(k)}" for v, k in CHECKSUM_KINDS.items())
                           + ")")
    return spec, sha


def read_manifest(directory: Path, expected_format: str) -> Manifest:
    """Read and validate ``directory/config.json`` of an ``expected_format`` checkpoint."""
    path = Path(directory) / CONFIG_FILE
    data = read_json(path)
    if data.get("format") != expected_format:
        raise ConvertError(f"{path}: format is {data.get('format')!r}, expected "
                           f"{expected_format!r}")
    version = data.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise ConvertError(f"{path}: format_version {version!r} is not supported (this "
                           f"mt-convert reads versions {list(READABLE_VERSIONS)}; a newer "
                           "mt-convert wrote it?)")
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
        parsed[file] = {name: _entry(path, file, name, raw, version)
                        for name, raw in entries.items()}
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
        _check_model(manifest, reader)
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
