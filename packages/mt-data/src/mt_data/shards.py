"""Token shards: Arrow IPC files plus a small JSON index, memory-mapped for random access.

A shard is one uncompressed Arrow IPC file holding one record batch with columns ``tokens``
(``list<uint16|uint32>``: one row per document, EOD included), ``id`` and ``source``. Arrow
lists store their values contiguously with an offsets array, so a memory-mapped shard gives a
flat numpy token array and document offsets with zero copies: reading any token span is a slice.

``index.json`` records documents, tokens, sources, the tokenizer, dtype, the largest token id
(``max_token_id``; -1 without tokens) and each shard's size, SHA-256 and largest id. Every file
is written to a temporary name, synced and renamed (atomic on POSIX); finished shards are also
logged in ``progress.jsonl`` so an interrupted run resumes at the shard level.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from mt_data.errors import DataNotFoundError, DatasetError

INDEX_FILE = "index.json"
PROGRESS_FILE = "progress.jsonl"
VERIFIED_FILE = "verified.json"
FORMAT = "mt-data-token-shards"
VERSION = 1


def temp_path(path: Path) -> Path:
    """A hidden temporary name next to ``path``, unique per process."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _fsync(path: Path) -> None:
    """Sync a file or a folder's entries. A filesystem that cannot sync a folder (EINVAL /
    ENOTSUP: some network filesystems) is left to its own guarantees; any other error (an
    I/O error, a full disk) is raised. The same rule as mt-checkpoint's ``fsync_dir``: the
    torch-free data stack and the training stack share no package to hold one helper."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def atomic_replace(tmp: Path, path: Path) -> None:
    """Publish a fully written temporary file: sync it, rename it to ``path``, sync the folder
    (so neither a crash nor a power cut leaves a partial file under the final name)."""
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


@contextmanager
def removed_on_failure(tmp: Path) -> Iterator[Path]:
    """``tmp``, a temporary file being written, removed if the writing fails (a full disk
    leaves no partial file behind, under any name)."""
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename."""
    with removed_on_failure(temp_path(path)) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
        atomic_replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def write_sha256sums(path: Path, files: Sequence[Path]) -> Path:
    """Write ``files``' SHA-256 digests to ``path`` atomically, one ``HEX  NAME`` line each as
    ``sha256sum`` writes them (names relative to ``path``'s folder: ``sha256sum -c`` there
    checks them). Returns ``path``."""
    lines = "".join(f"{file_sha256(f)}  {os.path.relpath(f, path.parent)}\n" for f in files)
    atomic_write_bytes(path, lines.encode("utf-8"))
    return path


def sha256_beside(path: Path) -> Path:
    """``path``'s digest in ``PATH.sha256`` beside it (:func:`write_sha256sums`)."""
    return write_sha256sums(path.with_name(path.name + ".sha256"), [path])


@dataclass(frozen=True)
class ShardInfo:
    """One shard as recorded in the index."""

    file: str
    documents: int
    tokens: int
    bytes: int
    sha256: str
    sources: dict[str, list[int]] = field(default_factory=dict)
    """source -> [documents, tokens] in this shard."""
    max_token_id: int | None = None
    """Largest token id in the shard (-1 without tokens; None when logged by an older run)."""


def tokens_array(tokens: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """A list array (one row of token ids per document) over a flat token array, zero-copy."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.array(tokens)
    if offsets[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)
    return pa.LargeListArray.from_arrays(pa.array(offsets), values)


def write_shard(
    path: Path,
    tokens: np.ndarray,
    lengths: np.ndarray,
    ids: Sequence[str] | pa.Array,
    sources: Sequence[str] | pa.Array,
) -> ShardInfo:
    """Write one shard atomically and describe it (size, checksum, per-source counts)."""
    src = sources if isinstance(sources, pa.Array) else pa.array(list(sources), pa.string())
    batch = pa.RecordBatch.from_arrays(
        [tokens_array(tokens, lengths), pa.array(ids, pa.string()) if not isinstance(ids, pa.Array)
         else ids, src],
        names=["tokens", "id", "source"],
    )
    tmp = temp_path(path)
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    atomic_replace(tmp, path)
    per_source: dict[str, list[int]] = {}
    names = src.to_pylist()
    for name, length in zip(names, lengths.tolist(), strict=True):
        entry = per_source.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += length
    return ShardInfo(path.name, len(lengths), int(lengths.sum()), path.stat().st_size,
                     file_sha256(path), per_source, int(tokens.max()) if tokens.size else -1)


def shard_max_token_id(path: Path) -> int:
    """Largest token id stored in a shard file (-1 without tokens), read from the file."""
    values = pa.ipc.open_file(pa.memory_map(str(path), "r")).get_batch(0).column("tokens")
    values = values.flatten().to_numpy(zero_copy_only=False)
    return int(values.max()) if values.size else -1


def check_token_range(max_token_id: int, tokenizer: Any, dtype: str, where: str) -> None:
    """Raise :class:`DatasetError` unless every id up to ``max_token_id`` fits the dtype and
    the tokenizer's vocabulary (``where`` names the file at fault)."""
    vocab = tokenizer.get("vocab_size") if isinstance(tokenizer, dict) else None
    if isinstance(vocab, int) and max_token_id >= vocab:
        raise DatasetError(f"{where}: token id {max_token_id} is outside the vocabulary of "
                           f"tokenizer {tokenizer.get('name')!r} ({vocab} ids)")
    if max_token_id > np.iinfo(np.dtype(dtype)).max:
        raise DatasetError(f"{where}: token id {max_token_id} does not fit dtype {dtype}")


class ShardSetWriter:
    """Writes the shards of one dataset folder and, at the end, its ``index.json``.

    With ``resume=True`` shards logged as finished by an earlier run are kept and reported by
    :meth:`done`; the caller skips recomputing them.
    """

    def __init__(self, out_dir: str | Path, tokenizer: dict[str, Any], dtype: str,
                 resume: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.shards: dict[str, ShardInfo] = {}
        progress = self.out_dir / PROGRESS_FILE
        if resume and progress.exists():
            for line in progress.read_text().splitlines():
                try:
                    info = ShardInfo(**json.loads(line))
                except (json.JSONDecodeError, TypeError, RecursionError):
                    continue  # a torn last line from a crash: that shard is redone
                shard = self.out_dir / info.file
                if shard.exists() and shard.stat().st_size == info.bytes:
                    self.shards[info.file] = info
        elif progress.exists():
            progress.unlink()

    def done(self, name: str) -> bool:
        """True when shard ``name`` was finished (by this or an earlier run)."""
        return name in self.shards

    def add(self, name: str, tokens: np.ndarray, lengths: np.ndarray,
            ids: Sequence[str] | pa.Array, sources: Sequence[str] | pa.Array) -> ShardInfo:
        """Write shard ``name`` and log it as finished."""
        info = write_shard(self.out_dir / name, tokens.astype(self.dtype, copy=False),
                           lengths, ids, sources)
        self.record(info)
        return info

    def record(self, info: ShardInfo) -> None:
        """Log a shard written (e.g. by a worker process with :func:`write_shard`) as finished."""
        with open(self.out_dir / PROGRESS_FILE, "a") as f:
            f.write(json.dumps(asdict(info)) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.shards[info.file] = info

    def finish(self, stats: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write ``index.json`` (shards in name order) and return it.

        Raises :class:`DatasetError` when a token id is outside the tokenizer's vocabulary.
        """
        shards = []
        for name in sorted(self.shards):
            info = self.shards[name]
            if info.max_token_id is None:  # logged by an older run: read it from the shard
                info = replace(info, max_token_id=shard_max_token_id(self.out_dir / name))
            check_token_range(info.max_token_id, self.tokenizer, self.dtype,
                              str(self.out_dir / name))
            shards.append(info)
        sources: dict[str, dict[str, int]] = {}
        for info in shards:
            for name, (docs, toks) in info.sources.items():
                entry = sources.setdefault(name, {"documents": 0, "tokens": 0})
                entry["documents"] += docs
                entry["tokens"] += toks
        index = {
            "format": FORMAT,
            "version": VERSION,
            "documents": sum(s.documents for s in shards),
            "tokens": sum(s.tokens for s in shards),
            "dtype": self.dtype,
            "max_token_id": max((s.max_token_id for s in shards), default=-1),
            "tokenizer": self.tokenizer,
            "sources": sources,
            "shards": [asdict(s) for s in shards],
            "stats": stats or {},
        }
        atomic_write_json(self.out_dir / INDEX_FILE, index)
        (self.out_dir / PROGRESS_FILE).unlink(missing_ok=True)
        return index


#: The fields of index.json a reader needs, with their JSON types.
_INDEX_FIELDS = {"version": int, "documents": int, "tokens": int, "dtype": str,
                 "tokenizer": dict, "sources": dict, "shards": list}
_SHARD_FIELDS = {"file": str, "sha256": str, "documents": int, "tokens": int}
_TOKENIZER_FIELDS = {"name": str, "vocab_size": int, "eod_id": int, "sha256": str}


def _check_index(index: dict[str, Any], path: Path) -> None:
    """A damaged or foreign index.json is one line naming the file and the field."""
    for name, kind in _INDEX_FIELDS.items():
        if not isinstance(index.get(name), kind) or isinstance(index.get(name), bool):
            raise DatasetError(f"{path}: field {name!r} missing or not a {kind.__name__} "
                               "(damaged? prepare the dataset again)")
    if index["version"] != VERSION:
        raise DatasetError(f"{path}: index version {index['version']}, this mt-data reads "
                           f"version {VERSION}")
    if index["dtype"] not in ("uint16", "uint32"):
        raise DatasetError(f"{path}: dtype {index['dtype']!r} is not a token dtype")
    tokenizer = index["tokenizer"]
    bad = [f"{name} ({kind.__name__})" for name, kind in _TOKENIZER_FIELDS.items()
           if (name == "name" or name in tokenizer) and (  # sizes may be unknown (imports)
               not isinstance(tokenizer.get(name), kind) or isinstance(tokenizer.get(name), bool))]
    if bad:
        raise DatasetError(f"{path}: field 'tokenizer' lacks {', '.join(bad)} (damaged? "
                           "prepare the dataset again)")
    for name, counts in index["sources"].items():
        if not isinstance(counts, dict) or not all(
                isinstance(counts.get(n), int) for n in ("documents", "tokens")):
            raise DatasetError(f"{path}: source {name!r} must record its documents and tokens "
                               f"as integers, got {counts!r} (damaged? prepare the dataset "
                               "again)")
    for k, shard in enumerate(index["shards"]):
        bad = [n for n, kind in _SHARD_FIELDS.items()
               if not isinstance(shard, dict) or not isinstance(shard.get(n), kind)]
        if bad:
            raise DatasetError(f"{path}: shard {k} lacks {', '.join(bad)} (damaged? prepare "
                               "the dataset again)")
        name = shard["file"]
        if Path(name).name != name or name in ("", ".", ".."):

            raise DatasetError(f"{path}: shard {k} is named {name!r}, not a file of the "
                               "dataset folder (damaged? prepare the dataset again)")


def _read_shard(file: Path, shard: dict[str, Any], dtype: np.dtype) -> pa.RecordBatch:
    """The record batch of a shard file, checked to be the one ``shard`` (its index.json
    entry) records: tokens, id and source columns, token ids of the index's dtype, its
    documents and tokens."""
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(file), "r"))
        if reader.num_record_batches < 1:
            raise DatasetError(f"{file}: unreadable shard (it holds no record batch)")
        batch = reader.get_batch(0)
    except (OSError, pa.ArrowInvalid) as exc:
        raise DatasetError(f"{file}: unreadable shard ({' '.join(str(exc).split())})"
                           ) from None
    missing = [n for n in ("tokens", "id", "source") if n not in batch.schema.names]
    if missing:
        raise DatasetError(f"{file}: not a shard of this dataset (no {missing[0]!r} column; "
                           "damaged? prepare the dataset again)")
    kind = batch.schema.field("tokens").type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or \
            kind.value_type != pa.from_numpy_dtype(dtype):
        raise DatasetError(f"{file}: not a shard of this dataset ('tokens' is {kind}, "
                           f"{INDEX_FILE} records lists of {dtype.name}; damaged? prepare the "
                           "dataset again)")
    offsets = batch.column("tokens").offsets
    tokens = offsets[-1].as_py() - offsets[0].as_py()
    if (batch.num_rows, tokens) != (shard["documents"], shard["tokens"]):
        raise DatasetError(f"{file}: holds {batch.num_rows} documents and {tokens} tokens, "
                           f"{INDEX_FILE} records {shard['documents']} and {shard['tokens']} "
                           "(damaged? prepare the dataset again)")
    return batch


class TokenDataset:
    """Read-only, memory-mapped view of a prepared dataset folder (``index.json`` + shards).

    Opening checks that the recorded ``max_token_id`` fits the tokenizer's vocabulary and the
    dtype and agrees with the per-shard values; ``verify=True`` also checks every shard's
    SHA-256 and its real largest id.
    """

    def __init__(self, path: str | Path, verify: bool = False) -> None:
        self.path = Path(path)
        index_path = self.path / INDEX_FILE
        if not index_path.exists():
            raise DataNotFoundError(f"{self.path} has no {INDEX_FILE}: not a prepared dataset")
        try:
            self.index: dict[str, Any] = json.loads(index_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DatasetError(f"{index_path}: not valid JSON ({exc})") from None
        except RecursionError:
            raise DatasetError(f"{index_path}: not valid JSON (nested too deeply to "
                               "read)") from None
        if not isinstance(self.index, dict) or self.index.get("format") != FORMAT:
            raise DatasetError(f"{index_path} is not an {FORMAT} index")
        _check_index(self.index, index_path)
        self.dtype = np.dtype(self.index["dtype"])
        self._values: list[np.ndarray] = []
        self._batches: list[pa.RecordBatch] = []
        lengths, shard_of, starts = [], [], []
        for k, shard in enumerate(self.index["shards"]):
            file = self.path / shard["file"]
            if verify and file_sha256(file) != shard["sha256"]:
                raise DatasetError(f"checksum mismatch for {file}")
            batch = _read_shard(file, shard, self.dtype)
            column = batch.column("tokens")
            offsets = column.offsets.to_numpy()
            base = int(offsets[0])
            self._values.append(column.values.to_numpy(zero_copy_only=True))
            self._batches.append(batch)
            lengths.append(np.diff(offsets))
            starts.append(offsets[:-1] - base)
            shard_of.append(np.full(len(offsets) - 1, k, dtype=np.int32))
        cat = np.concatenate
        self.doc_lengths = cat(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)
        self.doc_starts = cat(starts).astype(np.int64) if starts else np.zeros(0, np.int64)
        self.doc_shards = cat(shard_of) if shard_of else np.zeros(0, np.int32)
        self._max_token_id = self._recorded_max_token_id()
        if verify:
            self.verify_max_token_id()

    def _recorded_max_token_id(self) -> int | None:
        """``index.json``'s max_token_id, checked against the shards' entries, the vocabulary
        and the dtype (None for datasets written before the key existed)."""
        recorded = self.index.get("max_token_id")
        if recorded is None:
            return None
        where = str(self.path / INDEX_FILE)
        if not isinstance(recorded, int) or recorded < -1:
            raise DatasetError(f"{where}: max_token_id must be an integer >= -1, got "
                               f"{recorded!r}")
        per_shard = [s.get("max_token_id") for s in self.index["shards"]]
        if None not in per_shard and max(per_shard, default=-1) != recorded:
            raise DatasetError(f"{where}: max_token_id {recorded} disagrees with its shards' "
                               f"largest id {max(per_shard, default=-1)}")
        check_token_range(recorded, self.index.get("tokenizer"), self.dtype.name, where)
        return recorded

    def verify_max_token_id(self) -> None:
        """Raise :class:`DatasetError` when a recorded largest id differs from the shards'
        real one (reads every token)."""
        overall = -1
        for k, shard in enumerate(self.index["shards"]):
            actual = int(self._values[k].max()) if self._values[k].size else -1
            overall = max(overall, actual)
            recorded = shard.get("max_token_id")
            if recorded is not None and actual != recorded:
                raise DatasetError(f"{self.path / shard['file']}: largest token id is {actual} "
                                   f"but {INDEX_FILE} records {recorded}")
        if self._max_token_id is not None and overall != self._max_token_id:
            raise DatasetError(f"{self.path / INDEX_FILE}: max_token_id {self._max_token_id} but "
                               f"the shards' largest token id is {overall}")

    @property
    def max_token_id(self) -> int:
        """Largest token id of the dataset (-1 when it has no tokens): a model needs
        ``vocab_size > max_token_id``. Read from ``index.json``; for datasets written before
        the key existed it is computed from the shards once and cached in ``cache/``."""
        if self._max_token_id is None:
            self._max_token_id = self._scan_max_token_id()
        return self._max_token_id

    def _scan_max_token_id(self) -> int:
        key = [s["sha256"] for s in self.index["shards"]]
        cached = self.path / "cache" / "max-token-id.json"
        with suppress(OSError, ValueError, KeyError, TypeError):
            data = json.loads(cached.read_text())
            if data["shards"] == key and isinstance(data["max_token_id"], int):
                return data["max_token_id"]
        value = max((int(v.max()) for v in self._values if v.size), default=-1)
        check_token_range(value, self.index.get("tokenizer"), self.dtype.name, str(self.path))
        with suppress(OSError):  # read-only data: computed again next time, only slower
            cached.parent.mkdir(exist_ok=True)
            atomic_write_json(cached, {"shards": key, "max_token_id": value})
        return value

    def __len__(self) -> int:
        return len(self.doc_lengths)

    @property
    def num_tokens(self) -> int:
        """Tokens over all documents (EOD tokens included)."""
        return int(self.doc_lengths.sum())

    @property
    def tokenizer(self) -> dict[str, Any]:
        """Tokenizer metadata (name, vocab_size, eod_id, eod_token)."""
        return dict(self.index["tokenizer"])

    def document(self, i: int) -> np.ndarray:
        """Token ids of document ``i`` (a read-only view into the memory map)."""
        return self.tokens(i, 0, int(self.doc_lengths[i]))

    def tokens(self, i: int, offset: int, length: int) -> np.ndarray:
        """``length`` token ids of document ``i`` starting at ``offset`` (a view)."""
        start = int(self.doc_starts[i]) + offset
        return self._values[int(self.doc_shards[i])][start : start + length]

    def metadata(self, i: int) -> tuple[str, str]:
        """(id, source) of document ``i``."""
        shard = int(self.doc_shards[i])
        row = i - int(np.searchsorted(self.doc_shards, shard, side="left"))
        batch = self._batches[shard]
        return batch.column("id")[row].as_py(), batch.column("source")[row].as_py()

    def source_counts(self) -> Counter[str]:
        """Documents per source."""
        return Counter({k: v["documents"] for k, v in self.index["sources"].items()})

    def verify(self) -> list[str]:
        """Files whose SHA-256 does not match the index (empty when all are intact)."""
        return [s["file"] for s in self.index["shards"]
                if file_sha256(self.path / s["file"]) != s["sha256"]]

    def check_shards(self) -> None:
        """Raise :class:`DatasetError` naming the first shard whose SHA-256 differs from
        ``index.json``'s record (flipped bytes, a partial copy). Each shard is read once per
        version: its digest, size and modification time are stamped in
        ``cache/verified.json`` (where the folder is writable), so a later run reads only
        shards that changed since."""
        stamps_path = self.path / "cache" / VERIFIED_FILE
        try:
            stamps = json.loads(stamps_path.read_text())
        except (OSError, ValueError):
            stamps = {}
        checked = {}
        for shard in self.index["shards"]:
            file = self.path / shard["file"]
            stat = file.stat()
            stamp = [shard["sha256"], stat.st_size, stat.st_mtime_ns]
            if stamps.get(shard["file"]) != stamp and file_sha256(file) != shard["sha256"]:
                raise DatasetError(f"{file}: damaged (its SHA-256 differs from the one "
                                   f"{INDEX_FILE} records); prepare the dataset again")
            checked[shard["file"]] = stamp
        if checked != stamps:
            with suppress(OSError):  # read-only data: checked again next time, only slower
                stamps_path.parent.mkdir(exist_ok=True)
                atomic_write_json(stamps_path, checked)
