"""The one error of mt-eval: a task that cannot be read or scored, named with its file,
line and field."""

from __future__ import annotations

__all__ = ["TaskError", "yaml_problem"]


class TaskError(ValueError):
    """A task file, document or request that mt-eval cannot use (the message names it)."""


def yaml_problem(err: Exception) -> str:
    """A YAML parser's error in one line: where (line, column) and what went wrong."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(err, "problem", None) or (str(err).splitlines() or ["unreadable"])[0]
    return where + problem
