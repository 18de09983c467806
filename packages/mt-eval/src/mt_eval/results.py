"""Results as a person reads them (a rich table) and as programs read them (JSON, written
atomically): ``{"results": {task: {metric: value, metric_stderr: value}}, "config": {...},
"samples": {task: [...]}}`` (samples only when asked)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from mt_eval.runner import TaskResult

__all__ = ["results_json", "results_table", "write_json"]


def results_json(results: Sequence[TaskResult], config: dict[str, Any],
                 samples: bool = False) -> dict[str, Any]:
    """The JSON document of an evaluation."""
    data: dict[str, Any] = {"results": {}, "config": config}
    for result in results:
        entry: dict[str, Any] = {"output_type": result.output_type, "num_fewshot": result.shots,
                                 "documents": result.documents}
        for metric, value in result.metrics.items():
            entry[metric] = value
            entry[f"{metric}_stderr"] = result.stderr.get(metric)
        data["results"][result.name] = entry
    if samples:
        data["samples"] = {r.name: r.samples for r in results}
    return data


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write ``data`` to ``path`` atomically (a temporary file in the folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
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
