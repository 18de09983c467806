"""mt-formats: GPT checkpoints across formats and layouts, the library under ``mt convert``
(and every reader of a checkpoint in mt: ``mt eval`` loads Hugging Face folders with it).

Formats: ``"consolidated"`` (one full ``model.safetensors`` + ``config.json`` manifest with
CRC-32 checksums), ``"tp"`` (``[pp_rank_XX_]tp_rank_YY/model.safetensors``, sliced exactly
as mt_tensor_parallel and mt_pipeline slice the model), ``"hf"`` (Hugging Face
``GPT2LMHeadModel`` or ``LlamaForCausalLM``), ``"megatron"`` (Megatron-LM style
``mp_rank_XX[_YYY]`` files), ``"dcp"`` (torch Distributed Checkpoint folders, torchtitan's
names) and ``"pretrain"`` (``mt pretrain`` checkpoints; from another one at a new TP x PP x
DP / ZeRO layout with the optimizer state, :mod:`mt_formats.pretrain_relayout`).
Conversions stream one tensor at a time, verify checksums on read, write checksums, and
write atomically; every expected failure is a :class:`ConvertError` naming file and tensor.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mt_formats.errors import ConvertError, WriteFailed

if TYPE_CHECKING:  # imported on first use (see __getattr__); named here for tools
    from mt_formats.canonical import (
        CheckpointReader,
        CheckpointWriter,
        TensorRef,
        TrainingProgress,
        canonical_shapes,
    )
    from mt_formats.convert import (
        FORMATS,
        ConversionResult,
        MappingEntry,
        convert_checkpoint,
        detect_format,
        load_model,
        load_state_dict,
        make_writer,
        open_checkpoint,
        plan_conversion,
        save_model,
        save_state_dict,
    )
    from mt_formats.safetensors_io import SafetensorsReader, SafetensorsWriter
    from mt_formats.tensors import TensorSpec

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "CheckpointReader",
    "CheckpointWriter",
    "ConversionResult",
    "ConvertError",
    "MappingEntry",
    "SafetensorsReader",
    "SafetensorsWriter",
    "TensorRef",
    "TensorSpec",
    "TrainingProgress",
    "WriteFailed",
    "__version__",
    "canonical_shapes",
    "convert_checkpoint",
    "detect_format",
    "load_model",
    "load_state_dict",
    "make_writer",
    "open_checkpoint",
    "plan_conversion",
    "save_model",
    "save_state_dict",
]

#: The format library needs torch (seconds to import): its names load on first use, so that
#: `mt convert --help` and `mt --help` start at once.
_LAZY = {name: module for module, names in {
    "mt_formats.convert": (
        "FORMATS", "ConversionResult", "MappingEntry", "convert_checkpoint", "detect_format",
        "load_model", "load_state_dict", "make_writer", "open_checkpoint", "plan_conversion",
        "save_model", "save_state_dict"),
    "mt_formats.canonical": ("CheckpointReader", "CheckpointWriter", "TensorRef",
                          "TrainingProgress", "canonical_shapes"),
    "mt_formats.safetensors_io": ("SafetensorsReader", "SafetensorsWriter"),
    "mt_formats.tensors": ("TensorSpec",),
}.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mt_formats' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
