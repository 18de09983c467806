"""Warnings as the rest of mt speaks: one ``warning: ...`` line each, every message once per
process (not Python's two-line form with the source line)."""

from __future__ import annotations

import sys
import warnings
from typing import Any, TextIO

__all__ = ["one_line_warnings"]


def one_line_warnings() -> None:
    """Show this process's warnings as ``warning: MESSAGE`` lines on stderr, each once."""
    seen: set[str] = set()

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> Any:
        text = " ".join(str(message).split())
        if text not in seen:
            seen.add(text)
            print(f"warning: {text}", file=file or sys.stderr, flush=True)

    warnings.showwarning = show
