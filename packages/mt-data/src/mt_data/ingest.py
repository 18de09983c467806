"""Ingest: JSONL, Parquet and plain-text files (optionally .gz / .zst) as Arrow record batches.

Files are streamed: at most one batch of documents (``batch_docs`` / ``batch_bytes``) is held at
a time. Every bad input (malformed JSON line, invalid UTF-8, missing or non-string text field,
empty file, truncated or corrupt compressed file, unsupported file) is recorded with its file
and line in an :class:`ErrorLog`, which either counts it and goes on (``on_error="skip"``) or
raises :class:`BadInputError` (``"stop"``). A compressed JSONL file is decoded to its end before
any of its documents is read, so a truncated one contributes no documents at all. A text field
missing from every line of a file (or a missing Parquet column) is a wrong ``text_key``, not a
bad line: it raises :class:`TextKeyError` whatever ``on_error`` says.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mt_data.badinput import (
    ON_ERROR,
    BadInputError,
    ErrorLog,
    InputError,
    KeyTally,
    TextKeyError,
    check_tally,
    check_text_key,
    field_list,
    keyless_message,
)
from mt_data.compressed import COMPRESSED, check_stream, is_compressed, open_binary
from mt_data.errors import DataNotFoundError, StreamError
from mt_data.text import not_utf8

__all__ = [  # the report types are defined in mt_data.badinput; importable from here as before
    "DOC_SCHEMA", "ON_ERROR", "BadInputError", "ErrorLog", "IngestConfig", "InputError",
    "TextKeyError", "WorkItem", "check_text_key", "expand_inputs", "file_kind",
    "iter_documents", "keyless_message", "open_binary", "plan_work", "read_jsonl",
    "read_parquet", "read_text_files", "read_work_item", "source_name", "split_jsonl",
]

DOC_SCHEMA = pa.schema([("id", pa.string()), ("source", pa.string()), ("text", pa.string())])
JSON_EXTS = (".jsonl", ".json", ".ndjson")
TEXT_EXTS = (".txt", ".text", ".md", ".rst")
PARQUET_EXTS = (".parquet",)


@dataclass(frozen=True)
class IngestConfig:
    """How input files are read."""

    text_key: str = "text"
    """JSON field / Parquet column holding the document text."""
    id_key: str = "id"
    """Field holding a document id (optional; ``file:line`` is used when absent)."""
    source_key: str = "source"
    """Field naming the document's source (optional; the file's stem is used when absent)."""
    batch_docs: int = 2000
    """Documents per record batch."""
    batch_bytes: int = 16 << 20
    """Text characters per record batch (whichever bound is hit first closes the batch)."""
    split_bytes: int = 8 << 20
    """Uncompressed JSONL files larger than this are read as several work items in parallel
    (``prepare`` cuts smaller ones, down to ``MIN_SPLIT_BYTES``, when the inputs are under
    ``SPLIT_PIECES * split_bytes``: see :func:`parallel_split_bytes`)."""

    def __post_init__(self) -> None:
        if self.batch_docs < 1 or self.batch_bytes < 1 or self.split_bytes < 1:
            raise ValueError(
                f"batch_docs ({self.batch_docs}), batch_bytes ({self.batch_bytes}) and "
                f"split_bytes ({self.split_bytes}) must be >= 1"
            )


def file_kind(path: Path) -> str:
    """``json``, ``parquet``, ``text`` or ``unknown`` from the name (compression suffix ignored)."""
    name = path.name.lower()
    for ext in COMPRESSED:
        if name.endswith(ext):
            name = name[: -len(ext)]
    if name.endswith(JSON_EXTS):
        return "json"
    if name.endswith(PARQUET_EXTS):
        return "parquet"
    if name.endswith(TEXT_EXTS):
        return "text"
    return "unknown"


def _raise(err: OSError) -> None:
    raise err


def _folder_files(folder: Path) -> list[Path]:
    """The files under ``folder``, sorted: searched recursively, folders linked into it
    followed (each real folder once, so that a link loop ends), hidden files and folders
    skipped; a folder that cannot be read raises its OSError, a link to nothing or an entry
    that is not a regular file (a pipe, a socket, a device) raises :class:`DataNotFoundError`
    naming it (it would otherwise be left out without a word)."""
    files: list[Path] = []
    searched: set[str] = set()
    for root, dirs, names in os.walk(folder, onerror=_raise, followlinks=True):
        real = os.path.realpath(root)
        if real in searched:
            dirs.clear()
            continue
        searched.add(real)
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        files.extend(_regular(Path(root) / name) for name in names if not name.startswith("."))
    return sorted(files)


def _regular(path: Path) -> Path:
    """``path``, a regular file (or a link to one) found in an input folder."""
    if path.is_file():
        return path
    if path.is_symlink() and not path.exists():
        raise DataNotFoundError(f"input {path} is a link to {os.readlink(path)}, which does "
                                "not exist: remove the link or restore its target")
    raise DataNotFoundError(f"input {path} is not a regular file (a pipe, socket or device in "
                            "an input folder): move it out, or give it as an input of its own")


def expand_inputs(paths: Iterable[str | Path]) -> list[Path]:
    """Input files: files as given, folders searched recursively (sorted, folders linked into
    them followed, hidden files skipped)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(_folder_files(path))
        elif path.exists():
            files.append(path)
        else:
            raise DataNotFoundError(f"input {path} does not exist")
    return files


class _Batcher:
    """Collects (id, source, text) rows and cuts them into bounded record batches."""

    def __init__(self, config: IngestConfig) -> None:
        self.config = config
        self.ids: list[str] = []
        self.sources: list[str] = []
        self.texts: list[str] = []
        self.nbytes = 0

    def add(self, doc_id: str, source: str, text: str) -> pa.RecordBatch | None:
        self.ids.append(doc_id)
        self.sources.append(source)
        self.texts.append(text)
        self.nbytes += len(text)
        full = len(self.texts) >= self.config.batch_docs or self.nbytes >= self.config.batch_bytes
        return self.flush() if full else None

    def flush(self) -> pa.RecordBatch | None:
        if not self.texts:
            return None
        batch = pa.RecordBatch.from_arrays(
            [pa.array(self.ids, pa.string()), pa.array(self.sources, pa.string()),
             pa.array(self.texts, pa.string())],
            schema=DOC_SCHEMA,
        )
        self.ids, self.sources, self.texts, self.nbytes = [], [], [], 0
        return batch


#: A JSON escape of a UTF-16 surrogate (``\\ud800``-``\\udfff``): only lines holding one can
#: decode to a string that is not UTF-8 text.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


#: The byte-order mark some editors put at the start of a UTF-8 file: an encoding mark, not
#: text (dropped there).
UTF8_BOM = b"\xef\xbb\xbf"


def source_name(path: Path) -> str:
    """Default source of a file's documents: its name without extensions."""
    return path.name.split(".")[0] or path.name


def _json_fields(
    record: object, config: IngestConfig, path: Path, line_no: int, log: ErrorLog
) -> tuple[str, str, str] | None:
    if not isinstance(record, dict):
        log.report(path, line_no, "json", f"expected a JSON object, got {type(record).__name__}")
        return None
    text = record.get(config.text_key)
    if config.text_key not in record:
        log.report(path, line_no, "missing_key",
                   f"no {config.text_key!r} field (the line has {field_list(record)})")
        return None
    if text is None:
        log.report(path, line_no, "missing_key", f"{config.text_key!r} is null")
        return None
    if not isinstance(text, str):
        log.report(path, line_no, "not_text", f"{config.text_key!r} is {type(text).__name__}")
        return None
    doc_id = record.get(config.id_key)
    source = record.get(config.source_key)
    return (
        str(doc_id) if doc_id is not None else f"{path.name}:{line_no}",
        str(source) if isinstance(source, str) and source else source_name(path),
        text,
    )


@cache
def _quoted(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(json.dumps(name, ensure_ascii=False) for name in names)


def _given_twice(line: str, config: IngestConfig) -> str | None:
    """The first of the text, id and source fields that ``line``'s top-level object gives
    twice, or None. Only a line naming one of them twice in quotes is parsed again."""
    names = (config.text_key, config.id_key, config.source_key)
    if not any(line.count(quoted) > 1 for quoted in _quoted(names)):
        return None
    last: list[str] = []

    def pairs(items: list[tuple[str, object]]) -> dict[str, object]:
        keys = [key for key, _ in items]
        last[:] = [name for name in names if keys.count(name) > 1]
        return dict(items)

    json.loads(line, object_pairs_hook=pairs)  # the outermost object closes last
    return last[0] if last else None


def _parse_line(raw: bytes, config: IngestConfig, path: Path, line_no: int, log: ErrorLog,
                tally: KeyTally) -> tuple[str, str, str] | None:
    """(id, source, text) of one non-blank JSONL line, or None after reporting it."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        log.report(path, line_no, "utf8", f"invalid UTF-8 at byte {exc.start} of the line")
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        log.report(path, line_no, "json", f"malformed JSON: {exc.msg} (column {exc.colno})")
        return None
    except RecursionError:  # e.g. 200,000 '[': Python's parser recurses once per level
        log.report(path, line_no, "json", f"JSON nested too deeply to read ({len(line):,} "
                   "characters; Python's parser stops near 1,000 levels)")
        return None
    if isinstance(record, dict):
        if (twice := _given_twice(line, config)) is not None:
            log.report(path, line_no, "json", f"{twice!r} is given twice in the line (JSON "
                       "readers keep one of them, which one differs): keep one")
            return None
        tally.count(record, config.text_key)
    fields = _json_fields(record, config, path, line_no, log)
    if fields is not None and _SURROGATE_ESCAPE.search(line):
        for name, value in zip(("id", "source", "text"), fields):
            if why := not_utf8(value):  # an escaped half of a UTF-16 pair, alone
                log.report(path, line_no, "utf8", f"the {name} holds {why}: not UTF-8 text")
                return None
    return fields


def read_jsonl(path: Path, config: IngestConfig, log: ErrorLog, start: int = 0,
               end: int | None = None, first_line: int = 1) -> Iterator[pa.RecordBatch]:
    """Stream a JSON-lines file (or its byte range ``[start, end)`` beginning at line
    ``first_line``); blank lines are ignored, bad lines reported with their number.

    A compressed file is first decoded to its end: a truncated or corrupt one is reported
    (kind ``truncated`` / ``corrupt``, line 0) and yields no documents.
    """
    whole = start == 0 and end is None
    if whole and is_compressed(path):
        try:
            check_stream(path)
        except StreamError as exc:
            log.report(path, 0, exc.kind, exc.message)
            return
    batcher = _Batcher(config)
    tally = KeyTally()
    seen, line_no = 0, first_line - 1
    try:
        with open_binary(path) as f:
            if start:
                f.seek(start)
            pos = start
            for line_no, raw in enumerate(f, start=first_line):
                if end is not None and pos >= end:
                    break
                pos, first = pos + len(raw), pos == 0
                if first:
                    raw = raw.removeprefix(UTF8_BOM)
                if not raw.strip():
                    continue
                seen += 1
                fields = _parse_line(raw, config, path, line_no, log, tally)
                if fields is not None and (batch := batcher.add(*fields)) is not None:
                    yield batch
    except StreamError as exc:  # the file changed after it was checked: stop reading it
        log.report(path, line_no + 1, exc.kind, exc.message)
        return
    if seen == 0 and whole:
        log.report(path, 0, "empty_file", "no documents in file")
    check_tally(path, config.text_key, tally, whole, log)
    if (batch := batcher.flush()) is not None:
        yield batch


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


_NOT_UTF8 = object()
"""A Parquet string value whose bytes are not UTF-8 (a writer that never checked them)."""


def _value(scalar: pa.Scalar) -> object:
    try:
        return scalar.as_py()
    except UnicodeDecodeError:
        return _NOT_UTF8


def _column_values(column: pa.Array) -> list[object]:
    """A Parquet column's values, with :data:`_NOT_UTF8` for each string value that is not
    UTF-8 (converted one by one only in a batch holding one)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        return [_value(scalar) for scalar in column]


def read_parquet(path: Path, config: IngestConfig, log: ErrorLog) -> Iterator[pa.RecordBatch]:
    """Stream a Parquet file's text column (row numbers are reported as lines)."""
    if is_compressed(path):
        log.report(path, 0, "parquet", "a compressed Parquet file, which mt reads only "
                   "uncompressed (Parquet compresses its columns itself): decompress it")
        return
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        log.report(path, 0, "parquet", f"unreadable Parquet file: {_one_line(exc)}")
        return
    names = set(pf.schema_arrow.names)
    if config.text_key not in names:
        log.wrong_text_key(path, f"no {config.text_key!r} column (check --text-key); the "
                                 f"file has {field_list(names)}")
    if pf.metadata.num_rows == 0:
        log.report(path, 0, "empty_file", "no rows in file")
        return
    columns = [c for c in (config.text_key, config.id_key, config.source_key) if c in names]
    batcher = _Batcher(config)
    row = 0
    try:
        for rb in pf.iter_batches(batch_size=config.batch_docs, columns=columns):
            data = {name: _column_values(rb.column(name)) for name in columns}
            for i in range(rb.num_rows):
                row += 1
                record = {name: data[name][i] for name in columns}
                if bad := [name for name, value in record.items() if value is _NOT_UTF8]:
                    log.report(path, row, "utf8", f"the {bad[0]} column holds bytes that are "
                               "not UTF-8 text")
                    continue
                fields = _json_fields(record, config, path, row, log)
                if fields is not None and (batch := batcher.add(*fields)) is not None:
                    yield batch
    except (pa.ArrowInvalid, OSError) as exc:
        log.report(path, row + 1, "parquet", f"unreadable Parquet data: {_one_line(exc)}")
        return
    if (batch := batcher.flush()) is not None:
        yield batch


def read_text_files(
    paths: list[Path], config: IngestConfig, log: ErrorLog, source: str | None = None
) -> Iterator[pa.RecordBatch]:
    """One document per plain-text file; the source is the parent folder's name by default."""
    batcher = _Batcher(config)
    for path in paths:
        try:
            with open_binary(path) as f:
                data = f.read()
        except StreamError as exc:
            log.report(path, 0, exc.kind, exc.message)
            continue
        data = data.removeprefix(UTF8_BOM)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, exc.start) + 1
            log.report(path, line, "utf8", f"invalid UTF-8 at byte {exc.start} of the file")
            continue
        if not text.strip():
            log.report(path, 0, "empty_file", "file is empty")
            continue
        name = source or path.parent.name or source_name(path)
        if (batch := batcher.add(str(path), name, text)) is not None:
            yield batch
    if (batch := batcher.flush()) is not None:
        yield batch


@dataclass(frozen=True)
class WorkItem:
    """A unit of ingest work: a JSONL/Parquet file (or a byte range of a large uncompressed
    JSONL file, starting at line ``first_line``), or a group of plain-text files."""

    kind: str
    files: tuple[str, ...]
    start: int = 0
    end: int | None = None
    first_line: int = 1

    @property
    def label(self) -> str:
        """Short description for progress displays."""
        extra = f" (+{len(self.files) - 1} files)" if len(self.files) > 1 else ""
        span = f" [{self.start}:{self.end}]" if self.end is not None else ""
        return f"{Path(self.files[0]).name}{extra}{span}"

    @property
    def nbytes(self) -> int:
        """Input bytes this item reads (for progress)."""
        if self.end is not None:
            return self.end - self.start
        return sum(os.path.getsize(f) for f in self.files)


def split_jsonl(path: Path, split_bytes: int) -> list[WorkItem]:
    """Byte ranges of an uncompressed JSONL file, cut after newlines, with their first line."""
    size = path.stat().st_size
    if size <= split_bytes or path.name.lower().endswith(COMPRESSED):
        return [WorkItem("json", (str(path),))]
    items: list[WorkItem] = []
    start, line = 0, 1
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + split_bytes, size))
            f.readline()  # finish the current line: ranges start at line starts
            end = min(f.tell(), size) if start + split_bytes < size else size
            f.seek(start)
            lines = f.read(end - start).count(b"\n")
            items.append(WorkItem("json", (str(path),), start, end, line))
            start, line = end, line + lines
    return items


SPLIT_PIECES = 16
MIN_SPLIT_BYTES = 1 << 20


def parallel_split_bytes(files: list[Path], split_bytes: int) -> int:
    """The byte-range size ``prepare`` cuts uncompressed JSONL files into: ``split_bytes``, or
    less for small inputs, so that they still make about ``SPLIT_PIECES`` work items (at least
    ``MIN_SPLIT_BYTES`` each) to share between the workers. A function of the inputs and the
    config only (not of the worker count), so an interrupted run resumes on the same items."""
    total = sum(path.stat().st_size for path in files if file_kind(path) == "json"
                and not path.name.lower().endswith(COMPRESSED))
    return min(split_bytes, max(MIN_SPLIT_BYTES, -(-total // SPLIT_PIECES)))


def plan_work(files: list[Path], text_group: int = 512,
              split_bytes: int = 8 << 20) -> tuple[list[WorkItem], list[Path]]:
    """Group files into work items (in input order); also returns unsupported files."""
    items: list[WorkItem] = []
    pending: list[str] = []
    unknown: list[Path] = []

    def close_group() -> None:
        if pending:
            items.append(WorkItem("text", tuple(pending)))
            pending.clear()

    for path in files:
        kind = file_kind(path)
        if kind == "unknown":
            unknown.append(path)
        elif kind == "text":
            if pending and Path(pending[-1]).parent != path.parent:
                close_group()
            pending.append(str(path))
            if len(pending) == text_group:
                close_group()
        else:
            close_group()
            items.extend(split_jsonl(path, split_bytes) if kind == "json"
                         else [WorkItem(kind, (str(path),))])
    close_group()
    return items, unknown


def read_work_item(item: WorkItem, config: IngestConfig, log: ErrorLog) -> Iterator[pa.RecordBatch]:
    """Record batches (schema :data:`DOC_SCHEMA`) of one work item."""
    if item.kind == "json":
        yield from read_jsonl(Path(item.files[0]), config, log, item.start, item.end,
                              item.first_line)
    elif item.kind == "parquet":
        yield from read_parquet(Path(item.files[0]), config, log)
    elif item.kind == "text":
        yield from read_text_files([Path(f) for f in item.files], config, log)
    else:
        raise ValueError(f"unknown work item kind {item.kind!r}")


def iter_documents(
    paths: Iterable[str | Path], config: IngestConfig | None = None, log: ErrorLog | None = None
) -> Iterator[pa.RecordBatch]:
    """All documents of the given files/folders as record batches, sequentially."""
    config = config or IngestConfig()
    log = log if log is not None else ErrorLog()
    items, unknown = plan_work(expand_inputs(paths), split_bytes=config.split_bytes)
    for path in unknown:
        log.report(path, 0, "unsupported", "unknown file type (expected jsonl/parquet/txt)")
    for item in items:
        yield from read_work_item(item, config, log)
    check_text_key(log.keyless, log.keyed, config.text_key)  # files read in byte ranges
