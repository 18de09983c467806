"""The config's fields as the command line sees them: one flat name per field, and the
attribute docstring that becomes its --help text. Pure (reads only the schema's source), so
that `mt --help` builds every flag without importing torch."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import fields
from functools import cache

from mt_pretrain.config.schema import SECTIONS

__all__ = ["field_docs", "flat_fields"]


@cache
def flat_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Flat field name -> (section, dataclass field), for every section."""
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            assert f.name not in out, f"duplicate config field {f.name}"
            out[f.name] = (section, f)
    return out


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right after each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
