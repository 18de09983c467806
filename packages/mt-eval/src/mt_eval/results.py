"""Results as a person reads them (a rich table) and as programs read them: lm-evaluation-
harness's results JSON (written atomically), so that what reads lm-eval's results (its
``make_table``, leaderboards, plotting scripts) reads mt's:
``{"results": {task: {"alias", "acc,none", "acc_stderr,none", ...}}, "configs", "versions",
"n-shot", "higher_is_better", "n-samples", "config", "samples"}`` (samples only when asked,
each with lm-eval's ``resps`` beside mt's ``loglikelihoods`` and ``is_greedy``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from mt_data.shards import atomic_write_json
from mt_eval.runner import TaskResult

__all__ = ["HIGHER_IS_BETTER", "results_json", "results_table", "write_json"]

#: Whether a larger value is better, per metric (lm-eval's ``higher_is_better``).
HIGHER_IS_BETTER = {"acc": True, "acc_norm": True, "perplexity": False,
                    "word_perplexity": False, "byte_perplexity": False,
                    "bits_per_byte": False}
FILTER = "none"  # lm-eval's metric key suffix: mt applies no filter


def _version(result: TaskResult) -> Any:
    metadata = result.config.get("metadata")
    return metadata.get("version") if isinstance(metadata, dict) else None


def _sample(sample: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's per-document record (``resps``: [[log-likelihood, is_greedy]] per request)
    with mt's keys kept."""
    pairs = [[ll, greedy] for ll, greedy in zip(sample["loglikelihoods"], sample["is_greedy"],
                                               strict=True)]
    return {**sample, "resps": [[p] for p in pairs], "filtered_resps": pairs}


def results_json(results: Sequence[TaskResult], config: dict[str, Any],
                 samples: bool = False) -> dict[str, Any]:
    """The JSON document of an evaluation, in lm-evaluation-harness's schema."""
    data: dict[str, Any] = {"results": {}, "group_subtasks": {}, "configs": {},
                            "versions": {}, "n-shot": {}, "higher_is_better": {},
                            "n-samples": {}, "config": config}
    for result in results:
        name = result.name
        entry: dict[str, Any] = {"alias": name, "sample_len": result.documents}
        for metric, value in result.metrics.items():
            error = result.stderr.get(metric)
            entry[f"{metric},{FILTER}"] = value
            entry[f"{metric}_stderr,{FILTER}"] = "N/A" if error is None else error
        data["results"][name] = entry
        data["configs"][name] = result.config
        data["versions"][name] = _version(result)
        data["n-shot"][name] = result.shots
        data["higher_is_better"][name] = {m: HIGHER_IS_BETTER.get(m, True)
                                          for m in result.metrics}
        data["n-samples"][name] = {"original": result.available or result.documents,
                                   "effective": result.documents}
    if samples:
        data["samples"] = {r.name: [_sample(s) for s in r.samples] for r in results}
    return data


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write ``data`` to ``path`` atomically and durably (mt-data's writer: a temporary file,
    fsync, rename, fsync of the folder), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, data)
    return path


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if abs(value) < 1000:
        return f"{value:.4f}"
    return f"{value:,.1f}" if abs(value) < 1e6 else f"{value:.3e}"


def results_table(results: Sequence[TaskResult]) -> Table:
    """One row per (task, metric): shots, documents, value and standard error."""
    table = Table(title="mt eval")
    for column, justify in (("task", "left"), ("shots", "right"), ("docs", "right"),
                            ("metric", "left"), ("value", "right"), ("stderr", "right")):
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for result in results:
        for i, (metric, value) in enumerate(result.metrics.items()):
            table.add_row(result.name if i == 0 else "", str(result.shots) if i == 0 else "",
                          str(result.documents) if i == 0 else "", metric, _fmt(value),
                          _fmt(result.stderr.get(metric)))
    return table
