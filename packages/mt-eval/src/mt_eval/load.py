"""Tasks by name: a built-in task, a YAML task file or a JSONL file."""

from __future__ import annotations

from pathlib import Path

from mt_eval.builtin import BUILTIN, builtin_task
from mt_eval.errors import TaskError
from mt_eval.tasks import Task, jsonl_task, yaml_task

__all__ = ["load_task"]


def load_task(spec: str) -> Task:
    """The task named by ``spec``: a built-in name, a ``.yaml``/``.yml`` or a ``.jsonl``."""
    if spec in BUILTIN:
        return builtin_task(spec)
    path = Path(spec)
    if path.suffix in (".yaml", ".yml"):
        return yaml_task(path)
    if path.suffix in (".jsonl", ".json"):
        return jsonl_task(path)
    raise TaskError(f"unknown task {spec!r}: built-in tasks are {', '.join(BUILTIN)}; or pass "
                    "a .yaml task file or a .jsonl file")
