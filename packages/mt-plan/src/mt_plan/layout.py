"""A parallel training layout (pure): TP x CP x PP x DP, batches, ZeRO, schedule, recompute.

:class:`ParallelLayout` is the one layout type of mt: built and validated once (its own
numbers at construction, against a model by :meth:`ParallelLayout.check`), then passed to
whatever needs it. The inputs of the parallel packages, which each install alone, are views
of it, never built from a config by hand: :attr:`~ParallelLayout.topology` (mt-dist's rank
grid), :meth:`~ParallelLayout.pipeline_config` (mt-pipeline) and
:meth:`~ParallelLayout.zero_config` (mt-zero). :func:`enumerate_layouts` lists the valid layouts
of a GPU count for ``mt plan --search``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mt_model import GPTConfig
from mt_pipeline import DEFAULT_SCHEDULE, PartitionError, PipelineConfig, uniform_partition
from mt_pipeline import SCHEDULES as PIPELINE_SCHEDULES
from mt_zero.precision import PRECISIONS

if TYPE_CHECKING:  # mt-dist, mt-tensor-parallel and mt-zero import torch: done when used
    from mt_dist import Topology
    from mt_zero import ZeroConfig

__all__ = ["MAX_MICRO_BATCHES", "MAX_WORLD_SIZE", "RECOMPUTE", "SCHEDULES", "ZERO_STAGES",
           "LayoutError", "ParallelLayout", "idle_option_problems",
           "cp_hint", "cp_problems", "divisors", "enumerate_layouts", "nearest_gpu_count",
           "option_problems", "stage_layers"]

RECOMPUTE = ("full", "selective", "none")
SCHEDULES = tuple(PIPELINE_SCHEDULES)  # mt-pipeline's registry: gpipe, 1f1b, interleaved
ZERO_STAGES = (0, 1, 2, 3)
#: Micro-batches one step may take per replica (MT-NLG: 1,920 / 8 replicas = 240): a schedule
#: of more is too long to build or simulate (100,000 over 4 stages: 40 s; 1e10: hours).
MAX_MICRO_BATCHES = 100_000
#: Processes a layout may span (MT-NLG trained on 4,480 GPUs): its ranks, groups and a
#: search's divisors are enumerated one by one.
MAX_WORLD_SIZE = 2**20


def option_problems(*, zero_stage: Any, schedule: Any, virtual_stages: Any, recompute: Any,
                    precision: Any) -> list[str]:
    """Why these named options cannot form a layout (each naming its value); empty: they can.

    The one check of the options, for :class:`ParallelLayout` and for a config read before
    the world size (hence the batch split) is known.
    """
    problems = []
    if zero_stage not in ZERO_STAGES:
        problems.append(f"zero stage {zero_stage!r} is not 0, 1, 2 or 3")
    if schedule not in PIPELINE_SCHEDULES:
        problems.append(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    else:
        problems += [p for p in (PIPELINE_SCHEDULES[schedule].chunk_problem(virtual_stages),)
                     if p]
    if recompute not in RECOMPUTE:
        problems.append(f"recompute {recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if precision not in PRECISIONS:
        problems.append(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    return problems


def idle_option_problems(*, tp: int, pp: int, virtual_stages: int, sequence_parallel: bool,
                         main_grads: bool, precision: str) -> list[str]:
    """The options given that would do nothing in this layout, in the flags' words (`mt
    pretrain` and `mt plan` refuse them: was accepted in silence); empty: none."""
    problems = []
    if sequence_parallel and tp == 1:
        problems.append("--sequence-parallel shards activations over the tensor-parallel "
                        "ranks, and --tp 1 has none: give --tp >= 2 or leave it out")
    if virtual_stages > 1 and pp == 1:
        problems.append(f"--virtual-stages {virtual_stages} splits each pipeline stage into "
                        "model chunks, and --pp 1 has no pipeline: give --pp >= 2 (with "
                        "--schedule interleaved) or leave it out")
    if not main_grads and precision == "fp32":
        problems.append("--no-main-grads keeps 16-bit gradients with --precision bf16 or "
                        "fp16; with --precision fp32 the gradients are fp32 anyway: leave it "
                        "out")
    return problems


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
        schedule: pipeline schedule, a key of mt-pipeline's ``SCHEDULES`` (gpipe, 1f1b,
            interleaved).
        virtual_stages: model chunks per stage (>= 2 with a chunked schedule, else 1).
        sequence_parallel: shard LayerNorm / dropout activations over TP (Korthikanti).
        recompute: activation recomputation: full, selective or none.
        precision: bf16, fp16 (mixed precision, fp32 master weights) or fp32.
        chunked_loss: the output layer and the cross entropy in one, chunk by chunk of
            tokens (never the [b, s, vocab / tp] logits, their float32 copies or their
            gradient); else the logits, then the loss.
        main_grads: 16-bit precisions accumulate gradients over micro-batches and reduce
            them over DP in fp32 (4 bytes per parameter of gradient, not 2).
        cp: context-parallel degree: each of ``cp`` ranks holds a slice of every sequence
            (gradients reduced and ZeRO sharded over dp x cp).
    """

    tp: int
    pp: int
    dp: int
    global_batch: int
    micro_batch: int = 1
    zero_stage: int = 1
    schedule: str = DEFAULT_SCHEDULE
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: str = "full"
    precision: str = "bf16"
    chunked_loss: bool = True
    main_grads: bool = True
    cp: int = 1

    def __post_init__(self) -> None:
        ints = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp,
                "global_batch": self.global_batch,
                "micro_batch": self.micro_batch, "virtual_stages": self.virtual_stages}
        bad = [f"{k} {v!r}" for k, v in ints.items()
               if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise LayoutError(f"must be positive integers: {', '.join(bad)}")
        problems = option_problems(zero_stage=self.zero_stage, schedule=self.schedule,
                                   virtual_stages=self.virtual_stages, recompute=self.recompute,
                                   precision=self.precision)
        per_step = self.micro_batch * self.dp
        if self.global_batch % per_step:
            problems.append(f"global batch size {self.global_batch} is not divisible by "
                            f"micro-batch size {self.micro_batch} x dp {self.dp} = {per_step}")
        elif not problems and PIPELINE_SCHEDULES[self.schedule].micro_batches_per_stage:
            problems += PIPELINE_SCHEDULES[self.schedule].problems(
                self.pp, self.num_micro_batches, self.virtual_stages)
        if problems:
            raise LayoutError("invalid layout: " + "; ".join(problems))

    @property
    def world_size(self) -> int:
        """GPUs used: tp x cp x pp x dp."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per pipeline and step: global batch / (micro-batch x dp)."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def topology(self) -> Topology:
        """mt-dist's rank grid of this layout (rank order, groups)."""
        from mt_dist import Topology

        return Topology(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp)

    def pipeline_config(self, compile: bool = False) -> PipelineConfig:
        """mt-pipeline's input: the schedule at this layout's micro-batches per pipeline."""
        return PipelineConfig(self.schedule, self.num_micro_batches, self.virtual_stages,
                              activation_checkpointing=self.recompute == "full",
                              selective_recompute=self.recompute == "selective",
                              compile=compile)

    def zero_config(self, **options: Any) -> ZeroConfig:
        """mt-zero's input: this layout's ZeRO stage and precision, with ``options`` (the
        bucket size, gradient clipping, loss scaling) that are not the layout's."""
        from mt_zero import ZeroConfig

        return ZeroConfig(stage=self.zero_stage, precision=self.precision,
                          main_grads=self.main_grads, **options)

    def check(self, gpt: GPTConfig) -> None:
        """Raise :class:`LayoutError` naming the numbers when ``gpt`` cannot be split so."""
        from mt_tensor_parallel import check_divisibility

        problems = []
        try:
            check_divisibility(tp=self.tp, n_heads=gpt.n_heads, hidden=gpt.hidden,
                               ffn_hidden=gpt.ffn_hidden, seq_len=gpt.seq_len,
                               sequence_parallel=self.sequence_parallel,
                               n_kv_heads=gpt.n_kv_heads)
        except ValueError as err:
            problems.append(str(err))
        if self.cp > 1:
            problems += cp_problems(gpt.seq_len, self.cp, self.tp, self.sequence_parallel)
        chunks = self.pp * self.virtual_stages
        if gpt.n_layers % chunks:
            problems.append(f"n_layers {gpt.n_layers} is not divisible by pp {self.pp} x "
                            f"virtual stages {self.virtual_stages} = {chunks}")
        if problems:
            raise LayoutError("invalid layout for this model: " + "; ".join(problems))


def cp_problems(seq_len: int, cp: int, tp: int, sequence_parallel: bool) -> list[str]:
    """Why a sequence of ``seq_len`` cannot be split over ``cp`` context-parallel ranks: each
    holds two equal chunks (the causal balance), which sequence parallelism splits again over
    ``tp`` ranks."""
    if seq_len % (2 * cp):
        return [f"seq_len {seq_len} is not divisible by 2 x cp {cp} = {2 * cp} (each "
                f"context-parallel rank holds two equal chunks of every sequence)"]
    if sequence_parallel and (seq_len // cp) % tp:
        return [f"seq_len {seq_len} / cp {cp} = {seq_len // cp} is not divisible by tp {tp} "
                f"(sequence parallelism splits each rank's slice)"]
    return []


def stage_layers(n_layers: int, layout: ParallelLayout) -> list[int]:
    """Transformer layers per pipeline stage: mt-pipeline's uniform split (its default)."""
    try:
        return list(uniform_partition(n_layers, layout.pp).layer_counts)
    except PartitionError as err:
        raise LayoutError(f"invalid layout for this model: {err}") from None


def enumerate_layouts(gpt: GPTConfig, gpus: int, global_batch: int, gpus_per_node: int = 8,
                      zero_stage: int = 1, schedule: str = DEFAULT_SCHEDULE,
                      micro_batches: tuple[int, ...] = (1, 2, 4, 8), max_cp: int = 1
                      ) -> Iterator[ParallelLayout]:
    """Every valid layout on exactly ``gpus`` GPUs: TP within a node (dividing the heads),
    context parallelism in powers of two up to ``max_cp`` (1: none), PP dividing the layers,
    micro-batch in ``micro_batches``, all three recompute modes, sequence parallelism
    whenever TP > 1 divides the rank's tokens."""
    cps = [c for c in (2 ** i for i in range(max(1, max_cp).bit_length())) if c <= max_cp]
    for tp in divisors(min(gpus, gpus_per_node)):
        for cp in (c for c in cps if gpus % (tp * c) == 0):
            for pp in divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                for b in micro_batches:
                    for recompute in RECOMPUTE:
                        try:
                            sched = schedule if pp > 1 else DEFAULT_SCHEDULE
                            layout = ParallelLayout(
                                tp, pp, dp, global_batch, b, zero_stage, sched,
                                sequence_parallel=tp > 1 and (gpt.seq_len // cp) % tp == 0,
                                recompute=recompute, cp=cp)
                            layout.check(gpt)
                        except LayoutError:
                            continue
                        yield layout


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def cp_hint(seq_len: int, gpus: int) -> int:
    """The largest power-of-two CP degree worth suggesting to a search: it divides ``gpus``
    and splits ``seq_len`` into 2 cp chunks of at least 512 tokens (1: none)."""
    cp = 1
    while gpus % (2 * cp) == 0 and seq_len % (4 * cp) == 0 and seq_len // (4 * cp) >= 512:
        cp *= 2
    return cp


def nearest_gpu_count(gpt: GPTConfig, gpus: int, global_batch: int, gpus_per_node: int,
                      zero_stage: int, schedule: str, max_cp: int = 1) -> int | None:
    """The GPU count nearest ``gpus`` that has a layout: a count is tp (at most the heads and
    a node) x cp x pp (dividing the layers) x dp (dividing the global batch); the nearest
    below first, else the nearest above (up to 2 gpus + 1); None: none."""
    counts = {t * c * p * d for t in range(1, min(gpus_per_node, gpt.n_heads) + 1)
              for c in (2 ** i for i in range(max_cp.bit_length())) if c <= max_cp
              for p in divisors(gpt.n_layers) for d in divisors(global_batch)}
    order = [*sorted((n for n in counts if n < gpus), reverse=True),
             *sorted(n for n in counts if gpus < n <= 2 * gpus + 1)]
    return next((n for n in order if any(True for _ in enumerate_layouts(
        gpt, n, global_batch, gpus_per_node, zero_stage, schedule, max_cp=max_cp))), None)
