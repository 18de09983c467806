"""The `mt` command as an install of every distribution has it (a helper module of tests/, not
a test): mt-pretrain's root app with the commands other distributions register under the
``mt.commands`` entry points (mt-inference's eval, generate, serve and bias; mt-convert's
convert), mounted here from their modules, as the source tree has no entry points."""

from __future__ import annotations

import importlib

from mt_inference.cli import COMMANDS
from mt_pretrain.cli.app import app

__all__ = ["PLUGINS", "app"]

#: What `mt` mounts from its entry points: command name -> the module holding its ``app``.
PLUGINS = {**COMMANDS, "convert": "mt_convert.cli"}

for _name, _module in PLUGINS.items():
    if _name not in {group.name for group in app.registered_groups}:
        app.add_typer(importlib.import_module(_module).app, name=_name)
