"""One rank of `mt eval`: process groups -> this rank's stage of the checkpoint's model at
the asked TP x PP layout (DP takes the processes left) -> tasks -> scores -> results.

Every rank reads the checkpoint's full weights and keeps its own TP slice of its stage's
parameters (so any saved layout evaluates at any other); every rank builds the same requests,
and the scores reach every rank, so rank 0 reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from mt_data import load_tokenizer
from mt_dist import (
    LaunchInfo,
    Topology,
    TopologyError,
    build_groups,
    finalize_distributed,
    init_distributed,
    local_device,
)
from mt_eval import TaskResult, evaluate, load_task
from mt_pipeline import PipelineConfig, plan_pipeline
from mt_pretrain.config.schema import ConfigError
from mt_pretrain.engines.build import materialize_stage
from mt_pretrain.evaluation.model import EvalModel, load_eval_model
from mt_pretrain.evaluation.scorer import StageScorer
from mt_tensor_parallel import check_divisibility
from mt_zero.precision import compute_dtype

__all__ = ["EvalSpec", "eval_rank"]


@dataclass(frozen=True)
class EvalSpec:
    """One `mt eval` run (the command's options)."""

    checkpoint: str
    tasks: tuple[str, ...]
    shots: int | None = None
    fewshot_seed: int = 1234
    batch_size: int = 16
    limit: int | None = None
    tp: int = 1
    pp: int = 1
    nproc: int = 1
    device: str = "auto"
    precision: str = "fp32"
    tokenizer: str | None = None
    progress: bool = True
    timeout: float = 600.0


def check_layout(spec: EvalSpec, model: EvalModel, world_size: int) -> Topology:
    """The evaluation's topology, or a ConfigError naming the numbers at fault."""
    try:
        topology = Topology.from_world(world_size, tp=spec.tp, pp=spec.pp)
        check_divisibility(tp=spec.tp, n_heads=model.config.n_heads, hidden=model.config.hidden,
                           ffn_hidden=model.config.ffn_hidden, seq_len=model.config.seq_len,
                           sequence_parallel=False)
    except (TopologyError, ValueError) as err:
        raise ConfigError(f"invalid layout: {err}") from None
    if spec.pp > model.config.n_layers:
        raise ConfigError(f"invalid layout: pp {spec.pp} exceeds the model's "
                          f"{model.config.n_layers} layers")
    return topology


@contextmanager
def _progress_bar(show: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar over requests (rank 0, when asked), as a ``progress(done, total)``
    callback."""
    if not show:
        yield None
        return
    with Progress(TextColumn("scoring"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("requests", total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=min(done, total), total=total)

        yield update


def eval_rank(spec: EvalSpec, info: LaunchInfo) -> list[TaskResult] | None:
    """Evaluate as rank ``info.rank``; returns the results on rank 0, None elsewhere."""
    use_cuda = {"auto": None, "cpu": False, "cuda": True}[spec.device]
    device = local_device(info, use_cuda=use_cuda)
    model = load_eval_model(spec.checkpoint, spec.tokenizer)
    topology = check_layout(spec, model, info.world_size)
    tasks = [load_task(name) for name in spec.tasks]
    tokenizer = load_tokenizer(model.tokenizer)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConfigError(f"tokenizer {model.tokenizer} has {tokenizer.vocab_size} ids, more "
                          f"than the model's vocabulary of {model.config.vocab_size}")
    init_distributed(info, device, timeout=spec.timeout)
    completed = False
    try:
        groups = build_groups(topology, device, timeout=spec.timeout)
        gpt = model.config
        stages = plan_pipeline(PipelineConfig("1f1b", 1), gpt.n_layers, topology.pp)
        dtype = compute_dtype(spec.precision)
        built = materialize_stage(gpt, stages.stages[groups.pp_rank], groups, topology.tp,
                                  lambda name, _shape: model.weights[name], seed=0,
                                  sequence_parallel=False, device=device)
        built.stage.to(dtype)
        scorer = StageScorer(built.stage, groups, gpt.vocab_size, gpt.seq_len, dtype,
                             gpt.hidden)
        with _progress_bar(spec.progress and groups.rank == 0) as progress:
            results = evaluate(tasks, tokenizer.encode, tokenizer.eod_id, scorer, spec.shots,
                               spec.fewshot_seed, spec.limit, spec.batch_size, progress)
        completed = True
        return results if groups.rank == 0 else None
    finally:
        finalize_distributed(completed=completed)
