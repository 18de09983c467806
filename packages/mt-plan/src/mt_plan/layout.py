"""A parallel training layout (pure): TP x PP x DP, batches, ZeRO, schedule, recompute.

:class:`ParallelLayout` validates its own numbers; :meth:`ParallelLayout.check` validates it
against a model; :func:`enumerate_layouts` lists the valid layouts of a GPU count for
``mt plan --search``. The one layout type of mt: the planner, the dry run and the layout
matrix describe a run with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from mt_model import GPTConfig
from mt_pipeline import SCHEDULES as PIPELINE_SCHEDULES
from mt_pipeline import PartitionError, uniform_partition
from mt_zero.precision import PRECISIONS

__all__ = ["RECOMPUTE", "SCHEDULES", "LayoutError", "ParallelLayout", "enumerate_layouts",
           "stage_layers"]

RECOMPUTE = ("full", "selective", "none")
SCHEDULES = tuple(PIPELINE_SCHEDULES)  # mt-pipeline's: gpipe, 1f1b, interleaved


class LayoutError(ValueError):
    """A layout that cannot run; the message names every number involved."""


@dataclass(frozen=True)
class ParallelLayout:
    """One way to run a model: parallel degrees, batch sizes and memory savers.

    Attributes:
        tp: tensor-parallel degree.
        pp: pipeline stages.
        dp: data-parallel replicas.
        global_batch: sequences per optimizer step.
        micro_batch: sequences per micro-batch.
        zero_stage: ZeRO stage 0-3 over the DP group.
        schedule: pipeline schedule: gpipe, 1f1b or interleaved.
        virtual_stages: model chunks per stage (interleaved only).
        sequence_parallel: shard LayerNorm / dropout activations over TP (Korthikanti).
        recompute: activation recomputation: full, selective or none.
        precision: bf16, fp16 (mixed precision, fp32 master weights) or fp32.
    """

    tp: int
    pp: int
    dp: int
    global_batch: int
    micro_batch: int = 1
    zero_stage: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: str = "full"
    precision: str = "bf16"

    def __post_init__(self) -> None:
        ints = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "global_batch": self.global_batch,
                "micro_batch": self.micro_batch, "virtual_stages": self.virtual_stages}
        bad = [f"{k} {v!r}" for k, v in ints.items()
               if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise LayoutError(f"must be positive integers: {', '.join(bad)}")
        problems = []
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"zero stage {self.zero_stage!r} is not 0, 1, 2 or 3")
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule {self.schedule!r} is not one of {SCHEDULES}")
        if self.recompute not in RECOMPUTE:
            problems.append(f"recompute {self.recompute!r} is not one of {RECOMPUTE}")
        if self.precision not in PRECISIONS:
            problems.append(f"precision {self.precision!r} is not one of "
                            f"{', '.join(PRECISIONS)}")
        per_step = self.micro_batch * self.dp
        if self.global_batch % per_step:
            problems.append(f"global batch {self.global_batch} is not divisible by micro-batch "
                            f"{self.micro_batch} x dp {self.dp} = {per_step}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            problems.append(f"virtual stages {self.virtual_stages} need the interleaved "
                            f"schedule, not {self.schedule!r}")
        elif self.schedule == "interleaved" and not problems:
            m = self.num_micro_batches
            if self.pp < 2 or m % self.pp:
                problems.append(f"the interleaved schedule needs pp {self.pp} >= 2 and "
                                f"micro-batches {m} divisible by pp {self.pp}")
        if problems:
            raise LayoutError("invalid layout: " + "; ".join(problems))

    @property
    def world_size(self) -> int:
        """GPUs used: tp x pp x dp."""
        return self.tp * self.pp * self.dp

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per pipeline and step: global batch / (micro-batch x dp)."""
        return self.global_batch // (self.micro_batch * self.dp)

    def check(self, gpt: GPTConfig) -> None:
        """Raise :class:`LayoutError` naming the numbers when ``gpt`` cannot be split so."""
        problems = []
        for what, size in (("n_heads", gpt.n_heads), ("hidden", gpt.hidden),
                           ("ffn_hidden", gpt.ffn_hidden)):
            if size % self.tp:
                problems.append(f"{what} {size} is not divisible by tp {self.tp}")
        if self.sequence_parallel and gpt.seq_len % self.tp:
            problems.append(f"seq_len {gpt.seq_len} is not divisible by tp {self.tp} "
                            "(sequence parallelism)")
        chunks = self.pp * self.virtual_stages
        if gpt.n_layers % chunks:
            problems.append(f"n_layers {gpt.n_layers} is not divisible by pp {self.pp} x "
                            f"virtual stages {self.virtual_stages} = {chunks}")
        if problems:
            raise LayoutError("invalid layout for this model: " + "; ".join(problems))


def stage_layers(n_layers: int, layout: ParallelLayout) -> list[int]:
    """Transformer layers per pipeline stage: mt-pipeline's uniform split (its default)."""
    try:
        return list(uniform_partition(n_layers, layout.pp).layer_counts)
    except PartitionError as err:
        raise LayoutError(f"invalid layout for this model: {err}") from None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(gpt: GPTConfig, gpus: int, global_batch: int, gpus_per_node: int = 8,
                      zero_stage: int = 1, schedule: str = "1f1b",
                      micro_batches: tuple[int, ...] = (1, 2, 4, 8)) -> Iterator[ParallelLayout]:
    """Every valid layout on exactly ``gpus`` GPUs: TP within a node (dividing the heads),
    PP dividing the layers, micro-batch in ``micro_batches``, all three recompute modes,
    sequence parallelism whenever TP > 1."""
    for tp in _divisors(min(gpus, gpus_per_node)):
        for pp in _divisors(gpus // tp) if gpus % tp == 0 else []:
            dp = gpus // (tp * pp)
            for b in micro_batches:
                for recompute in RECOMPUTE:
                    try:
                        sched = schedule if pp > 1 else "1f1b"
                        layout = ParallelLayout(tp, pp, dp, global_batch, b, zero_stage, sched,
                                        sequence_parallel=tp > 1 and gpt.seq_len % tp == 0,
                                        recompute=recompute)
                        layout.check(gpt)
                    except LayoutError:
                        continue
                    yield layout
