"""`mt pretrain --eval-task`: mt-eval's tasks scored by the training run's own stages (any
engine, any layout: the engine gathers its parameters; DP replicas share the requests)."""

from __future__ import annotations

from collections.abc import Callable

from mt_data import Tokenizer
from mt_dist import ParallelGroups
from mt_eval import evaluate, load_tasks
from mt_inference.scorer import StageScorer
from mt_pretrain.config.resolve import RunPlan
from mt_pretrain.config.schema import TrainArgs
from mt_pretrain.engines.base import Engine
from mt_zero.precision import compute_dtype

__all__ = ["task_scorer"]

#: Requests per forward pass during training (small: the run's activations are resident).
BATCH_SIZE = 8


def task_scorer(train: TrainArgs, plan: RunPlan, groups: ParallelGroups, engine: Engine,
                tokenizer: Tokenizer) -> Callable[[], dict[str, float]]:
    """A function that scores ``train.eval_tasks`` now (collective) and returns their
    metrics by ``TASK/METRIC``; requests hold at most the training sequence length."""
    tasks = load_tasks(train.eval_tasks)
    gpt = plan.gpt
    scorer = StageScorer(engine.stage, groups, gpt.vocab_size, gpt.seq_len,
                         compute_dtype(plan.layout.precision), gpt.hidden,
                         sequence_parallel=plan.layout.sequence_parallel)

    def score() -> dict[str, float]:
        with engine.gathered():
            results = evaluate(tasks, tokenizer.encode, tokenizer.eod_id, scorer,
                               limit=train.eval_task_limit, batch_size=BATCH_SIZE)
        return {f"{r.name}/{metric}": value for r in results
                for metric, value in r.metrics.items()}

    return score
