"""Tensors without their values, and checksums of tensor bytes: what every checkpoint format
shares (safetensors, torch.save and DeepSpeed files alike).

:class:`TensorSpec` is a shape and a dtype; ``dtype_name`` / ``dtype_from_name`` map torch
dtypes to safetensors' names (also used in manifests and dry runs); ``tensor_checksum``
hashes a tensor's raw bytes as writers record them (:func:`mt_formats.crc.digest`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mt_formats.crc import CHECKSUM_ALGORITHM, digest
from mt_formats.errors import ConvertError

__all__ = [
    "TensorSpec",
    "check_names",
    "dtype_from_name",
    "dtype_name",
    "raw_bytes",
    "tensor_checksum",
    "tensor_sha256",
]

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


def raw_bytes(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as a contiguous buffer (numpy uint8 view, no copy if possible)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 hex digest of the tensor's raw (little-endian, row-major) bytes."""
    return hashlib.sha256(raw_bytes(tensor)).hexdigest()


def tensor_checksum(tensor: torch.Tensor, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """Checksum string (:func:`digest`) of the tensor's raw bytes, as writers record it."""
    return digest(raw_bytes(tensor), algorithm)


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
