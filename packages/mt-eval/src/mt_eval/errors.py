"""The one error of mt-eval: a task that cannot be read or scored, named with its file,
line and field."""

from __future__ import annotations

__all__ = ["TaskError"]


class TaskError(ValueError):
    """A task file, document or request that mt-eval cannot use (the message names it)."""
