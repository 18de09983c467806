"""Token shards: Arrow IPC files plus a small JSON index, memory-mapped for random access.

A shard is one uncompressed Arrow IPC file holding one record batch with columns ``tokens``
(``list<uint16|uint32>``: one row per document, EOD included), ``id`` and ``source``. Arrow
lists store their values contiguously with an offsets array, so a memory-mapped shard gives a
flat numpy token array and document offsets with zero copies: reading any token span is a slice.

``index.json`` records documents, tokens, sources, the tokenizer, dtype and each shard's size
and SHA-256. Every file is written to a temporary name and renamed (atomic on POSIX); finished
shards are also logged in ``progress.jsonl`` so an interrupted run resumes at the shard level.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

INDEX_FILE = "index.json"
PROGRESS_FILE = "progress.jsonl"
FORMAT = "mt-data-token-shards"
VERSION = 1


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    tmp = path.with_name(f".{path.name}.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    os.replace(tmp, path)
    per_source: dict[str, list[int]] = {}
    names = src.to_pylist()
    for name, length in zip(names, lengths.tolist(), strict=True):
        entry = per_source.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += length
    return ShardInfo(path.name, len(lengths), int(lengths.sum()), path.stat().st_size,
                     file_sha256(path), per_source)


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
                except (json.JSONDecodeError, TypeError):
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
        """Write ``index.json`` (shards in name order) and return it."""
        shards = [self.shards[name] for name in sorted(self.shards)]
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
            "tokenizer": self.tokenizer,
            "sources": sources,
            "shards": [asdict(s) for s in shards],
            "stats": stats or {},
        }
        atomic_write_json(self.out_dir / INDEX_FILE, index)
        (self.out_dir / PROGRESS_FILE).unlink(missing_ok=True)
        return index


class TokenDataset:
    """Read-only, memory-mapped view of a prepared dataset folder (``index.json`` + shards)."""

    def __init__(self, path: str | Path, verify: bool = False) -> None:
        self.path = Path(path)
        index_path = self.path / INDEX_FILE
        if not index_path.exists():
            raise FileNotFoundError(f"{self.path} has no {INDEX_FILE}: not a prepared dataset")
        self.index: dict[str, Any] = json.loads(index_path.read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{index_path} is not an {FORMAT} index")
        self.dtype = np.dtype(self.index["dtype"])
        self._values: list[np.ndarray] = []
        self._batches: list[pa.RecordBatch] = []
        lengths, shard_of, starts = [], [], []
        for k, shard in enumerate(self.index["shards"]):
            file = self.path / shard["file"]
            if verify and file_sha256(file) != shard["sha256"]:
                raise ValueError(f"checksum mismatch for {file}")
            batch = pa.ipc.open_file(pa.memory_map(str(file), "r")).get_batch(0)
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
