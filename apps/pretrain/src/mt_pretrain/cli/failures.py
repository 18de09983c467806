"""How `mt generate` and `mt bias` end on an error: one line, exit 2 for bad input (1 when a
rank failed), never a traceback for what the user can mend."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["fail", "one_line_errors", "sampling_flags"]

#: mt-model's ``Sampling`` fields, as the options of `mt generate` and `mt bias` spell them.
_SAMPLING_FIELDS = re.compile(r"\b(max_new_tokens|temperature|top_k|top_p|seed)\b")


def sampling_flags(message: str) -> str:
    """A ``Sampling`` error with its field names as the command line's flags (``top_k`` ->
    ``--top-k``)."""
    return _SAMPLING_FIELDS.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)


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
