"""Bad input reports: :class:`InputError` (file, line, kind, message), the :class:`ErrorLog`
that counts every one exactly and keeps the first ones as examples, and the text-key check.

With ``on_error="skip"`` a bad input is counted and reading goes on; with ``"stop"`` the first
one raises :class:`BadInputError`. A file none of whose JSON objects has the text field (read
whole, or over all its byte ranges) raises :class:`TextKeyError` whatever ``on_error`` says: it
is a wrong ``text_key``, not a bad line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from mt_data.errors import DataError

ON_ERROR = ("skip", "stop")


@dataclass(frozen=True)
class InputError:
    """One bad input: ``line`` is 1-based (a row number for Parquet), 0 for the whole file."""

    file: str
    line: int
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.kind}: {self.message}"


class BadInputError(DataError, ValueError):
    """Raised on the first bad input when ``on_error="stop"`` (and on a wrong text key)."""

    def __init__(self, error: InputError) -> None:
        super().__init__(str(error))
        self.error = error

    def __reduce__(self) -> tuple[type, tuple[InputError]]:
        return type(self), (self.error,)  # keeps ``error`` across worker processes


class TextKeyError(BadInputError):
    """No line of a file has the text field (or a Parquet file lacks the column): a wrong
    ``text_key``, raised whatever ``on_error`` says."""


@dataclass
class ErrorLog:
    """Counts bad inputs by kind, exactly, and keeps the first ``keep`` of them as examples."""

    on_error: str = "skip"
    keep: int = 1000
    counts: Counter[str] = field(default_factory=Counter)
    errors: list[InputError] = field(default_factory=list)
    keyless: dict[str, list[str]] = field(default_factory=dict)
    """Files (read in byte ranges) with a range where no JSON object has the text field ->
    the fields those objects have; see :func:`check_text_key`."""
    keyed: set[str] = field(default_factory=set)
    """Files with a range where some JSON object has the text field."""

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")

    def report(self, file: str | Path, line: int, kind: str, message: str) -> None:
        """Record one bad input; raises BadInputError when stopping on errors."""
        error = InputError(str(file), line, kind, message)
        self.counts[kind] += 1
        if len(self.errors) < self.keep:
            self.errors.append(error)
        if self.on_error == "stop":
            raise BadInputError(error)

    def wrong_text_key(self, file: str | Path, message: str) -> NoReturn:
        """Record a file without the text field, which stops the run whatever ``on_error``
        says (it is a wrong text key, not a bad line)."""
        error = InputError(str(file), 0, "missing_key", message)
        self.counts[error.kind] += 1
        if len(self.errors) < self.keep:
            self.errors.append(error)
        raise TextKeyError(error)

    @property
    def total(self) -> int:
        """Number of bad inputs seen."""
        return sum(self.counts.values())


@dataclass
class KeyTally:
    """JSON objects of one file (or byte range) with and without the text field."""

    found: int = 0
    absent: int = 0
    fields: set[str] = field(default_factory=set)

    def count(self, record: dict[str, object], key: str) -> None:
        """Count one JSON object (and remember some of its fields when it lacks ``key``)."""
        if key in record:
            self.found += 1
        else:
            self.absent += 1
            if len(self.fields) < 50:
                self.fields.update(list(record)[:50])


def field_list(fields: Iterable[str]) -> str:
    """``'a', 'b'`` (at most 20 names) for messages."""
    names = sorted(fields)
    more = f" and {len(names) - 20} more" if len(names) > 20 else ""
    return (", ".join(repr(n) for n in names[:20]) + more) if names else "no fields"


def keyless_message(key: str, fields: Iterable[str]) -> str:
    """Why a file whose JSON objects all lack the text field cannot be read."""
    return (f"no line has the {key!r} field (check --text-key); the lines have "
            f"{field_list(fields)}")


def check_tally(path: Path, key: str, tally: KeyTally, whole: bool, log: ErrorLog) -> None:
    """A whole file whose objects all lack the text field is fatal; for a byte range the
    verdict waits for the file's other ranges (:func:`check_text_key`)."""
    if tally.found:
        log.keyed.add(str(path))
    elif tally.absent:
        if whole:
            log.wrong_text_key(path, keyless_message(key, tally.fields))
        log.keyless[str(path)] = sorted(set(log.keyless.get(str(path), [])) | tally.fields)


def check_text_key(keyless: dict[str, list[str]], keyed: Iterable[str], key: str) -> None:
    """Raise :class:`TextKeyError` for the first file none of whose ranges had a JSON object
    with the text field (``ErrorLog.keyless`` / ``keyed`` merged over all ranges)."""
    missing = sorted(set(keyless) - set(keyed))
    if missing:
        raise TextKeyError(InputError(missing[0], 0, "missing_key",
                                       keyless_message(key, keyless[missing[0]])))
