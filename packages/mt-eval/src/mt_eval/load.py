"""Tasks by name: a built-in task, a YAML task file or a JSONL file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mt_eval.builtin import BUILTIN, builtin_task
from mt_eval.errors import TaskError
from mt_eval.tasks import Task, jsonl_task, yaml_task

__all__ = ["load_task", "load_tasks"]


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


def load_tasks(specs: Sequence[str]) -> list[Task]:
    """The tasks named by ``specs`` (:func:`load_task`), no two of one name: results are
    keyed by task name, where the second would replace the first."""
    tasks: list[Task] = []
    seen: dict[str, str] = {}
    for spec in specs:
        task = load_task(spec)
        if task.name in seen and seen[task.name] == spec:
            raise TaskError(f"{spec} is given twice: give each task once")
        if task.name in seen:
            raise TaskError(f"{spec}: its task name {task.name!r} is also {seen[task.name]}'s; "
                            "the results are keyed by task name: rename one")
        seen[task.name] = spec
        tasks.append(task)
    return tasks
