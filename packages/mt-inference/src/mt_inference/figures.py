"""Writing a matplotlib figure as mt writes every file: to a temporary name, synced, then
renamed (a crash never leaves a partial image under the final name)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from mt_data.shards import atomic_write_bytes

__all__ = ["save_figure"]


def save_figure(fig: Any, path: Path, dpi: float | None = None) -> Path:
    """Render ``fig`` in the format its suffix names (PNG without one) and write it to
    ``path`` atomically; returns ``path``."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix[1:].lower() or "png", dpi=dpi)
    atomic_write_bytes(path, buffer.getvalue())
    return path
