"""mt-zero: data parallelism with ZeRO stages 0-3, mixed precision, loss scaling, clipping,
and the learning-rate schedule (warmup, cosine decay in tokens).

Imports only torch and mt_dist; process groups are passed in explicitly. The precisions, the LR
schedule, the partition maths and the paper's byte counts import without torch (a planner, a
command line's --help); the rest loads on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mt_zero.lr_schedule import LRSchedule
from mt_zero.memory import paper_bytes
from mt_zero.partition import Piece, ShardLayout, bucketize, partition
from mt_zero.precision import (
    PRECISIONS,
    LossScaler,
    LossScalerConfig,
    Precision,
    compute_dtype,
    precision_of,
)

if TYPE_CHECKING:  # imported on first use (see __getattr__); named here for tools
    from mt_zero.checkpoint import (
        consolidate,
        initial_state,
        load_consolidated,
        optimizer_shard_state,
        split_consolidated,
    )
    from mt_zero.clip import clip_coefficient, clip_grad_norm_, counts_once, global_norm
    from mt_zero.grad_sync import GradSync
    from mt_zero.optimizer import MemoryReport, StepResult, ZeroConfig, ZeroOptimizer
    from mt_zero.param_groups import decay_param_groups, decays, split_decay
    from mt_zero.stage3 import assign_units, default_units

__all__ = [
    "GradSync",
    "LRSchedule",
    "LossScaler",
    "LossScalerConfig",
    "PRECISIONS",
    "Precision",
    "MemoryReport",
    "Piece",
    "ShardLayout",
    "StepResult",
    "ZeroConfig",
    "ZeroOptimizer",
    "assign_units",
    "bucketize",
    "clip_coefficient",
    "clip_grad_norm_",
    "compute_dtype",
    "consolidate",
    "counts_once",
    "decay_param_groups",
    "decays",
    "default_units",
    "global_norm",
    "initial_state",
    "load_consolidated",
    "paper_bytes",
    "precision_of",
    "partition",
    "optimizer_shard_state",
    "split_consolidated",
    "split_decay",
]

#: Names whose modules import torch (seconds), loaded on first use.
_LAZY = {name: module for module, names in {
    "mt_zero.checkpoint": ("consolidate", "initial_state", "load_consolidated",
                           "optimizer_shard_state", "split_consolidated"),
    "mt_zero.clip": ("clip_coefficient", "clip_grad_norm_", "counts_once", "global_norm"),
    "mt_zero.grad_sync": ("GradSync",),
    "mt_zero.optimizer": ("MemoryReport", "StepResult", "ZeroConfig", "ZeroOptimizer"),
    "mt_zero.param_groups": ("decay_param_groups", "decays", "split_decay"),
    "mt_zero.stage3": ("assign_units", "default_units"),
}.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mt_zero' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
