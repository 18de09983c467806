"""The one exception type of mt_convert.

Every expected failure (a missing file, a malformed or truncated checkpoint, a checksum
mismatch, a config that cannot be expressed in the target format) is raised as a
:class:`ConvertError` whose message names the file and, where there is one, the tensor.
The CLI prints the message and exits with status 1 instead of showing a traceback.
"""

from __future__ import annotations

__all__ = ["ConvertError"]


class ConvertError(Exception):
    """A checkpoint cannot be read, written or converted; the message says which file,
    which tensor and why."""
