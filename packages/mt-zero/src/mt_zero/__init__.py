"""mt-zero: data parallelism with ZeRO stages 0-3, mixed precision, loss scaling, clipping,
and the learning-rate schedule (warmup, cosine decay in tokens).

Imports only torch and mt_dist; process groups are passed in explicitly.
"""

from mt_zero.checkpoint import (
    consolidate,
    initial_state,
    load_consolidated,
    optimizer_shard_state,
    split_consolidated,
)
from mt_zero.clip import clip_coefficient, clip_grad_norm_, counts_once, global_norm
from mt_zero.grad_sync import GradSync
from mt_zero.lr_schedule import LRSchedule
from mt_zero.memory import paper_bytes
from mt_zero.optimizer import MemoryReport, StepResult, ZeroConfig, ZeroOptimizer
from mt_zero.param_groups import decay_param_groups, decays, split_decay
from mt_zero.partition import Piece, ShardLayout, bucketize, partition
from mt_zero.precision import LossScaler, LossScalerConfig, compute_dtype
from mt_zero.stage3 import assign_units, default_units

__all__ = [
    "GradSync",
    "LRSchedule",
    "LossScaler",
    "LossScalerConfig",
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
    "partition",
    "optimizer_shard_state",
    "split_consolidated",
    "split_decay",
]
