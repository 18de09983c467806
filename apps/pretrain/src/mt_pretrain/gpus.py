"""Accelerator descriptions for ``mt plan``: a small built-in table or a custom YAML file.

Figures are vendor data sheet numbers for dense bf16 matmuls (no sparsity), HBM capacity,
NVLink bandwidth per GPU and direction, and the InfiniBand bandwidth one GPU gets across nodes
(one HDR 200 Gb/s NIC per A100 in a DGX A100 / Selene node, one NDR 400 Gb/s per H100/H200).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["GPUS", "GPUSpec", "GPUSpecError", "load_gpu"]


class GPUSpecError(ValueError):
    """A GPU name or description that cannot be used; the message names the values."""


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator type and the node it sits in.

    Attributes:
        name: label printed in reports.
        peak_flops: peak dense bf16 FLOP/s of one GPU.
        memory_bytes: usable device memory of one GPU, in bytes.
        nvlink_bytes_per_s: intra-node bandwidth per GPU and direction, bytes/s.
        ib_bytes_per_s: inter-node bandwidth per GPU and direction, bytes/s.
        gpus_per_node: GPUs sharing one NVLink domain.
        memory_bytes_per_s: device memory bandwidth (elementwise ops, optimizer step).
    """

    name: str
    peak_flops: float
    memory_bytes: float
    nvlink_bytes_per_s: float
    ib_bytes_per_s: float
    gpus_per_node: int = 8
    memory_bytes_per_s: float = 2.0e12

    def __post_init__(self) -> None:
        bad = [f"{f.name} {getattr(self, f.name)!r}" for f in fields(self)
               if f.name != "name" and not getattr(self, f.name) > 0]
        if bad:
            raise GPUSpecError(f"GPU {self.name!r}: these must be positive: {', '.join(bad)}")


_GiB = 2.0**30

#: The built-in GPU table (8 GPUs a node).
GPUS: dict[str, GPUSpec] = {
    "a100-40gb": GPUSpec("a100-40gb", 312e12, 40 * _GiB, 300e9, 25e9, 8, 1.555e12),
    "a100-80gb": GPUSpec("a100-80gb", 312e12, 80 * _GiB, 300e9, 25e9, 8, 2.039e12),
    "h100-80gb": GPUSpec("h100-80gb", 989e12, 80 * _GiB, 450e9, 50e9, 8, 3.35e12),
    "h200": GPUSpec("h200", 989e12, 141e9, 450e9, 50e9, 8, 4.8e12),
}

# YAML keys (human units) -> GPUSpec field and scale.
_YAML_KEYS: dict[str, tuple[str, float]] = {
    "peak_tflops": ("peak_flops", 1e12),
    "memory_gb": ("memory_bytes", 1e9),
    "nvlink_gb_per_s": ("nvlink_bytes_per_s", 1e9),
    "ib_gb_per_s": ("ib_bytes_per_s", 1e9),
    "gpus_per_node": ("gpus_per_node", 1.0),
    "memory_bandwidth_gb_per_s": ("memory_bytes_per_s", 1e9),
}


def _from_mapping(data: Any, source: str) -> GPUSpec:
    if not isinstance(data, dict):
        raise GPUSpecError(f"{source}: expected a mapping of {sorted(_YAML_KEYS)}, "
                           f"got {type(data).__name__}")
    unknown = sorted(set(data) - set(_YAML_KEYS) - {"name"})
    missing = sorted(set(_YAML_KEYS) - {"gpus_per_node", "memory_bandwidth_gb_per_s"}
                     - set(data))
    if unknown or missing:
        raise GPUSpecError(f"{source}: unknown keys {unknown}, missing keys {missing}")
    kwargs: dict[str, Any] = {"name": str(data.get("name", Path(source).stem))}
    for key, (field, scale) in _YAML_KEYS.items():
        if key in data:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise GPUSpecError(f"{source}: {key} must be a number, got {value!r}")
            kwargs[field] = int(value) if field == "gpus_per_node" else float(value) * scale
    return GPUSpec(**kwargs)


def load_gpu(name_or_path: str) -> GPUSpec:
    """A built-in GPU by name, or a YAML file with keys ``peak_tflops``, ``memory_gb``,
    ``nvlink_gb_per_s``, ``ib_gb_per_s`` and optionally ``gpus_per_node``,
    ``memory_bandwidth_gb_per_s`` and ``name``."""
    key = name_or_path.lower()
    if key in GPUS:
        return GPUS[key]
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise GPUSpecError(f"GPU description file {path} not found")
        import yaml

        return _from_mapping(yaml.safe_load(path.read_text(encoding="utf-8")), str(path))
    raise GPUSpecError(f"unknown GPU type {name_or_path!r}; use one of {sorted(GPUS)} "
                       "or a .yaml file")
