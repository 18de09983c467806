"""Loading `mt pretrain` configs: YAML (sections or flat keys) + flat overrides, and the
attribute docstrings that become --help text."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import textwrap
from collections.abc import Mapping
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any

from mt_pretrain.config import SECTIONS, ConfigError, PretrainConfig

__all__ = ["build_config", "field_docs", "flat_fields", "load_config"]


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


def _coerce(name: str, value: Any, f: dataclasses.Field) -> Any:
    """YAML gives '1e9' as a string and 5 for a float: convert to the field's type."""
    kind = str(f.type)
    if value is None:
        return None
    if kind.startswith("int") and isinstance(value, (str, float)) and not isinstance(
            value, bool):
        number = float(value)
        if not math.isfinite(number) or number != int(number):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return int(number)
    if kind.startswith("float") and isinstance(value, (int, str)) and not isinstance(
            value, bool):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {value!r}") from None
    return value


def build_config(nested: Mapping[str, Any], flat: Mapping[str, Any]) -> PretrainConfig:
    """Config from a YAML-like mapping (sections or flat keys) and flat overrides."""
    known = flat_fields()
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    unknown: list[str] = []

    def put(key: str, value: Any) -> None:
        name = key.replace("-", "_")
        if name not in known:
            unknown.append(key)
            return
        section, f = known[name]
        values[section][name] = _coerce(name, value, f)

    for key, value in nested.items():
        if key in SECTIONS and isinstance(value, Mapping):
            for sub, v in value.items():
                put(sub, v)
        else:
            put(key, value)
    for key, value in flat.items():
        put(key, value)
    if unknown:
        raise ConfigError(f"unknown config keys {sorted(unknown)}; valid keys: "
                          f"{sorted(known)} (optionally under sections {sorted(SECTIONS)})")
    try:
        sections = {s: SECTIONS[s](**values[s]) for s in SECTIONS}
    except TypeError as err:
        raise ConfigError(str(err)) from None
    return PretrainConfig(**sections)


def load_config(path: str | Path | None = None,
                overrides: Mapping[str, Any] | None = None) -> PretrainConfig:
    """Defaults <- YAML file ``path`` <- ``overrides`` (flat field names)."""
    nested: Mapping[str, Any] = {}
    if path is not None:
        import yaml

        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"{path}: expected a mapping at the top level, got "
                              f"{type(loaded).__name__}")
        nested = loaded
    return build_config(nested, dict(overrides or {}))
