"""The resolved plan of a run (pure: no processes): layout, batches, steps, memory estimate.

:func:`resolve` turns a :class:`~mt_pretrain.config.schema.PretrainConfig` and a world size into a
:class:`RunPlan`, raising :class:`~mt_pretrain.config.schema.ConfigError` with the numbers when
the layout cannot work. Every rank calls it; ``--dry-run`` prints :func:`describe` of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mt_checkpoint import CheckpointError, find_checkpoint, fresh_start, read_meta
from mt_dist import Topology, TopologyError
from mt_model import (
    GPTConfig,
    GPTConfigError,
    count_parameters,
    model_flops_per_token_training,
)
from mt_pipeline import (
    SCHEDULES,
    PartitionError,
    PipelineConfig,
    PipelinePlan,
    ScheduleError,
    plan_pipeline,
)
from mt_plan.estimate import peak_in_flight, stage_memory
from mt_plan.gpus import GPUSpec
from mt_plan.layout import MAX_MICRO_BATCHES, MAX_WORLD_SIZE, LayoutError, ParallelLayout
from mt_pretrain.config.refusals import engine_of, unsupported
from mt_pretrain.config.schema import (
    DEFAULT_MODEL,
    DEFAULT_TRAIN_STEPS,
    INT_LIMIT,
    ConfigError,
    PretrainConfig,
)

__all__ = ["ResumePoint", "RunPlan", "activation_shape", "check_memory", "describe",
           "elastic_world", "loaded_checkpoint", "memory_estimate", "memory_shortfall",
           "model_of", "resolve", "runtime_spec"]


@dataclass(frozen=True)
class ResumePoint:
    """Where the mt-engine checkpoint ``--load`` names left its run: the step and the samples
    consumed, which the run's batch schedule counts on from (so a resumed run may change its
    global batch size), and the global batch size it recorded (None if unreadable)."""

    step: int
    consumed_samples: int
    global_batch_size: int | None


@dataclass(frozen=True)
class RunPlan:
    """Everything derived from the config and the world size.

    Attributes:
        layout: the run's one parallel layout (degrees, batch sizes, ZeRO stage, schedule,
            sequence parallelism, recomputation, precision), validated against the model;
            :attr:`topology` and :attr:`pipeline` are its views.
        gpt: the model as trained: its ``seq_len`` is the training sequence length.
        pipeline: mt-pipeline's config of the layout (with the run's --compile).
        stages: layers of every pipeline stage.
        rampup: (start, increment, samples) for mt_data.BatchSchedule, or None.
        train_steps: optimizer steps of the whole run.
        train_samples: samples consumed by the whole run (with :attr:`resumed`, those its
            checkpoint consumed and those of the steps left at this run's batch sizes).
        model: the model as built and saved: the same as ``gpt`` but for ``seq_len``, the
            rows of its position table, which a run resumed from a checkpoint may use only
            in part.
    """

    layout: ParallelLayout
    gpt: GPTConfig
    pipeline: PipelineConfig
    stages: PipelinePlan
    rampup: tuple[int, int, int] | None
    train_steps: int
    train_samples: int
    model: GPTConfig
    resumed: ResumePoint | None = None

    @property
    def topology(self) -> Topology:
        """The layout's (tp, cp, pp, dp) rank grid."""
        return self.layout.topology


def _batch_schedule(config: PretrainConfig, rampup: tuple[int, int, int] | None) -> Any:
    from mt_data import BatchSchedule

    return BatchSchedule(config.train.global_batch_size, rampup)


def _steps_and_samples(config: PretrainConfig, rampup: tuple[int, int, int] | None,
                       seq_len: int, resumed: ResumePoint | None) -> tuple[int, int]:
    """(steps, samples) of the whole run: from step 0, or from where ``resumed`` left off at
    this run's batch sizes."""
    schedule = _batch_schedule(config, rampup)
    train = config.train
    step, consumed = (resumed.step, resumed.consumed_samples) if resumed else (0, 0)
    if train.train_tokens is None:
        steps = train.train_steps or DEFAULT_TRAIN_STEPS
        return steps, schedule.consumed_after(consumed, max(steps - step, 0))
    more, consumed = schedule.steps_to(consumed, -(-train.train_tokens // seq_len))
    return step + more, consumed


def saved_model(model: Any, folder: Any) -> GPTConfig:
    """The model a checkpoint's ``meta.json`` records (``model``), or a CheckpointError
    naming the file when it is not a model config (a field of the wrong type...)."""
    try:
        return GPTConfig.from_dict(dict(model))
    except (GPTConfigError, TypeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{folder}/meta.json: damaged model ({err})") from None


def loaded_checkpoint(config: PretrainConfig) -> tuple[Path, Any] | None:
    """(the step folder, its meta.json) of the mt-engine checkpoint --load resumes, or None:
    no --load, a fresh start, or another engine's checkpoint (which records no model)."""
    load = config.checkpoint.load
    if load and engine_of(config).checkpoint_has_model and not fresh_start(
            load, config.checkpoint.save_dir):
        folder = find_checkpoint(load)
        return folder, read_meta(folder)
    return None


def model_of(config: PretrainConfig, loaded: tuple[Path, Any] | None = None
             ) -> tuple[GPTConfig, int]:
    """(the model to build, the training sequence length): from the flags, or with --load
    from the checkpoint (see :meth:`~mt_pretrain.config.schema.ModelArgs.on_checkpoint`;
    ``loaded``: :func:`loaded_checkpoint`'s answer, when already read)."""
    if loaded is not None or (loaded := loaded_checkpoint(config)) is not None:
        folder, meta = loaded
        return config.model.on_checkpoint(saved_model(meta.model, folder), str(folder))
    gpt = config.model.gpt_config()
    return gpt, gpt.seq_len


def _resume_point(loaded: tuple[Path, Any] | None) -> ResumePoint | None:
    if loaded is None:
        return None
    meta = loaded[1]
    train = meta.config.get("train")
    size = train.get("global_batch_size") if isinstance(train, Mapping) else None
    return ResumePoint(meta.step, meta.consumed_samples, size if isinstance(size, int) else None)


def resolve(config: PretrainConfig, world_size: int) -> RunPlan:
    """Check the config against ``world_size`` and derive the run plan."""
    par, train = config.parallel, config.train
    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"invalid layout: world size {world_size:,} (--nproc, --dp or the "
                          f"launcher's); at most {MAX_WORLD_SIZE:,} processes")
    refused = unsupported(config)
    if refused:
        raise ConfigError("invalid configuration: " + "; ".join(refused))
    loaded = loaded_checkpoint(config)
    model, seq_len = model_of(config, loaded)
    gpt = model.replace(seq_len=seq_len)
    refused = unsupported(config, gpt)  # the options passed above: the architecture
    if refused:
        raise ConfigError("invalid configuration: " + "; ".join(refused))
    layout = _layout_of(config, world_size, gpt)
    problems: list[str] = []
    if par.compile and par.recompute_mode == "full" and (gpt.dropout or gpt.attention_dropout):
        problems.append(f"--compile with --activation-checkpointing and dropout {gpt.dropout} "
                        "is not supported: compiled code draws its own dropout masks, which "
                        "recomputation is not shown to replay; leave out --compile (eager "
                        "runs key the masks by micro-batch and layer, so recomputation "
                        "replays them exactly) or use --dropout 0")
    per_step = layout.micro_batch * layout.dp
    rampup = None
    if train.rampup is not None:
        start, inc, tokens = train.rampup
        rampup = (start, inc, tokens // gpt.seq_len)
        for what, size in {"ramp-up start": start, "ramp-up increment": inc}.items():
            if size % per_step:
                problems.append(f"{what} {size} is not divisible by micro-batch size "
                                f"{layout.micro_batch} x dp {layout.dp} = {per_step}")
    if problems:
        raise ConfigError("invalid layout: " + "; ".join(problems))
    m = layout.num_micro_batches
    if m > MAX_MICRO_BATCHES:
        raise ConfigError(f"invalid layout: global batch size {layout.global_batch:,} is "
                          f"{m:,} micro-batches of {layout.micro_batch} on each of dp "
                          f"{layout.dp} replicas per step; at most {MAX_MICRO_BATCHES:,} (a "
                          "larger --micro-batch-size or --dp, or a smaller --global-batch-size)")
    pipeline = layout.pipeline_config(compile=par.compile)
    try:
        stages = plan_pipeline(pipeline, gpt.n_layers, layout.pp)
        if rampup is not None:  # every ramp-up batch must suit the schedule too
            for size in range(rampup[0], train.global_batch_size, rampup[1]):
                refused = SCHEDULES[layout.schedule].problems(
                    layout.pp, size // per_step, layout.virtual_stages)
                if refused:
                    raise ScheduleError(f"ramp-up batch {size}: " + "; ".join(refused))
    except (PartitionError, ScheduleError) as err:
        raise ConfigError(f"invalid pipeline: {err}") from None
    resumed = _resume_point(loaded)
    steps, samples = _steps_and_samples(config, rampup, gpt.seq_len, resumed)
    _check_length(config, steps, samples, gpt.seq_len)
    plan = RunPlan(layout, gpt, pipeline, stages, rampup, steps, samples, model, resumed)
    stage, memory = fullest_stage_memory(plan, "cpu")  # "cpu": no CUDA call in the parent
    if memory["total"] >= INT_LIMIT:
        raise ConfigError(
            f"invalid model: {gpt.n_layers:,} layers, hidden {gpt.hidden:,}, vocab "
            f"{gpt.vocab_size:,}, seq {gpt.seq_len:,} at micro-batch {layout.micro_batch:,} "
            f"need ~{memory['total']:.3g} bytes on a rank of stage {stage}, more than 2**63 "
            "bytes (past what torch can address); use a smaller --n-layers / --hidden / "
            "--vocab-size / --seq-len / --micro-batch-size, or more parallelism")
    return plan


def elastic_world(config: PretrainConfig, left: int) -> int | None:
    """The world size an elastic run (``--min-nproc``) continues on when ``left`` processes
    remain: the largest, down to --min-nproc, on which its layout resolves (the degrees
    divide it; the global batch splits into whole micro-batches per data-parallel rank);
    None when none does."""
    low = config.parallel.min_nproc or left
    for size in range(left, low - 1, -1):
        try:
            resolve(replace(config, parallel=replace(config.parallel, nproc=size)), size)
        except ConfigError:
            continue
        return size
    return None


def _layout_of(config: PretrainConfig, world_size: int, gpt: GPTConfig) -> ParallelLayout:
    """The layout of ``config`` on ``world_size`` processes, checked against ``gpt``; a
    world the degrees do not divide names degrees that would."""
    par, train = config.parallel, config.train
    try:
        cp = f" x cp {par.cp}" if par.cp > 1 else ""
        if par.dp is not None and par.tp * par.cp * par.pp * par.dp != world_size:
            raise TopologyError(
                f"tp {par.tp} x pp {par.pp} x dp {par.dp}{cp} = "
                f"{par.tp * par.cp * par.pp * par.dp} processes, but the world size is "
                f"{world_size}")
        layout = par.layout(world_size, train.global_batch_size, train.micro_batch_size)
        layout.check(gpt)
    except TopologyError as err:
        hint = ""
        if world_size % (par.tp * par.pp * par.cp):
            tp = math.gcd(par.tp, world_size)
            pp = math.gcd(par.pp, world_size // tp)
            hint = (f"; with {world_size} process{'es' if world_size > 1 else ''} pass --tp "
                    f"and --pp whose product divides {world_size}, e.g. --tp {tp} --pp {pp}")
            if par.cp > 1:
                hint = (f"; with {world_size} process{'es' if world_size > 1 else ''} pass "
                        f"--tp, --cp and --pp whose product divides {world_size}")
        raise ConfigError(f"invalid layout: {err}{hint}") from None
    except LayoutError as err:
        raise ConfigError(str(err)) from None
    return layout


def _check_length(config: PretrainConfig, steps: int, samples: int, seq_len: int) -> None:
    """The run's tokens fit an int64, and its warmup ends before its decay does."""
    train = config.train
    if samples * seq_len >= INT_LIMIT:
        given = (f"--train-tokens {train.train_tokens:,} is {steps:,} steps"
                 if train.train_tokens is not None else f"{steps:,} steps")
        raise ConfigError(f"{given} of {train.global_batch_size:,} sequences of "
                          f"{seq_len:,} tokens: {samples * seq_len:,} tokens; at most "
                          "2**63 - 1 (fewer --train-steps or --train-tokens)")
    decay = train.decay_tokens if train.decay_tokens is not None else samples * seq_len
    if train.warmup_tokens is not None and train.warmup_tokens > decay:
        where = ("--decay-tokens" if train.decay_tokens is not None else
                 f"the whole run's tokens ({steps:,} steps)")
        raise ConfigError(f"--warmup-tokens {train.warmup_tokens:,} is longer than the decay: "
                          f"{decay:,} tokens ({where}); the learning rate would never reach "
                          "--lr. Use a shorter warmup, or a longer --decay-tokens")


def activation_shape(plan: RunPlan) -> tuple[int, int, int]:
    """Shape of one micro-batch's activation between stages: [micro, seq / cp (/tp with SP),
    h]."""
    seq = plan.gpt.seq_len // plan.topology.cp
    if plan.layout.sequence_parallel:
        seq //= plan.topology.tp
    return (plan.layout.micro_batch, seq, plan.gpt.hidden)


def runtime_spec(device: str) -> GPUSpec:
    """What the memory estimate needs to know of the device ``mt pretrain`` runs on.

    Only the memory-relevant traits matter here (the speeds are placeholders): torch's
    scaled-dot-product attention never stores the scores on CPU or CUDA (fused), and gloo
    (CPU) stages an all-gather's output in a buffer of its own, NCCL does not.
    """
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return GPUSpec(device, 1.0, float("inf"), 1.0, 1.0, 1, 1.0,
                   gather_scratch=1.0 if device == "cpu" else 0.0, fused_attention=True)


def memory_estimate(plan: RunPlan, stage: int, gpu: GPUSpec) -> dict[str, float]:
    """Bytes per rank of pipeline ``stage``: ``weights``, ``grads``, ``optimizer``,
    ``activations``, ``temporaries``, ``total`` (and ``params``).

    The very estimator ``mt plan`` uses (:func:`mt_plan.estimate.stage_memory`: ZeRO
    sharding, Korthikanti activations times the chunk forwards the schedule keeps alive, the
    largest short-lived phase), applied to this run's stages on ``gpu`` (the run's own
    device: :func:`runtime_spec`).
    """
    layout = plan.layout
    layers = plan.stages.stages[stage].num_layers
    return stage_memory(plan.gpt, layout, gpu, stage, layers, peak_in_flight(layout)[stage])


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _model_name(config: PretrainConfig) -> str:
    if config.model.model:
        return config.model.model
    return f"from {config.checkpoint.load}" if config.checkpoint.load else DEFAULT_MODEL


def fullest_stage_memory(plan: RunPlan, device: str) -> tuple[int, dict[str, float]]:
    """(the pipeline stage with the most memory per rank, its :func:`memory_estimate`) on
    ``device`` ("cpu", "cuda" or "auto"): what a run's measured peak compares with."""
    gpu = runtime_spec(device)
    estimates = [memory_estimate(plan, sp.stage, gpu) for sp in plan.stages.stages]
    stage = max(range(len(estimates)), key=lambda s: estimates[s]["total"])
    return stage, estimates[stage]


def memory_shortfall(plan: RunPlan, device: Any, ranks_here: int) -> str | None:
    """How the plan's memory exceeds this machine's ``device`` (a torch device or its name),
    in words: on CUDA, the fullest stage's per rank above the GPU's memory; on CPU, what its
    ``ranks_here`` ranks on this host need together above its RAM (those of the leanest
    stages: exact when every rank is here, never more than the ranks a launcher placed here
    need). None when it fits or either figure is unknown."""
    from mt_plan.memory import device_memory

    kind = str(device).split(":")[0]
    gpu = runtime_spec(kind)
    per_stage = [memory_estimate(plan, s, gpu)["total"] for s in range(plan.topology.pp)]
    stage = max(range(len(per_stage)), key=per_stage.__getitem__)
    need, what = per_stage[stage], f"~{_gib(per_stage[stage])} per rank (stage {stage})"
    if kind == "cpu" and ranks_here > 1:
        need, left = 0.0, ranks_here
        for total in sorted(per_stage):  # each stage has world / pp ranks
            taken = min(left, plan.topology.world_size // plan.topology.pp)
            need, left = need + taken * total, left - taken
        what = (f"~{_gib(need)} for its {ranks_here} ranks on this host (up to "
                f"~{_gib(per_stage[stage])} a rank, stage {stage})")
    memory = device_memory(device)
    if memory is None or not need > memory[0]:  # NaN: no estimate
        return None
    return f"the plan needs {what}, more than {memory[1]}"


def check_memory(plan: RunPlan, device: Any, ranks_here: int) -> None:
    """Refuse (:class:`ConfigError`) a plan whose memory exceeds this machine's
    (:func:`memory_shortfall`), before any rank builds its model."""
    if short := memory_shortfall(plan, device, ranks_here):
        raise ConfigError(f"invalid layout: {short}; use a smaller --seq-len, "
                          "--micro-batch-size or model, recomputation, or more machines")


def measured_memory_note(device: str) -> str:
    """What ``mt pretrain`` measures on ``device`` to set beside the estimate."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return ("measured   the run reports each rank's peak memory allocated by torch's CUDA "
                "caching allocator (progress line, metrics `peak_mem_gib`, summary): compare "
                "it with the memory per rank above")
    return ("measured   the run reports each rank's peak RSS (progress line, metrics "
            "`peak_mem_gib`, summary): the memory per rank above plus the Python interpreter "
            "and torch (a few hundred MB)")


def describe(config: PretrainConfig, plan: RunPlan, max_ranks: int = 32) -> str:
    """The dry-run report: layout, ranks, groups, stages, parameters, memory, schedule."""
    lay, topo, gpt, pipe = plan.layout, plan.topology, plan.gpt, plan.pipeline
    par = config.parallel
    lines = [
        f"model      {_model_name(config)}: {gpt.n_layers} layers, hidden {gpt.hidden}, "
        f"{gpt.n_heads} heads, vocab {gpt.vocab_size}, seq {gpt.seq_len}"
        + (f" (of {plan.model.seq_len} positions)" if plan.model.seq_len != gpt.seq_len
           else "") + f": {count_parameters(plan.model):,} parameters",
        f"layout     {topo.describe()} = {topo.world_size} ranks; "
        f"ZeRO stage {lay.zero_stage}, {lay.precision}, engine {par.engine}"
        + (", sequence parallel" if lay.sequence_parallel else "")
        + (f", recompute {lay.recompute}" if lay.recompute != "none" else "")
        + (", compiled" if pipe.compile else ""),
        f"batch      global {lay.global_batch} = micro {lay.micro_batch} x "
        f"dp {topo.dp} x {pipe.num_micro_batches} micro-batches"
        + (f"; ramp-up {plan.rampup[0]} +{plan.rampup[1]} over {plan.rampup[2]:,} samples"
           if plan.rampup else ""),
        *([f"context    cp {topo.cp}: each rank holds 2 chunks of {gpt.seq_len // (2 * topo.cp)}"
            f" tokens of every sequence, keys and values all-gathered over the cp group in "
            f"every layer; gradients reduced over dp x cp = {topo.dp * topo.cp} ranks"]
          if topo.cp > 1 else []),
        f"training   {plan.train_steps:,} steps, {plan.train_samples:,} samples, "
        f"{plan.train_samples * gpt.seq_len:,} tokens; "
        f"{model_flops_per_token_training(gpt):.3g} FLOPs per token",
    ]
    if topo.pp > 1:
        bubble = (topo.pp - 1) / (pipe.virtual_stages * pipe.num_micro_batches)
        lines.append(f"schedule   {pipe.schedule}, {pipe.num_micro_batches} micro-batches, "
                     f"{pipe.virtual_stages} chunk(s) per stage, bubble (p-1)/(v m) = "
                     f"{bubble:.3f}")
    lines.append("stages")
    for sp in plan.stages.stages:
        ends = ("embedding " if sp.has_embedding else "") + ("head+loss" if sp.has_head else "")
        mem = memory_estimate(plan, sp.stage, runtime_spec(par.device))
        chunks = ", ".join(f"[{a}, {b})" for a, b in sp.chunks)
        lines.append(
            f"  stage {sp.stage}: layers {chunks} {ends.strip()}; {int(mem['params']):,} "
            f"parameters per rank; memory per rank ~{_gib(mem['total'])} (weights "
            f"{_gib(mem['weights'])}, grads {_gib(mem['grads'])}, optimizer "
            f"{_gib(mem['optimizer'])}, activations {_gib(mem['activations'])}, temporaries "
            f"{_gib(mem['temporaries'])})")
    lines.append(measured_memory_note(par.device))
    lines.append("groups")
    kinds = ("tp", "cp", "dp", "dp_cp", "pp", "embedding") if topo.cp > 1 else \
        ("tp", "dp", "pp", "embedding")
    for kind in kinds:
        groups = getattr(topo, f"{kind}_groups")()
        shown = ", ".join(str(list(g)) for g in groups[:8])
        more = f" ... ({len(groups)} groups)" if len(groups) > 8 else ""
        lines.append(f"  {kind:<9} {shown}{more}")
    lines.append("ranks")
    for rank in range(min(topo.world_size, max_ranks)):
        c = topo.coord(rank)
        lines.append(f"  rank {rank:>4}: pp {c.pp} dp {c.dp} tp {c.tp}"
                     + (f" cp {c.cp}" if topo.cp > 1 else ""))
    if topo.world_size > max_ranks:
        lines.append(f"  ... {topo.world_size - max_ranks} more ranks")
    return "\n".join(lines)
