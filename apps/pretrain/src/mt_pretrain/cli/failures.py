"""How `mt generate` and `mt bias` end on an error: one line, exit 2 for bad input (1 when a
rank failed), never a traceback for what the user can mend."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["fail", "one_line_errors"]


def fail(console: Console, message: str) -> NoReturn:
    """``error: MESSAGE`` on ``console``, exit 2."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@contextmanager
def one_line_errors(console: Console) -> Iterator[None]:
    """Bad input (mt's expected errors, OSError, ValueError) and a failed rank, raised inside,
    become one line on ``console``: exit 2, or 1 for a rank's failure; the rest propagates."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - bad input is reported as one line
        from mt_pretrain.launch import _EXPECTED, LaunchFailed

        if not isinstance(err, (*_EXPECTED, OSError, ValueError, LaunchFailed)):
            raise
        console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False,
                      soft_wrap=True)
        raise typer.Exit(1 if isinstance(err, LaunchFailed) else 2) from None
