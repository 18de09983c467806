"""The one exception type of mt_formats.

Every expected failure (a missing file, a malformed or truncated checkpoint, a checksum
mismatch, a config that cannot be expressed in the target format) is raised as a
:class:`ConvertError` whose message names the file and, where there is one, the tensor.
The CLI prints the message and exits with status 1 instead of showing a traceback.
"""

from __future__ import annotations

__all__ = ["ConvertError", "gpt2_only"]


class ConvertError(Exception):
    """A checkpoint cannot be read, written or converted; the message says which file,
    which tensor and why (`mt convert` exits 2: the input or the flags are at fault)."""


class WriteFailed(ConvertError):
    """Writing the destination failed (disk full, permissions); nothing was written
    (`mt convert` exits 1: the run failed, the input was fine)."""


def gpt2_only(config: object, what: str) -> None:
    """Refuse ``what`` for a model that is not the GPT-2 block (``config.architecture``):
    mt convert slices, names and lays out the Llama family's tensors only where it is
    tested (mt pretrain <-> consolidated)."""
    architecture = getattr(config, "architecture", "gpt2")
    if architecture != "gpt2":
        raise ConvertError(f"{what} is supported for the GPT-2 block only so far; this model's "
                           f"architecture is {architecture}")
