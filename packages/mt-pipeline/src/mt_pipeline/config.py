"""Pipeline configuration, validated before any process group is touched."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mt_pipeline.partition import PartitionError, PipelinePlan, partition_layers
from mt_pipeline.schedules import (
    DEFAULT_SCHEDULE,
    SCHEDULES,
    Schedule,
    ScheduleError,
    get_schedule,
)

__all__ = ["PipelineConfig", "plan_pipeline"]


@dataclass(frozen=True)
class PipelineConfig:
    """How a pipeline runs one training step.

    Attributes:
        schedule: a key of :data:`~mt_pipeline.schedules.SCHEDULES` (gpipe, 1f1b,
            interleaved).
        num_micro_batches: micro-batches per step (gradients accumulate over them).
        virtual_stages: model chunks per stage; >= 2 for a chunked schedule (interleaved),
            1 otherwise.
        activation_checkpointing: recompute every layer's activations in backward.
        selective_recompute: keep every matmul's and the attention core's tensors, recompute
            the norms' and activation functions' outputs in backward
            (:mod:`mt_pipeline.checkpointing`).
        compile: run each chunk's forward (with the loss on the last chunk) through
            ``torch.compile``: elementwise work, LayerNorms and the loss fuse into fewer
            kernels. The first step of each chunk pays the compilation.
    """

    schedule: str = DEFAULT_SCHEDULE
    num_micro_batches: int = 1
    virtual_stages: int = 1
    activation_checkpointing: bool = False
    selective_recompute: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ScheduleError(
                f"unknown schedule {self.schedule!r}; choose one of {sorted(SCHEDULES)}"
            )
        for name in ("num_micro_batches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"{name} must be a positive int, got {value!r}")
        problem = SCHEDULES[self.schedule].chunk_problem(self.virtual_stages)
        if problem:
            raise ScheduleError(problem)
        if self.activation_checkpointing and self.selective_recompute:
            raise ScheduleError("activation_checkpointing (full recomputation) and "
                                "selective_recompute exclude each other")

    @property
    def recompute(self) -> str:
        """The recomputation mode: ``"full"``, ``"selective"`` or ``"none"``."""
        return ("full" if self.activation_checkpointing else
                "selective" if self.selective_recompute else "none")

    def schedule_for(self, num_stages: int) -> Schedule:
        """The instruction lists of all ``num_stages`` stages; raises
        :class:`ScheduleError` (naming the numbers) if this config cannot run on them."""
        return get_schedule(
            self.schedule, num_stages, self.num_micro_batches, self.virtual_stages
        )


def plan_pipeline(
    config: PipelineConfig,
    num_layers: int,
    num_stages: int,
    method: str = "uniform",
    *,
    layer_weights: Sequence[float] | None = None,
    layer_counts: Sequence[int] | None = None,
    embedding_weight: float = 0.0,
    head_weight: float = 0.0,
) -> PipelinePlan:
    """Check that ``config`` runs on ``num_stages`` stages and split ``num_layers`` layers.

    Pure and cheap: call it before creating process groups so that a bad combination
    (e.g. 6 layers on 4 uniform stages, or interleaving with fewer micro-batches than a
    multiple of the stage count) fails at once with every number named.
    """
    config.schedule_for(num_stages)  # raises ScheduleError for a bad (p, m, v)
    plan = partition_layers(
        num_layers,
        num_stages,
        method,
        virtual_stages=config.virtual_stages,
        layer_weights=layer_weights,
        layer_counts=layer_counts,
        embedding_weight=embedding_weight,
        head_weight=head_weight,
    )
    if plan.num_stages != num_stages or plan.virtual_stages != config.virtual_stages:
        raise PartitionError(
            f"plan has {plan.num_stages} stages x {plan.virtual_stages} chunks, expected "
            f"{num_stages} x {config.virtual_stages}"
        )
    return plan
