"""mt-pipeline: pipeline parallelism for mt.

Pure, process-free core: schedules as data (:mod:`mt_pipeline.schedules`), a simulator that
checks and times them (:mod:`mt_pipeline.simulator`), timeline export
(:mod:`mt_pipeline.trace`, measured ones via :mod:`mt_pipeline.timeline`), layer
partitioning (:mod:`mt_pipeline.partition`) and the
pipeline config (:mod:`mt_pipeline.config`). None of these import torch.

Executor (needs torch and mt_dist, imported on first use): stages built from a GPT-like
model (:mod:`mt_pipeline.stage`), per-layer activation checkpointing
(:mod:`mt_pipeline.checkpointing`), P2P / collectives (:mod:`mt_pipeline.p2p`) and the
instruction executor (:mod:`mt_pipeline.executor`), forward-only passes for evaluation
(:mod:`mt_pipeline.forward`).
"""

from __future__ import annotations

import importlib
from typing import Any

from mt_pipeline.config import PipelineConfig, plan_pipeline
from mt_pipeline.partition import (
    PartitionError,
    PipelinePlan,
    StagePlan,
    balanced_partition,
    explicit_partition,
    partition_layers,
    uniform_partition,
)
from mt_pipeline.schedules import (
    DEFAULT_SCHEDULE,
    SCHEDULES,
    Backward,
    Exchange,
    Forward,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    P2POp,
    RecvActivation,
    RecvGrad,
    ReduceTiedGrads,
    Schedule,
    ScheduleError,
    ScheduleSpec,
    SendActivation,
    SendGrad,
    chunked_schedules,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
)
from mt_pipeline.simulator import (
    CheckedSchedule,
    DeadlockError,
    Event,
    MismatchError,
    SimulationResult,
    check_dataflow,
    check_matching,
    checked_schedule,
    peak_in_flight,
    simulate,
)
from mt_pipeline.timeline import measured_timeline
from mt_pipeline.trace import event_name, to_chrome_trace, write_chrome_trace, write_png

__version__ = "0.1.0"

# Torch-dependent names, imported lazily so the pure core works without torch.
_LAZY = {
    "ModelLayout": "mt_pipeline.stage",
    "PipelineStage": "mt_pipeline.stage",
    "RegionRNG": "mt_pipeline.stage",
    "DecodeCache": "mt_pipeline.stage",
    "decode_step": "mt_pipeline.forward",
    "build_stage": "mt_pipeline.stage",
    "run_layers": "mt_pipeline.checkpointing",
    "StageComm": "mt_pipeline.p2p",
    "PipelineExecutor": "mt_pipeline.executor",
    "forward_losses": "mt_pipeline.forward",
    "forward_outputs": "mt_pipeline.forward",
    "PipelineStepResult": "mt_pipeline.executor",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mt_pipeline' has no attribute {name!r}")


__all__ = [
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "Backward",
    "CheckedSchedule",
    "DeadlockError",
    "Event",
    "Exchange",
    "Forward",
    "Instruction",
    "LoadMicroBatch",
    "MismatchError",
    "ModelLayout",
    "OptimizerStep",
    "P2POp",
    "PartitionError",
    "PipelineConfig",
    "PipelineExecutor",
    "PipelinePlan",
    "PipelineStage",
    "RegionRNG",
    "DecodeCache",
    "RecvActivation",
    "RecvGrad",
    "ReduceTiedGrads",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "SendActivation",
    "SendGrad",
    "SimulationResult",
    "StageComm",
    "StagePlan",
    "PipelineStepResult",
    "__version__",
    "balanced_partition",
    "build_stage",
    "chunked_schedules",
    "check_dataflow",
    "check_matching",
    "checked_schedule",
    "event_name",
    "explicit_partition",
    "decode_step",
    "forward_losses",
    "forward_outputs",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "measured_timeline",
    "one_f_one_b",
    "partition_layers",
    "peak_in_flight",
    "plan_pipeline",
    "run_layers",
    "simulate",
    "to_chrome_trace",
    "uniform_partition",
    "write_chrome_trace",
    "write_png",
]
