"""Where a command's output may not go: onto, into or around one of its inputs.

Every mt command that writes a file or folder asks :func:`output_clash` before it starts
(and before any ``--overwrite`` / ``--force`` deletes anything), so that no output ever
replaces, deletes or hides something the same command reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

__all__ = ["output_clash"]


def output_clash(flag: str, output: str | Path, inputs: Iterable[str | Path]) -> str | None:
    """One line saying how ``output`` (given as ``flag``) collides with one of ``inputs``
    (is it, holds it, or lies inside it), or None when it does not."""
    out = Path(output).resolve()
    for given in inputs:
        path = Path(given).resolve()
        if path == out or out in path.parents or path in out.parents:
            how = "is" if path == out else "holds" if out in path.parents else "lies inside"
            return (f"{flag} {output} {how} the input {given}: writing there would destroy "
                    f"what this command reads; choose another {flag}")
    return None
