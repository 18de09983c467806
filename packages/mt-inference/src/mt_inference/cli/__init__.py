"""The inference commands, each a Typer app whose callback is the command (`mt` mounts them
by their ``mt.commands`` entry points): `mt eval`, `mt generate`, `mt serve`, `mt bias`."""

from __future__ import annotations

import importlib

import typer

__all__ = ["COMMANDS", "main"]

#: Command name -> the module holding its ``app``.
COMMANDS = {"eval": "mt_inference.cli.eval", "generate": "mt_inference.cli.generate",
            "serve": "mt_inference.cli.serve", "bias": "mt_inference.cli.bias"}


def main() -> None:
    """``python -m mt_inference COMMAND ...``."""
    app = typer.Typer(name="python -m mt_inference", no_args_is_help=True,
                      add_completion=False, pretty_exceptions_show_locals=False,
                      help="The inference commands of mt (the same as `mt COMMAND`).")
    for name, module in COMMANDS.items():
        app.add_typer(importlib.import_module(module).app, name=name)
    app()
