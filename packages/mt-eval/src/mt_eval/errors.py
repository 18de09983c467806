"""The one error of mt-eval: a task that cannot be read or scored, named with its file,
line and field."""

from __future__ import annotations

from functools import cache
from typing import Any

__all__ = ["TaskError", "unique_keys_loader", "yaml_problem"]


class TaskError(ValueError):
    """A task file, document or request that mt-eval cannot use (the message names it)."""


def yaml_problem(err: Exception) -> str:
    """A YAML parser's error in one line: where (line, column) and what went wrong."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(err, "problem", None) or (str(err).splitlines() or ["unreadable"])[0]
    return where + problem


@cache
def unique_keys_loader() -> type:
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    one silently, and the first is then ignored): a ``yaml.constructor.ConstructorError``
    naming the key and its line (:func:`yaml_problem` words it)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: set[Any] = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # << may be overridden
                        continue
                    key = self.construct_object(key_node, deep=deep)
                    try:
                        twice = key in seen
                        seen.add(key)
                    except TypeError:  # an unhashable key: PyYAML's own error says it
                        continue
                    if twice:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"{key} is given twice; keep one",
                            key_node.start_mark)
            return super().construct_mapping(node, deep)

    return UniqueKeys
