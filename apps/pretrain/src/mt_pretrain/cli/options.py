"""Turn the config dataclasses into Typer options: one ``--flag`` per field, whose help is
the field's attribute docstring. Options default to None ("not given"), so only flags the
user typed override the YAML file and the dataclass defaults."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from mt_pretrain.config.fields import field_docs, flat_fields
from mt_pretrain.config.schema import SECTIONS

__all__ = ["CONFIG_OPTION", "with_config_options"]

CONFIG_OPTION = "config"
_PANELS = {"model": "Model", "parallel": "Parallelism", "train": "Training", "data": "Data",
           "checkpoint": "Checkpoints", "log": "Logging and metrics"}


def _base_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.startswith(name):
            return kind
    raise TypeError(f"config field {f.name} has unsupported type {text}")


def _option(section: str, f: dataclasses.Field) -> tuple[Any, Any]:
    """(annotation, typer.Option) of one config field."""
    kind = _base_type(f)
    flag = "--" + f.name.replace("_", "-")
    # Rich markup would eat "[wandb]" of "pip install 'mt-pretrain[wandb]'": escaped.
    help_text = field_docs(SECTIONS[section]).get(f.name, "").replace("[", "\\[")
    if f.default is not None and f.default is not dataclasses.MISSING and kind is not bool:
        help_text += f" (default: {f.default})"
    panel = _PANELS[section]
    if kind is bool:
        default = "on" if f.default else "off"
        option = typer.Option(None, f"{flag}/--no-{flag[2:]}", help=f"{help_text} "
                              f"(default: {default})", rich_help_panel=panel, show_default=False)
    else:
        option = typer.Option(None, flag, help=help_text, rich_help_panel=panel,
                              show_default=False)
    return Optional[kind], option  # noqa: UP045 - Typer needs a runtime Optional type


def with_config_options(body: Callable[[Path | None, dict[str, Any]], None]
                        ) -> Callable[..., None]:
    """A Typer command function taking ``--config FILE`` and every config field as a flag;
    it calls ``body(config_path, overrides)`` with only the flags that were given."""
    params = [inspect.Parameter(
        CONFIG_OPTION, inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(None, "--config", help="YAML config file; flags override it.",
                             dir_okay=False, show_default=False),
        annotation=Optional[Path],  # noqa: UP045
    )]
    annotations: dict[str, Any] = {CONFIG_OPTION: Optional[Path]}  # noqa: UP045
    for name, (section, f) in flat_fields().items():
        annotation, option = _option(section, f)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=annotation))
        annotations[name] = annotation

    def command(**kwargs: Any) -> None:
        path = kwargs.pop(CONFIG_OPTION)
        body(path, {k: v for k, v in kwargs.items() if v is not None})

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = annotations
    command.__doc__ = body.__doc__
    return command
