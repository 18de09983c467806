"""Streaming safetensors files with per-tensor SHA-256 checksums.

The writer is our own (the format is an 8-byte little-endian header length, a JSON header,
then the raw tensor bytes) because ``safetensors.torch.save_file`` needs every tensor in
memory at once. Here the header is computed from the shapes up front and each tensor is
written at its offset as soon as it is produced, so peak memory is one tensor. The
checksums go into the header's ``__metadata__`` under ``mt.sha256``: the header is first
written with placeholder digests of the same length and rewritten when the file is
complete, so the header size never changes.

Reading uses ``safetensors.safe_open`` (memory-mapped, nothing unpickled); every failure is
turned into a :class:`~mt_convert.errors.ConvertError` naming the file and the tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from mt_convert.errors import ConvertError

__all__ = [
    "CHECKSUM_KEY",
    "SafetensorsReader",
    "SafetensorsWriter",
    "TensorSpec",
    "check_names",
    "dtype_from_name",
    "dtype_name",
    "tensor_sha256",
]

CHECKSUM_KEY = "mt.sha256"
"""``__metadata__`` key holding a JSON object ``{tensor name: sha256 hex of its bytes}``."""

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_NAMES: dict[str, torch.dtype] = {name: dtype for dtype, name in _DTYPES.items()}
_PLACEHOLDER = "0" * 64


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors name of a torch dtype (``torch.float32`` -> ``"F32"``)."""
    if dtype not in _DTYPES:
        raise ConvertError(f"dtype {dtype} cannot be stored in a safetensors file")
    return _DTYPES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    """torch dtype of a safetensors dtype name (``"BF16"`` -> ``torch.bfloat16``)."""
    if name not in _NAMES:
        raise ConvertError(f"unsupported safetensors dtype {name!r}; known: {sorted(_NAMES)}")
    return _NAMES[name]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor (without its values)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorSpec:
        """The spec of an existing tensor."""
        return TensorSpec(tuple(tensor.shape), tensor.dtype)

    def describe(self) -> str:
        """``"[768, 2304] F32"``, for messages and dry runs."""
        return f"[{', '.join(map(str, self.shape))}] {dtype_name(self.dtype)}"


def _raw_bytes(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as a contiguous buffer (numpy uint8 view, no copy if possible)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 hex digest of the tensor's raw (little-endian, row-major) bytes."""
    return hashlib.sha256(_raw_bytes(tensor)).hexdigest()


def _layout(entries: Mapping[str, TensorSpec]) -> list[str]:
    # Larger items first so every tensor starts at an offset aligned to its item size
    # (safetensors forbids gaps between tensors, so alignment must come from the order).
    return sorted(entries, key=lambda key: -entries[key].dtype.itemsize)


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor, in any order.

    ``entries`` fixes every tensor's name, shape and dtype before the first byte is written.
    :meth:`write` checks each tensor against its entry and stores it at its offset;
    :meth:`close` fails unless every entry was written, then stores the checksums and
    fsyncs. Use as a context manager; on an exception the file is left incomplete (the
    caller's atomic directory discards it).
    """

    def __init__(self, path: Path, entries: Mapping[str, TensorSpec],
                 metadata: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        self.entries = dict(entries)
        self._metadata = {"format": "pt", **(metadata or {})}
        self._offsets: dict[str, tuple[int, int]] = {}
        position = 0
        for key in _layout(self.entries):
            self._offsets[key] = (position, position + self.entries[key].nbytes)
            position += self.entries[key].nbytes
        self._checksums: dict[str, str] = {}
        header = self._header({key: _PLACEHOLDER for key in self.entries})
        self._data_start = 8 + len(header)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()/__exit__
        self._file.write(struct.pack("<Q", len(header)) + header)
        self._file.truncate(self._data_start + position)

    def _header(self, checksums: Mapping[str, str]) -> bytes:
        metadata = {**self._metadata, CHECKSUM_KEY: json.dumps(dict(sorted(checksums.items())))}
        header: dict[str, Any] = {"__metadata__": metadata}
        for key, (begin, end) in self._offsets.items():
            spec = self.entries[key]
            header[key] = {"dtype": dtype_name(spec.dtype), "shape": list(spec.shape),
                           "data_offsets": [begin, end]}
        raw = json.dumps(header, separators=(",", ":")).encode()
        return raw + b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned

    def write(self, key: str, tensor: torch.Tensor) -> str:
        """Store ``tensor`` as ``key``; returns its SHA-256."""
        if key not in self.entries:
            raise ConvertError(f"{self.path}: tensor {key!r} is not in the planned layout")
        if key in self._checksums:
            raise ConvertError(f"{self.path}: tensor {key!r} written twice")
        expected, actual = self.entries[key], TensorSpec.of(tensor)
        if expected != actual:
            raise ConvertError(f"{self.path}: tensor {key!r} is {actual.describe()}, "
                               f"the layout expects {expected.describe()}")
        data = _raw_bytes(tensor)
        self._file.seek(self._data_start + self._offsets[key][0])
        self._file.write(data)
        self._checksums[key] = hashlib.sha256(data).hexdigest()
        return self._checksums[key]

    def close(self) -> dict[str, str]:
        """Finish the file (checksums into the header, fsync); returns the checksums."""
        missing = sorted(set(self.entries) - set(self._checksums))
        if missing:
            self._file.close()
            raise ConvertError(f"{self.path}: tensors never written: {missing}")
        header = self._header(self._checksums)
        if 8 + len(header) != self._data_start:  # cannot happen: digests have fixed length
            raise AssertionError("safetensors header changed size")
        self._file.seek(8)
        self._file.write(header)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return dict(self._checksums)

    def abort(self) -> None:
        """Close the file without finishing it (after a failure)."""
        self._file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class SafetensorsReader:
    """Read tensors from one safetensors file, verifying checksums.

    Expected digests come from ``expected_sha256`` (e.g. a manifest) and from the file's
    own ``mt.sha256`` metadata when present; every available digest is checked.
    """

    def __init__(self, path: Path, expected_sha256: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ConvertError(f"{self.path}: file not found")
        try:
            self._handle = safe_open(str(self.path), framework="pt", device="cpu")
            self._file = self._handle.__enter__()
            self.metadata: dict[str, str] = dict(self._file.metadata() or {})
            self._keys = list(self._file.keys())
        except ConvertError:
            raise
        except Exception as err:  # safetensors raises its own untyped error
            raise ConvertError(f"{self.path}: not a readable safetensors file "
                               f"(malformed or truncated): {err}") from None
        try:
            self._embedded = self._embedded_checksums()
        except ConvertError:
            self.close()
            raise
        self._expected = dict(expected_sha256 or {})

    def _embedded_checksums(self) -> dict[str, str]:
        raw = self.metadata.get(CHECKSUM_KEY)
        if raw is None:
            return {}
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ConvertError(f"{self.path}: malformed {CHECKSUM_KEY} metadata: {err}") from None
        if not isinstance(value, dict):
            raise ConvertError(f"{self.path}: {CHECKSUM_KEY} metadata is not an object")
        return {str(k): str(v) for k, v in value.items()}

    def keys(self) -> list[str]:
        """Tensor names in the file."""
        return list(self._keys)

    def spec(self, key: str) -> TensorSpec:
        """Shape and dtype of ``key`` from the header (no data read)."""
        self._check_key(key)
        view = self._file.get_slice(key)
        return TensorSpec(tuple(view.get_shape()), dtype_from_name(view.get_dtype()))

    def has_checksum(self, key: str) -> bool:
        """Whether a digest is known for ``key``."""
        return key in self._embedded or key in self._expected

    def get(self, key: str) -> torch.Tensor:
        """Load ``key`` (a fresh CPU tensor) and verify its checksums."""
        self._check_key(key)
        try:
            tensor = self._file.get_tensor(key)
        except Exception as err:
            raise ConvertError(f"{self.path}: cannot read tensor {key!r}: {err}") from None
        digest = tensor_sha256(tensor)
        for source, table in (("file metadata", self._embedded), ("manifest", self._expected)):
            if key in table and table[key] != digest:
                raise ConvertError(
                    f"{self.path}: checksum mismatch for tensor {key!r} ({source} says "
                    f"{table[key][:16]}..., data hashes to {digest[:16]}...): the file is "
                    "corrupted")
        return tensor

    def _check_key(self, key: str) -> None:
        if key not in self._keys:
            raise ConvertError(f"{self.path}: tensor {key!r} is missing")

    def close(self) -> None:
        """Release the memory map."""
        self._handle.__exit__(None, None, None)


def check_names(path: Path, found: Sequence[str], expected: Sequence[str]) -> None:
    """Raise a ConvertError listing missing and unexpected tensor names of ``path``."""
    present = set(found)
    missing = [name for name in expected if name not in present]
    unexpected = sorted(set(found) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    if problems:
        raise ConvertError(f"{path}: " + "; ".join(problems))
