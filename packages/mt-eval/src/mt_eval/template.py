"""Fields of a task document as lm-evaluation-harness renders them.

A ``doc_to_text`` / ``doc_to_choice`` / ``doc_to_target`` / ``description`` spec is a
document field name, a Jinja template (strict: an unknown name is an error), a constant (int
or list), exactly as in lm-eval's task YAML. The same conversions apply: a rendered target
of digits is a choice index when the task has choices, a rendered ``[...]`` is a Python
literal.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import jinja2

from mt_eval.errors import TaskError

__all__ = ["render_choices", "render_description", "render_target", "render_text"]


def _regex_replace(string: str, pattern: str, repl: str, count: int = 0) -> str:
    return re.sub(pattern, repl, string, count=count)


_ENV = jinja2.Environment(loader=jinja2.BaseLoader(), undefined=jinja2.StrictUndefined,
                          keep_trailing_newline=True)
_ENV.filters["regex_replace"] = _regex_replace


def _render(spec: str, doc: dict[str, Any], where: str) -> str:
    try:
        return _ENV.from_string(spec).render(**doc)
    except jinja2.TemplateError as err:
        raise TaskError(f"{where}: template {spec!r}: {err}") from None


def render_text(spec: Any, doc: dict[str, Any], has_choices: bool, where: str) -> str | int:
    """``doc_to_text`` of ``doc``."""
    if isinstance(spec, int):
        return spec
    if isinstance(spec, str):
        if spec in doc:
            return doc[spec]
        text = _render(spec, doc, where)
        return ast.literal_eval(text) if text.isdigit() and has_choices else text
    raise TaskError(f"{where}: doc_to_text must be a field name or a template, got {spec!r}")


def render_description(spec: str, doc: dict[str, Any], where: str) -> str:
    """``description`` of ``doc`` (lm-eval renders it for each evaluated document): a field
    name or a template; "" when unset."""
    if not spec:
        return ""
    text = doc[spec] if spec in doc else _render(spec, doc, where)
    if not isinstance(text, str):
        raise TaskError(f"{where}: description {spec!r} gave {text!r}, not text")
    return text


def render_target(spec: Any, doc: dict[str, Any], has_choices: bool,
                  where: str) -> str | int | list[Any]:
    """``doc_to_target`` of ``doc``: a string, a choice index, or a list of either."""
    if isinstance(spec, (int, list)):
        return spec
    if isinstance(spec, str):
        if spec in doc:
            return doc[spec]
        text = _render(spec, doc, where)
        if text.isdigit() and has_choices:
            return ast.literal_eval(text)
        if len(text) >= 2 and text[0] == "[" and text[-1] == "]":
            try:
                return ast.literal_eval(text)
            except (SyntaxError, ValueError):
                return text
        return text
    raise TaskError(f"{where}: doc_to_target must be a field name, a template, an int or a "
                    f"list, got {spec!r}")


def render_choices(spec: Any, doc: dict[str, Any], where: str) -> list[str]:
    """``doc_to_choice`` of ``doc``: the list of answer strings."""
    if isinstance(spec, list):
        choices = spec
    elif isinstance(spec, str):
        if spec in doc:
            choices = doc[spec]
        else:
            text = _render(spec, doc, where)
            try:
                choices = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                raise TaskError(f"{where}: doc_to_choice {spec!r} rendered {text!r}, not a "
                                "list literal") from None
    else:
        raise TaskError(f"{where}: doc_to_choice must be a field name, a template or a list, "
                        f"got {spec!r}")
    if not isinstance(choices, list) or not choices or \
            not all(isinstance(c, str) for c in choices):
        raise TaskError(f"{where}: the choices must be a non-empty list of strings, got "
                        f"{choices!r}")
    return choices
