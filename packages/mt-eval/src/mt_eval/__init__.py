"""mt-eval: zero- and few-shot evaluation of language models, the way MT-NLG reported its
results and lm-evaluation-harness computes them.

Tasks in lm-eval's YAML format (the log-likelihood kinds), JSONL files or built in
(:mod:`mt_eval.builtin`, from the embedded corpus' held-out documents) become token requests
exactly as lm-eval's HF backend builds them (few-shot examples, the context / continuation
split, rolling windows); any :class:`Scorer` scores them in batches sorted by length; the
metrics (acc, acc_norm, perplexity, word/byte perplexity, bits per byte) and their standard
errors are lm-eval's. The package knows no model: ``mt eval`` and ``mt pretrain
--eval-task`` plug in mt's pipeline stages at any TP x PP x DP layout.
"""

from mt_eval.builtin import BUILTIN, builtin_task
from mt_eval.errors import TaskError
from mt_eval.load import load_task, load_tasks
from mt_eval.metrics import aggregate, mean_stderr
from mt_eval.requests import Request, build_requests, encode_pair, rolling_windows
from mt_eval.results import results_json, results_table, write_json
from mt_eval.runner import Scorer, TaskResult, batches_by_length, evaluate
from mt_eval.tasks import DEFAULT_METRICS, OUTPUT_TYPES, Task

__all__ = [
    "BUILTIN",
    "DEFAULT_METRICS",
    "OUTPUT_TYPES",
    "Request",
    "Scorer",
    "Task",
    "TaskError",
    "TaskResult",
    "aggregate",
    "batches_by_length",
    "build_requests",
    "builtin_task",
    "encode_pair",
    "evaluate",
    "load_task",
    "load_tasks",
    "mean_stderr",
    "results_json",
    "results_table",
    "rolling_windows",
    "write_json",
]
