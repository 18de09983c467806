"""Typed configuration of `mt pretrain`: frozen dataclasses <- YAML file <- CLI flags.

Every field has an attribute docstring; the CLI turns each field into a ``--flag`` whose help
text is that docstring (see :func:`field_docs`). Field names are unique across sections, so a
YAML file may use sections (``parallel: {tp: 2}``) or flat keys (``tp: 2``).

Checks that need only the config run in ``__post_init__``; checks that need the world size
(data-parallel degree, batch divisibility, pipeline split) run in
:func:`mt_pretrain.config.resolve.resolve`, an explicit step (``load_config`` takes it when
the flags fix the world size; the dry run and every rank take it). The config is pure data: nothing
here reads a file or imports the resolver. Every error names the numbers involved.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mt_data.text import not_utf8
from mt_pipeline import DEFAULT_SCHEDULE
from mt_plan.layout import SCHEDULES, ParallelLayout, idle_option_problems, option_problems
from mt_pretrain.config.engines import ENGINES
from mt_zero.precision import PRECISIONS as ZERO_PRECISIONS

__all__ = [
    "DEFAULT_TRAIN_STEPS",
    "SECTIONS",
    "CheckpointArgs",
    "ConfigError",
    "DataArgs",
    "LogArgs",
    "ModelArgs",
    "ParallelArgs",
    "PretrainConfig",
    "TrainArgs",
    "layout_flags",
]


DEFAULT_TRAIN_STEPS = 300
DEFAULT_MODEL = "tiny"
#: The model fields that make its shape (what a checkpoint and a preset must agree on).
ARCHITECTURE = ("n_layers", "hidden", "n_heads", "vocab_size", "ffn_hidden")
#: The shortest --timeout: ranks must first find each other (a TCP rendezvous) within it.
MIN_TIMEOUT_S = 1.0
#: The longest --timeout (about 31 years): torch's process groups count it in milliseconds
#: (a timedelta; gloo refuses 1e14 s, Python's timedelta anything past 8.6e13 s).
MAX_TIMEOUT_S = 1e9
#: Integers reach torch and numpy as int64: every integer field is below this.
INT_LIMIT = 2**63
PRECISIONS = tuple(ZERO_PRECISIONS)  # mt-zero's registry: fp32, bf16, fp16
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """The configuration is inconsistent; the message names every number involved."""


def _positive(problems: list[str], obj: object, *names: str, allow_none: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None and allow_none:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")


def _int64(problems: list[str], obj: object, *checked: str) -> None:
    """Every integer field of ``obj`` (but those ``checked`` on their own) below
    :data:`INT_LIMIT`: torch and numpy take them as int64, and a larger one overflowed there
    after the run started (a traceback). The lower bounds are each field's own check."""
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if f.name not in checked and isinstance(value, int) and not isinstance(value, bool) \
                and value >= INT_LIMIT:
            problems.append(f"--{f.name.replace('_', '-')} must be below 2**63, got {value}")


def _raise(problems: list[str], what: str) -> None:
    if problems:
        raise ConfigError(f"invalid {what}: " + "; ".join(problems))


@dataclass(frozen=True)
class ModelArgs:
    """The GPT to train: a preset, optionally reshaped."""

    model: str | None = None
    """Model preset: tiny (the default), gpt2-small, gpt2-medium, gpt2-large, gpt2-xl, 1.3b,
    8.3b, mt-nlg-530b (GPT-2 blocks); llama-test, llama-3.2-1b, llama-3.1-8b (the Llama
    family). With --load the checkpoint's model is used, and a preset given here (with any
    shape flags) must have its shape."""
    n_layers: int | None = None
    """Override the preset's number of transformer layers."""
    hidden: int | None = None
    """Override the preset's hidden size."""
    n_heads: int | None = None
    """Override the preset's number of attention heads."""
    vocab_size: int | None = None
    """Override the preset's vocabulary size (must hold every id of the tokenizer)."""
    seq_len: int | None = None
    """Training sequence length (default: the preset's, or with --load the checkpoint's
    position count; with --load it may be shorter than that)."""
    dropout: float | None = None
    """Dropout on embeddings, residual branches and attention probabilities (default: the
    preset's, 0 for tiny, or the checkpoint's)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        _positive(problems, self, "n_layers", "hidden", "n_heads", "vocab_size", "seq_len",
                  allow_none=True)
        _int64(problems, self)
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            problems.append(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.model is not None and not self.model.strip():
            problems.append("--model is empty: name a preset (tiny, gpt2-small, ...) or leave "
                            "it out for tiny")
        _raise(problems, "model arguments")

    def gpt_config(self) -> Any:
        """The resolved :class:`mt_model.GPTConfig` (raises ConfigError if inconsistent)."""
        from mt_model import GPTConfigError, preset

        try:
            base = preset(self.model or DEFAULT_MODEL)
            overrides: dict[str, Any] = {
                k: getattr(self, k) for k in ("n_layers", "hidden", "n_heads", "vocab_size",
                                              "seq_len") if getattr(self, k) is not None}
            if self.dropout is not None:
                overrides.update(dropout=self.dropout, attention_dropout=self.dropout)
            return base.replace(**overrides)
        except GPTConfigError as err:
            raise ConfigError(str(err)) from None

    def on_checkpoint(self, saved: Any, where: str) -> tuple[Any, int]:
        """(model, training sequence length) when resuming from a checkpoint whose model is
        ``saved`` (a GPTConfig; ``where`` names it in errors).

        The architecture is the checkpoint's. Flags may not change it: the model they
        resolve to (--model's preset with --n-layers / --hidden / --n-heads / --vocab-size
        applied, as for a new run) must have its shape, so the command line that started a
        run also resumes it; initialisation-only fields (init_std, scaled_output_init) never
        matter. --seq-len may be up to the checkpoint's positions; --dropout applies as given.
        """
        problems = []
        if self.model is not None:
            shape = dataclasses.replace(self, seq_len=None, dropout=None).gpt_config()
            flags = [f"--{k.replace('_', '-')} {getattr(self, k)}"
                     for k in ("n_layers", "hidden", "n_heads", "vocab_size")
                     if getattr(self, k) is not None]
            given = f"--model {self.model}" + (f" with {' '.join(flags)}" if flags else "")
            problems += [f"{given} has {k} {getattr(shape, k)}, the checkpoint "
                         f"{getattr(saved, k)}" for k in ARCHITECTURE
                         if getattr(shape, k) != getattr(saved, k)]
        else:
            for k in ("n_layers", "hidden", "n_heads", "vocab_size"):
                given = getattr(self, k)
                if given is not None and given != getattr(saved, k):
                    problems.append(f"--{k.replace('_', '-')} {given} but the checkpoint has "
                                    f"{getattr(saved, k)}")
        if self.seq_len is not None and self.seq_len > saved.seq_len:
            problems.append(f"--seq-len {self.seq_len} exceeds the checkpoint's "
                            f"{saved.seq_len} positions")
        if problems:
            raise ConfigError(f"--load {where}: flags change the checkpoint's model: "
                              + "; ".join(problems) + " (leave them out to use the "
                              "checkpoint's model)")
        model = saved
        if self.dropout is not None:
            model = saved.replace(dropout=self.dropout, attention_dropout=self.dropout)
        return model, self.seq_len or saved.seq_len


@dataclass(frozen=True)
class ParallelArgs:
    """Processes, the (TP, CP, PP, DP) layout and the engine."""

    nproc: int | None = None
    """Local processes to spawn when not under a launcher (torchrun, mpirun, srun). Default:
    tp x cp x pp x dp (dp 1 unless given). Ignored under a launcher."""
    min_nproc: int | None = None
    """Elastic --nproc run (with --max-restarts): a rank that fails is left out of the run
    (a GPU that failed is not trusted again) and the run continues from its newest
    checkpoint at the largest data-parallel degree the ranks left allow, down to this many
    processes, keeping the global batch (more micro-batches per rank) and the data order.
    Under torchrun the launcher sets the world size (--nnodes MIN:MAX): a job it restarts
    at another size continues at that size by itself."""
    tp: int = 1
    """Tensor-parallel degree (slices every layer; keep it inside a node)."""
    cp: int = 1
    """Context-parallel degree: each of cp ranks holds 2 chunks of every sequence (an early
    and a late one: equal causal work), keys and values are all-gathered over them in every
    layer; activations per rank / cp, for long sequences. --seq-len must divide by 2 x cp."""
    pp: int = 1
    """Pipeline-parallel degree (stages of consecutive layers)."""
    dp: int | None = None
    """Data-parallel degree (default: world size / (tp x cp x pp): the processes TP, CP and PP
    leave)."""
    zero_stage: int = 1
    """ZeRO stage: 0 plain data parallel, 1 shard optimizer state, 2 + gradients,
    3 + parameters."""
    schedule: str = DEFAULT_SCHEDULE
    """Pipeline schedule: gpipe, 1f1b or interleaved (ignored with --pp 1)."""
    virtual_stages: int = 1
    """Model chunks per pipeline stage (>= 2 with the interleaved schedule, which needs
    --pp >= 2)."""
    sequence_parallel: bool = False
    """Shard LayerNorm / dropout activations along the sequence over the TP group."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in backward instead of storing them (the same as
    --recompute full)."""
    recompute: str | None = None
    """What each layer recomputes in backward instead of keeping: none; selective (the
    outputs of the norms and the activation function, and the attention core when attention
    dropout makes it keep [b, heads, s, s] scores: a GPT-2 layer keeps 20 of its 32 sbh
    16-bit bytes, no matmul runs twice, same bits as none); full (everything: the layer
    keeps its input, and runs its forward twice). Default: full with
    --activation-checkpointing, else none."""
    chunked_loss: bool | None = None
    """Compute the output layer and the cross entropy together, a chunk of tokens at a time
    (64 MiB of float32 logits), recomputing each chunk's logits in backward: the
    [b, s, vocab / tp] logits, their float32 copies and their gradient are never held (3.3 GB
    each for 8 x 2048 tokens of GPT-2's vocabulary). Off: the logits, then the loss. Default:
    on with --engine mt, off with deepspeed (which computes the logits itself)."""
    main_grads: bool = True
    """With --precision bf16 / fp16: accumulate gradients over micro-batches and reduce them
    over data-parallel ranks in fp32 (Megatron-LM's main grads; DeepSpeed's
    grad_accum_dtype fp32). Costs 2 more bytes of gradient per parameter; off: 16-bit
    gradients, rounded at every addition."""
    compile: bool = False
    """Compile each stage's forward and loss with torch.compile (inductor): fuses the
    elementwise work, LayerNorms and the loss (6-18% more tokens/s on a 2-core CPU in
    benchmarks/train.py); the first step pays the compilation, seconds to a minute."""
    engine: str = "mt"
    """Training engine: mt (this toolkit) or deepspeed (DeepSpeed's engine around mt's model
    and TP layers: ZeRO 0-3 with --pp 1, ZeRO 0/1 with pipelines through DeepSpeed's
    PipelineModule and its 1F1B schedule; fp32 or bf16; needs `pip install deepspeed`). Each
    engine and what it refuses: the registry mt_pretrain.config.engines."""
    precision: str = "fp32"
    """Parameter and compute precision: fp32, bf16 or fp16 (fp32 master weights and
    optimizer state; fp16 uses dynamic loss scaling)."""
    device: str = "auto"
    """Device of each rank: cuda (GPU local_rank, NCCL), cpu (gloo), or auto (cuda when
    available)."""
    timeout: float = 300.0
    """Seconds a collective may wait for a peer before the run fails (a dead rank gives an
    error, not a hang)."""
    bucket_numel: int = 2**22
    """Gradient elements data parallelism reduces in one collective (mt: each bucket is
    launched as soon as its gradients exist, during the last micro-batch's backward;
    DeepSpeed: its reduce and all-gather bucket sizes). Larger buckets pay the fixed cost of
    a collective fewer times, smaller ones start reducing earlier under the backward: on
    gloo over CPU cores, which the backward itself needs, larger was faster
    (benchmarks/comm.py; 2**22 = mt-zero's default)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        _positive(problems, self, "tp", "cp", "pp", "virtual_stages", "bucket_numel")
        _positive(problems, self, "nproc", "dp", "min_nproc", allow_none=True)
        _int64(problems, self)
        if self.min_nproc is not None and self.nproc is not None and \
                self.min_nproc > self.nproc:
            problems.append(f"--min-nproc {self.min_nproc} exceeds --nproc {self.nproc}")
        if self.min_nproc is not None and self.nproc is None:
            problems.append(f"--min-nproc {self.min_nproc} makes a --nproc run elastic: give "
                            "--nproc N (the ranks it starts with)")
        if self.min_nproc is not None and self.dp is not None:
            problems.append(f"--min-nproc: an elastic run sets the data-parallel degree by "
                            f"the ranks it has; leave out --dp {self.dp}")
        schedule, virtual_stages = self.pipeline_options()
        problems += option_problems(zero_stage=self.zero_stage, schedule=schedule,
                                    virtual_stages=virtual_stages,
                                    recompute=self.recompute_mode, precision=self.precision)
        if self.engine not in ENGINES:
            problems.append(f"--engine must be one of {tuple(ENGINES)}, got {self.engine!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if not self.timeout >= MIN_TIMEOUT_S:
            problems.append(f"--timeout must be at least {MIN_TIMEOUT_S:g} seconds (the "
                            f"ranks must first connect to each other), got {self.timeout}")
        elif not self.timeout <= MAX_TIMEOUT_S:
            problems.append(f"--timeout must be at most {MAX_TIMEOUT_S:g} seconds (about 31 "
                            f"years), got {self.timeout}")
        problems += idle_option_problems(
            tp=self.tp, pp=self.pp, virtual_stages=self.virtual_stages,
            sequence_parallel=self.sequence_parallel, main_grads=self.main_grads,
            precision=self.precision)
        if self.activation_checkpointing and self.recompute not in (None, "full"):
            problems.append(f"--activation-checkpointing is --recompute full, not "
                            f"--recompute {self.recompute}: give one of them")
        if self.zero_stage == 3 and self.recompute_mode != "none":
            flag = ("--activation-checkpointing" if self.recompute is None else
                    f"--recompute {self.recompute}")
            problems.append(f"--zero-stage 3 with {flag} is not supported yet; use ZeRO stage "
                            "0-2 with recomputation")
        if self.compile and self.recompute_mode == "selective":
            problems.append("--compile with --recompute selective: torch.compile already "
                            "recomputes cheap operations where it saves memory (its "
                            "partitioner); use --recompute none or full with --compile")
        if self.zero_stage == 3 and self.compile:
            problems.append("--zero-stage 3 with --compile is not supported (parameters are "
                            "gathered in module hooks); use ZeRO stage 0-2 with --compile")
        if self.cp > 1 and self.compile:
            problems.append(f"--cp {self.cp} with --compile is not supported yet (the "
                            "context-parallel key/value exchange is not shown to compile); "
                            "leave out --compile")
        if self.zero_stage >= 2 and self.pp > 1:
            problems.append(f"--zero-stage {self.zero_stage} with --pp {self.pp}: gradient "
                            "sharding across pipeline micro-batches is not supported; use "
                            "--zero-stage 0 or 1 with pipeline parallelism")
        _raise(problems, "parallel arguments")

    @property
    def recompute_mode(self) -> str:
        """The layout's recomputation: --recompute, else full with --activation-checkpointing,
        else none."""
        if self.recompute is not None:
            return self.recompute
        return "full" if self.activation_checkpointing else "none"

    def pipeline_options(self) -> tuple[str, int]:
        """(schedule, chunks per stage) as the layout takes them: a one-stage run ignores
        both (the default schedule, one chunk) unless the schedule names none."""
        if self.pp > 1 or self.schedule not in SCHEDULES:
            return self.schedule, self.virtual_stages
        return DEFAULT_SCHEDULE, 1

    def layout(self, world_size: int, global_batch: int, micro_batch: int) -> ParallelLayout:
        """The run's one :class:`~mt_plan.layout.ParallelLayout` on ``world_size`` processes
        (raises :class:`~mt_plan.layout.LayoutError` or mt-dist's ``TopologyError``, naming
        the numbers); :func:`layout_flags` is its inverse."""
        from mt_dist import Topology  # torch: not for a config that is only read

        topology = Topology.from_world(world_size, tp=self.tp, pp=self.pp, cp=self.cp)
        schedule, virtual_stages = self.pipeline_options()
        return ParallelLayout(topology.tp, topology.pp, topology.dp, global_batch, micro_batch,
                              self.zero_stage, schedule, virtual_stages,
                              self.sequence_parallel, self.recompute_mode, self.precision,
                              self.chunked_loss if self.chunked_loss is not None
                              else ENGINES[self.engine].chunked_loss, self.main_grads,
                              topology.cp)


def layout_flags(layout: ParallelLayout) -> dict[str, Any]:
    """The flat config fields that give ``layout`` (the inverse of
    :meth:`ParallelArgs.layout`; the contract matrix runs its cases through it)."""
    return {"nproc": layout.world_size, "tp": layout.tp, "cp": layout.cp, "pp": layout.pp,
            "dp": layout.dp,
            "global_batch_size": layout.global_batch, "micro_batch_size": layout.micro_batch,
            "zero_stage": layout.zero_stage, "schedule": layout.schedule,
            "virtual_stages": layout.virtual_stages,
            "sequence_parallel": layout.sequence_parallel,
            "recompute": layout.recompute,
            "precision": layout.precision, "chunked_loss": layout.chunked_loss,
            "main_grads": layout.main_grads}


@dataclass(frozen=True)
class TrainArgs:
    """Batch sizes, length of training, optimizer and schedules."""

    micro_batch_size: int = 4
    """Sequences per micro-batch on one data-parallel rank."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all data-parallel ranks (must be divisible by
    micro-batch-size x dp)."""
    train_steps: int | None = None
    """Optimizer steps to train (default 300 unless --train-tokens is given)."""
    train_tokens: int | None = None
    """Train until this many tokens are consumed (instead of --train-steps)."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr: float | None = None
    """Learning-rate floor of the cosine decay (default: lr / 10, as MT-NLG)."""
    warmup_tokens: int | None = None
    """Tokens of linear warmup (default: 5% of the training tokens)."""
    decay_tokens: int | None = None
    """Tokens over which the cosine decays to --min-lr, counted from the start (default: all
    training tokens)."""
    weight_decay: float = 0.1
    """AdamW weight decay of matrices (biases and LayerNorms are not decayed)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2 (0.95 as MT-NLG)."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    rampup_start: int | None = None
    """Batch-size ramp-up: first global batch size (MT-NLG: 32)."""
    rampup_increment: int | None = None
    """Batch-size ramp-up: increment (MT-NLG: 32)."""
    rampup_tokens: int | None = None
    """Batch-size ramp-up: tokens over which the batch grows to --global-batch-size
    (MT-NLG: 12e9)."""
    exit_interval: int | None = None
    """Save a checkpoint and exit after every step divisible by this (Megatron's
    --exit-interval): split a long run into jobs of N steps, each the same command with
    --load; the schedule stays the whole run's."""
    exit_duration: float | None = None
    """Save a checkpoint and exit before this many minutes of wall time are used up (counted
    from the start; the next step and a save must fit): give a job's time limit."""
    seed: int = 1234
    """Seed of the initialization, the data shuffle and dropout."""
    eval_interval: int = 100
    """Compute the validation loss every this many steps (0: never)."""
    eval_iters: int = 2
    """Global batches of the validation split in one validation pass (the same samples
    whatever the layout)."""
    eval_task: str | None = None
    """Zero- or few-shot tasks to score during training, comma separated, as `mt eval` takes
    them: built-in names (mt-cloze, mt-choice, mt-perplexity), .jsonl or lm-eval .yaml files;
    their metrics go to the metrics JSONL and TensorBoard as eval/TASK/METRIC."""
    eval_task_interval: int = 0
    """Score --eval-task every this many steps (0: after the last step only)."""
    eval_task_limit: int | None = None
    """Score the first N documents of each --eval-task task (default: all)."""
    sample_tokens: int = 48
    """Tokens to generate greedily at the end of training (0: no sample)."""
    prompt: str = "The whale"
    """Prompt of the generated sample."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        _positive(problems, self, "micro_batch_size", "global_batch_size")
        _positive(problems, self, "train_steps", "train_tokens", "decay_tokens",
                  "rampup_start", "rampup_increment", "rampup_tokens", "exit_interval",
                  "eval_task_limit", allow_none=True)
        _int64(problems, self, "seed")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed < INT_LIMIT:
            problems.append(f"--seed must be between 0 and 2**63 - 1, got {self.seed!r}")
        if self.eval_task_interval < 0:
            problems.append(f"--eval-task-interval must be >= 0, got {self.eval_task_interval}")
        if isinstance(self.prompt, str) and (why := not_utf8(self.prompt)):
            problems.append(f"--prompt holds {why}: give UTF-8 text")
        if self.exit_duration is not None and not self.exit_duration > 0:
            problems.append(f"--exit-duration must be > 0 minutes, got {self.exit_duration}")
        elif self.exit_duration == math.inf:
            problems.append("--exit-duration must be a finite number of minutes, got inf "
                            "(leave it out to run to the end)")
        if self.warmup_tokens is not None and self.warmup_tokens < 0:
            problems.append(f"--warmup-tokens must be >= 0, got {self.warmup_tokens}")
        if self.train_steps is not None and self.train_tokens is not None:
            problems.append(f"give --train-steps ({self.train_steps}) or --train-tokens "
                            f"({self.train_tokens}), not both")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            problems.append(f"--lr must be a finite number > 0, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            problems.append(f"--min-lr {self.min_lr} must be in [0, lr {self.lr}]")
        for name in ("weight_decay", "clip_grad"):
            if not 0 <= getattr(self, name) < math.inf:
                problems.append(f"--{name.replace('_', '-')} must be >= 0, got "
                                f"{getattr(self, name)}")
        if not 0 < self.adam_eps < math.inf:  # 0: a parameter whose gradient is 0 gets 0/0
            problems.append(f"--adam-eps must be > 0 (Adam divides by sqrt(v) + eps), got "
                            f"{self.adam_eps}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be in [0, 1)")
        ramp = (self.rampup_start, self.rampup_increment, self.rampup_tokens)
        if any(v is not None for v in ramp) and any(v is None for v in ramp):
            problems.append(f"batch-size ramp-up needs --rampup-start, --rampup-increment and "
                            f"--rampup-tokens together, got {ramp}")
        elif self.rampup_start is not None:
            start, inc = self.rampup_start, self.rampup_increment or 1
            if start > self.global_batch_size or (self.global_batch_size - start) % inc:
                problems.append(f"ramp-up from {start} by {inc} does not reach global batch "
                                f"size {self.global_batch_size} in whole increments")
        if self.eval_task is not None and not self.eval_tasks:
            problems.append(f"--eval-task {self.eval_task!r} names no task; give task names or "
                            "files, comma separated, or leave it out")
        if self.eval_interval < 0 or self.eval_iters < 0 or self.sample_tokens < 0:
            problems.append(f"--eval-interval ({self.eval_interval}), --eval-iters "
                            f"({self.eval_iters}) and --sample-tokens ({self.sample_tokens}) "
                            "must be >= 0")
        _raise(problems, "training arguments")

    @property
    def eval_tasks(self) -> tuple[str, ...]:
        """The --eval-task tasks, in order."""
        return tuple(t.strip() for t in (self.eval_task or "").split(",") if t.strip())

    @property
    def rampup(self) -> tuple[int, int, int] | None:
        """(start, increment, tokens) or None."""
        if self.rampup_start is None:
            return None
        return (self.rampup_start, self.rampup_increment or 1, self.rampup_tokens or 0)


@dataclass(frozen=True)
class DataArgs:
    """Training data."""

    data: str | None = None
    """Prepared dataset folder (`mt data prepare`), a blend such as '0.7 dirA 0.3 dirB', or
    a file holding a blend. Default: the embedded corpus (Moby-Dick + State of the Union),
    tokenized once into the cache directory."""
    tokenizer: str | None = None
    """Tokenizer of the embedded corpus: tokenizer-1k (default when the vocabulary is below
    50257), gpt2, or a tokenizer.json."""
    split: str = "969,30,1"
    """Train / validation / test split weights by document (Megatron style)."""
    cache_dir: str | None = None
    """Where the embedded corpus is tokenized (default: $MT_CACHE_DIR, else
    $XDG_CACHE_HOME/mt, else ~/.cache/mt)."""

    def __post_init__(self) -> None:
        parts = [p for p in self.split.replace("/", ",").split(",") if p.strip()]
        try:
            ok = len(parts) == 3 and all(0 <= float(p) < math.inf for p in parts) and sum(
                float(p) for p in parts) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"--split must be three weights like '969,30,1', got "
                              f"{self.split!r}")


@dataclass(frozen=True)
class CheckpointArgs:
    """Checkpoints: where the run saves, how often, how many it keeps, where it resumes."""

    out_dir: str = "mt-run"
    """Run folder: checkpoints and metrics go here unless --save / --metrics say otherwise."""
    save: str | None = None
    """Checkpoint folder (default: OUT_DIR/checkpoints; 'none' disables saving)."""
    save_interval: int = 0
    """Save every this many steps (0: only at the end and on SIGTERM/SIGINT)."""
    keep_last: int = 2
    """Keep this many most recent checkpoints."""
    async_save: bool = False
    """Write the checkpoints of --save-interval in the background: the ranks copy their
    state to host memory (kept from save to save; pinned on CUDA) and training goes on while
    a writer process of each rank writes, checksums and publishes it; a save waits for the
    one before it, and the saves that end a run (its last step, a signal, --exit-*) are
    written in the foreground. A crash during a write leaves the previous checkpoint the
    newest."""
    max_restarts: int = 0
    """Restart the run by itself, at most this many times, when a rank dies, hangs past
    --timeout or raises what no one expected: the ranks are stopped and the run resumes from
    its newest complete checkpoint (from step 0 if it saved none yet), each restart one line
    and a `restart` field in the metrics. For --nproc runs; under torchrun use its
    --max-restarts (a restarted torchrun or requeued SLURM job resumes from --save by
    itself)."""
    load: str | None = None
    """Resume from this checkpoint folder (its `latest`) or one step folder; the layout may
    differ from the saved one (with --engine deepspeed it must be the same). The run's own
    checkpoint folder may be given before it holds any: the run then starts from step 0, so
    the jobs of a chain can all run the same command."""
    overwrite: bool = False
    """Start a new run in a run folder that holds a previous one (checkpoints or metrics):
    delete them first. Without it such a run is refused, offering --load."""
    def __post_init__(self) -> None:
        problems: list[str] = []
        _positive(problems, self, "keep_last")
        _int64(problems, self)
        if self.save_interval < 0:
            problems.append(f"--save-interval must be >= 0, got {self.save_interval}")
        if self.max_restarts < 0:
            problems.append(f"--max-restarts must be >= 0, got {self.max_restarts}")
        elif self.max_restarts and self.save_dir is None:
            problems.append(f"--max-restarts {self.max_restarts} resumes from the run's "
                            "checkpoints, and --save none keeps none: a restart would start "
                            "over at step 0; save (--save-interval N) or leave out "
                            "--max-restarts")
        if self.async_save and self.save_dir is None:
            problems.append("--async-save writes checkpoints in the background, and --save "
                            "none keeps none: leave out one of them")
        elif self.async_save and not self.save_interval:
            problems.append("--async-save writes the checkpoints of --save-interval in the "
                            "background, and --save-interval 0 saves only when the run ends "
                            "(in the foreground): give --save-interval N or leave out "
                            "--async-save")
        _raise(problems, "checkpoint arguments")

    def resuming_own(self) -> CheckpointArgs:
        """These arguments continuing the run from its own checkpoint folder (a restart):
        ``--load`` the save folder, nothing deleted."""
        return dataclasses.replace(self, load=str(self.save_dir), overwrite=False)

    @property
    def save_dir(self) -> Path | None:
        """Resolved checkpoint folder (None: saving disabled)."""
        if self.save is not None and self.save.lower() == "none":
            return None
        return Path(self.save) if self.save else Path(self.out_dir) / "checkpoints"


@dataclass(frozen=True)
class LogArgs:
    """What the run reports: printed lines, metrics file, TensorBoard, W&B, the MFU's peak
    (with --dry-run: the plan alone, and no training)."""

    metrics: str | None = None
    """Metrics JSONL, one object per step (default: OUT_DIR/metrics.jsonl; 'none'
    disables)."""
    tensorboard: bool = False
    """Also write TensorBoard events to OUT_DIR/tensorboard (needs the tensorboard
    package)."""
    wandb_project: str | None = None
    """Also log the metrics (and the config) to this Weights & Biases project (needs the
    wandb package: pip install 'mt-pretrain[wandb]'); its files go to OUT_DIR/wandb, and a
    resumed run continues the same W&B run. Online or offline as wandb's own settings say
    (WANDB_MODE=offline writes locally; `wandb sync` uploads later)."""
    wandb_name: str | None = None
    """Name of the W&B run (default: the run folder's name)."""
    log_interval: int = 10
    """Print a log line every this many steps (when no progress bar is shown)."""
    progress: bool = True
    """Show a progress bar on rank 0 when the output is a terminal."""
    log_level: str = "info"
    """What rank 0 prints: error (errors only), warning (also warnings and the end-of-run
    summary), info (also the banner, progress, log and validation lines) or debug (also
    one line per rank saying where it sits, and a log line every step instead of the bar).
    The metrics file gets every step whatever the level."""
    quiet: bool = False
    """Same as --log-level warning."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one rank's device, the denominator of the MFU (model FLOPs
    utilization) shown next to tokens/s and written as `mfu` in the metrics; default:
    measured once at start by a short matmul probe in the compute precision on rank 0."""
    straggler_steps: int = 20
    """Each step every rank times its own work (forward, backward and optimizer step, less
    its waits for peers in data-parallel collectives); a rank whose median over this many
    steps exceeds --straggler-factor times its data-parallel peers' (the ranks holding the
    same layers) is named in one line and in the metrics (`stragglers`), once until it
    recovers. Per-rank times are in the metrics as `busy_s_per_rank`. 0: off."""
    straggler_factor: float = 1.5
    """How much slower than its peers a rank must be to be named (see --straggler-steps)."""
    trace_collectives: bool = False
    """Record every collective of every step on every rank (kind, group, bytes, when it was
    launched, how long the rank was blocked in it, how long it was in flight): the step's
    totals in the metrics (rank 0's: `collectives`, `comm_bytes`, `comm_exposed_s`,
    `comm_hidden_s`), each collective in OUT_DIR/collectives/rank-N.jsonl. Exposed
    communication measured, not guessed; costs a few microseconds per collective."""
    dry_run: bool = False
    """Validate the config and layout and print the plan (ranks, groups, stages, memory
    estimate) without training."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        _positive(problems, self, "log_interval")
        if self.straggler_steps < 0:
            problems.append(f"--straggler-steps must be >= 0, got {self.straggler_steps}")
        if not 1.0 < self.straggler_factor < math.inf:
            problems.append(f"--straggler-factor must be a finite number above 1 (1.5: 50% "
                            f"slower than its peers), got {self.straggler_factor}")
        _int64(problems, self)
        if self.quiet and self.log_level != "info":
            problems.append(f"--quiet is --log-level warning; give one of them, not --quiet "
                            f"with --log-level {self.log_level}")
        if self.log_level not in LOG_LEVELS:
            problems.append(f"--log-level must be one of {', '.join(LOG_LEVELS)}, "
                            f"got {self.log_level!r}")
        if self.wandb_project is not None and not self.wandb_project.strip():
            problems.append("--wandb-project must name a project, got an empty string")
        if self.wandb_name is not None and self.wandb_project is None:
            problems.append(f"--wandb-name {self.wandb_name!r} names a Weights & Biases run, "
                            "and no --wandb-project logs to one: give --wandb-project too")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            problems.append(f"--peak-tflops must be > 0, got {self.peak_tflops}")
        elif self.peak_tflops == math.inf:
            problems.append("--peak-tflops must be a finite number, got inf")
        _raise(problems, "logging arguments")

    @property
    def level(self) -> str:
        """The effective log level (--quiet is --log-level warning)."""
        return "warning" if self.quiet else self.log_level

    def says(self, level: str) -> bool:
        """Whether lines of ``level`` are printed at this run's log level."""
        return LOG_LEVELS.index(level) >= LOG_LEVELS.index(self.level)


SECTIONS: dict[str, type] = {
    "model": ModelArgs,
    "parallel": ParallelArgs,
    "train": TrainArgs,
    "data": DataArgs,
    "checkpoint": CheckpointArgs,
    "log": LogArgs,
}


@dataclass(frozen=True)
class PretrainConfig:
    """Everything `mt pretrain` needs, one section per concern."""

    model: ModelArgs = field(default_factory=ModelArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    data: DataArgs = field(default_factory=DataArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    log: LogArgs = field(default_factory=LogArgs)

    def __post_init__(self) -> None:
        self.model.gpt_config()  # raises ConfigError for a bad shape
        if self.train.eval_interval and self.train.eval_iters == 0:
            _raise(["--eval-interval needs --eval-iters >= 1"], "configuration")
        if self.parallel.min_nproc is not None and not self.checkpoint.max_restarts:
            _raise([f"--min-nproc {self.parallel.min_nproc} continues after a rank fails, "
                    "which is a restart: give --max-restarts N (how many failures the run "
                    "may survive)"], "configuration")
        if self.parallel.cp > 1 and self.train.eval_tasks:
            _raise([f"--eval-task with --cp {self.parallel.cp} is not supported (task scoring "
                    "runs whole sequences on each rank); score the checkpoint after training "
                    "with `mt eval`"], "configuration")

    @property
    def metrics_path(self) -> Path | None:
        """Resolved metrics file (None: disabled); by default in the run folder."""
        metrics = self.log.metrics
        if metrics is not None and metrics.lower() == "none":
            return None
        return Path(metrics) if metrics else Path(self.checkpoint.out_dir) / "metrics.jsonl"

    def world_size_hint(self) -> int:
        """World size implied by the config alone (a launcher may say otherwise)."""
        p = self.parallel
        if p.nproc is not None:
            return p.nproc
        return p.tp * p.cp * p.pp * (p.dp or 1)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (YAML / JSON)."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
