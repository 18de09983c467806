"""mt-data's error types: every failure is one line naming the file (and line or field).

All derive from :class:`DataError`; the ``mt data`` CLI prints any of them as ``error: ...``
and exits with status 2. Each also derives from the built-in type callers caught before
(``ValueError``, ``RuntimeError``, ``FileNotFoundError``), so existing handlers keep working.
"""

from __future__ import annotations


class DataError(Exception):
    """Base of every mt-data error."""


class DatasetError(DataError, ValueError):
    """A dataset folder, shard, index or Megatron ``.bin``/``.idx`` that is malformed,
    inconsistent, or holds token ids its dtype or tokenizer cannot represent."""


class DataNotFoundError(DataError, FileNotFoundError):
    """An input path or dataset folder that does not exist."""


class StreamError(DataError, OSError):
    """A compressed file that ends early (``kind="truncated"``) or does not decode
    (``kind="corrupt"``)."""

    def __init__(self, path: str, kind: str, message: str) -> None:
        super().__init__(f"{path}: {kind}: {message}")
        self.path, self.kind, self.message = path, kind, message

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        return type(self), (self.path, self.kind, self.message)


class PrepareError(DataError, RuntimeError):
    """The output folder holds a different run, or the inputs cannot be prepared."""


class NoDocumentsError(PrepareError):
    """Every input was empty or unreadable, or every document was filtered out."""
