"""Weights-only reading of torch pickle files, with errors that name the file, and
``torch.save`` with the failures of its writes as themselves."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch

from mt_formats.errors import ConvertError


def load_weights_only(path: Path, missing: str = "file not found",
                      allowed: Sequence[Any] = ()) -> Any:
    """``torch.load`` memory-mapped with ``weights_only=True``: tensors and plain containers
    only (and the ``allowed`` globals: torch's ``safe_globals`` entries, e.g. an inert
    stand-in class under the name a file uses); anything else, a malformed or truncated file
    raises a ConvertError naming ``path``."""
    if not path.is_file():
        raise ConvertError(f"{path}: {missing}")
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise ConvertError(f"{path}: holds objects other than tensors and plain containers; "
                           f"refusing to unpickle it ({str(err).splitlines()[0]})") from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        first = next(iter(str(err).splitlines()), type(err).__name__)  # one line, as above
        raise ConvertError(f"{path}: not a readable torch checkpoint (malformed or "
                           f"truncated): {first}") from None


def save_into(payload: Any, file: IO[bytes]) -> None:
    """``torch.save(payload, file)``. Its zip writer reports a write that raised (a full
    disk's OSError, the KeyboardInterrupt of a signal arriving in the middle) as a
    RuntimeError of its own ("unexpected pos"); that exception is raised instead, so that a
    full disk is a failed write and an interrupt an interrupt."""
    try:
        torch.save(payload, file)
    except RuntimeError as err:
        if isinstance(err.__context__, (OSError, KeyboardInterrupt)):
            raise err.__context__ from None
        raise
