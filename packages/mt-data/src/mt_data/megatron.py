"""Megatron-LM ``.bin`` / ``.idx`` (MMIDIDX) export and import.

``.bin``: all sequences' token ids back to back in one dtype. ``.idx`` (little endian):
magic ``b"MMIDIDX\\x00\\x00"``, version u64 = 1, dtype code u8, sequence count u64, document
count u64 (sequences + 1), sequence lengths int32[n], sequence byte offsets int64[n], document
boundaries int64[docs] (sequence indices, starting with 0). We write one sequence per document
(EOD included), which is what Megatron's ``preprocess_data.py`` produces without sentence
splitting. Import checks every id against the tokenizer's vocabulary before writing anything
(ids are never wrapped into a smaller dtype), and a ``.bin`` shorter than its ``.idx`` says is
refused.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mt_data.errors import DataError, DataNotFoundError, DatasetError
from mt_data.paths import blocking_file, existing_file, foreign_entries, output_clash, unwritable
from mt_data.shards import (
    ShardSetWriter,
    TokenDataset,
    atomic_replace,
    atomic_write_bytes,
    removed_on_failure,
    temp_path,
)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents
_SCAN = 1 << 26  # token ids checked per step on import


def megatron_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype Megatron can read for our token dtype (uint32 ids are stored as int32)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.int32) if dtype == np.uint32 else dtype


def encode_index(dtype: np.dtype, sizes: np.ndarray, doc_idx: np.ndarray) -> bytes:
    """The bytes of an ``.idx`` file for sequences of ``sizes`` tokens."""
    dtype = np.dtype(dtype)
    sizes32 = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes32), dtype=np.int64)
    if len(sizes32) > 1:
        np.cumsum(sizes32[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    head = _HEADER.pack(MAGIC, VERSION, CODE_OF[dtype], len(sizes32), len(doc_idx))
    return (head + sizes32.astype("<i4").tobytes() + pointers.astype("<i8").tobytes()
            + np.asarray(doc_idx, dtype="<i8").tobytes())


@dataclass(frozen=True)
class MegatronIndex:
    """Parsed ``.idx`` file."""

    dtype: np.dtype
    sizes: np.ndarray
    pointers: np.ndarray
    doc_idx: np.ndarray


def read_index(path: str | Path) -> MegatronIndex:
    """Parse and validate an ``.idx`` file (memory-mapped arrays)."""
    if not os.path.isfile(path):
        raise DataNotFoundError(f"{path} does not exist")
    if os.path.getsize(path) < _HEADER.size:
        raise DatasetError(f"{path}: {os.path.getsize(path)} bytes is too short for an MMIDIDX "
                           f"header")
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    magic, version, code, n_seq, n_doc = _HEADER.unpack(bytes(buffer[: _HEADER.size]))
    if magic != MAGIC:
        raise DatasetError(f"{path}: bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise DatasetError(f"{path}: index version {version}, expected {VERSION}")
    if code not in DTYPE_CODES:
        raise DatasetError(f"{path}: unknown dtype code {code}")
    off = _HEADER.size
    need = off + n_seq * 4 + n_seq * 8 + n_doc * 8
    if len(buffer) < need:
        raise DatasetError(f"{path}: {len(buffer)} bytes but the header announces {need}")
    sizes = np.frombuffer(buffer, dtype="<i4", count=n_seq, offset=off)
    pointers = np.frombuffer(buffer, dtype="<i8", count=n_seq, offset=off + 4 * n_seq)
    doc_idx = np.frombuffer(buffer, dtype="<i8", count=n_doc, offset=off + 12 * n_seq)
    return MegatronIndex(DTYPE_CODES[code], sizes, pointers, doc_idx)


class MegatronReader:
    """Random access to the sequences of a ``PREFIX.bin`` / ``PREFIX.idx`` pair."""

    def __init__(self, prefix: str | Path) -> None:
        self.index = read_index(f"{prefix}.idx")
        path = f"{prefix}.bin"
        if not os.path.isfile(path):
            raise DataNotFoundError(f"{path} does not exist")
        size = os.path.getsize(path)
        self.bin = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        ends = self.index.pointers + self.index.sizes.astype(np.int64) * self.index.dtype.itemsize
        need = int(ends.max()) if len(ends) else 0
        if size < need:
            raise DatasetError(f"{path}: {size} bytes but {prefix}.idx describes {need} (a "
                               f"truncated .bin, or one of another .idx)")

    def __len__(self) -> int:
        return len(self.index.sizes)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence i (a view into the memory map)."""
        size = int(self.index.sizes[i])
        length = size - offset if length is None else length
        start = int(self.index.pointers[i]) + offset * self.index.dtype.itemsize
        return np.frombuffer(self.bin, dtype=self.index.dtype, count=length, offset=start)


def export_megatron(data: TokenDataset | str | Path, prefix: str | Path,
                    overwrite: bool = True) -> dict[str, Any]:
    """Write ``PREFIX.bin`` / ``PREFIX.idx``: one sequence per document, EOD included.
    Without ``overwrite`` (the command line's default) an existing ``.bin`` or ``.idx`` is
    refused; like a prefix where no file can be created, before anything is read."""
    prefix = Path(prefix)
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    if prefix.name in ("", ".", "..") or prefix.is_dir():
        raise DataError(f"PREFIX {prefix} is a folder; give a path and a file name, e.g. "
                        f"{prefix / 'data'} (writes data.bin and data.idx there)")
    for path in (bin_path, idx_path):
        if path.is_dir():
            raise DataError(f"PREFIX {prefix}: {path} is a folder; choose another PREFIX")
    if (blocker := blocking_file(bin_path)) is not None:
        raise DataError(f"PREFIX {prefix}: {blocker} is a file, not a folder; choose another "
                        "PREFIX")
    if not isinstance(data, TokenDataset) and (
            clash := output_clash("PREFIX", prefix, [data])) is not None:
        raise DataError(clash)
    for path in (bin_path, idx_path):
        if why := existing_file(f"PREFIX {prefix}:", path, overwrite):
            raise DataError(why)
    if why := unwritable("PREFIX", prefix):
        raise DataError(why)
    ds = data if isinstance(data, TokenDataset) else TokenDataset(data)
    dtype = megatron_dtype(ds.dtype)
    try:
        _write_pair(ds, dtype, bin_path, idx_path)
    except OSError as err:  # e.g. a full disk
        raise DataError(f"PREFIX {prefix}: writing failed: {err.strerror or err}") from None
    return {"documents": len(ds), "tokens": ds.num_tokens, "dtype": dtype.name,
            "bin": str(bin_path), "idx": str(idx_path), "bytes": bin_path.stat().st_size}


def _write_pair(ds: TokenDataset, dtype: np.dtype, bin_path: Path, idx_path: Path) -> None:
    """Write the ``.bin`` then the ``.idx`` of ``ds``, each atomically."""
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    with removed_on_failure(temp_path(bin_path)) as tmp_bin:
        with open(tmp_bin, "wb") as f:
            for k in range(len(ds.index["shards"])):
                docs = np.flatnonzero(ds.doc_shards == k)
                if len(docs) == 0:
                    continue
                start = int(ds.doc_starts[docs[0]])
                stop = int(ds.doc_starts[docs[-1]] + ds.doc_lengths[docs[-1]])
                f.write(ds.tokens(int(docs[0]), 0, stop - start).astype(dtype,
                                                                       copy=False).tobytes())
        atomic_replace(tmp_bin, bin_path)  # .bin first: readers check it holds what .idx says
    atomic_write_bytes(idx_path, encode_index(dtype, ds.doc_lengths, np.arange(len(ds) + 1)))


def _check_ids(reader: MegatronReader, prefix: str | Path, tokenizer: dict[str, Any]) -> int:
    """Largest token id of the ``.bin``; raises :class:`DatasetError` naming the file, the
    document, the id and the dtype when an id is negative or outside the vocabulary."""
    dtype, vocab = reader.index.dtype, int(tokenizer["vocab_size"])
    if dtype.kind not in "iu":
        raise DatasetError(f"{prefix}.idx: dtype {dtype} does not hold token ids")
    sizes = np.asarray(reader.index.sizes, dtype=np.int64)
    total = int(sizes.sum())
    start = int(reader.index.pointers[0]) if len(sizes) else 0
    ids = np.frombuffer(reader.bin, dtype=dtype, count=total, offset=start)
    largest = -1
    for lo in range(0, total, _SCAN):
        block = ids[lo : lo + _SCAN]
        low, high = int(block.min()), int(block.max())
        largest = max(largest, high)
        if low >= 0 and high < vocab:
            continue
        pos = lo + int(np.argmax((block < 0) | (block >= vocab)))
        seq = int(np.searchsorted(np.cumsum(sizes), pos, side="right"))
        doc = int(np.searchsorted(reader.index.doc_idx, seq, side="right")) - 1
        raise DatasetError(
            f"{prefix}.bin: token id {int(ids[pos])} ({dtype}) in document {doc} is outside the "
            f"vocabulary of tokenizer {tokenizer.get('name')!r} ({vocab} ids): import with the "
            f"--tokenizer the ids come from")
    return largest


def _check_import_output(prefix: str | Path, out_dir: Path) -> None:
    """Refuse an output that is or holds the ``.bin``/``.idx``, is a file, or is a folder
    holding anything (a dataset or other files): an import writes a new folder only."""
    clash = output_clash("OUTPUT", out_dir, [f"{prefix}.bin", f"{prefix}.idx"])
    if clash:
        raise DataError(clash)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir} is a file; name a new folder for the imported dataset")
    held = foreign_entries(out_dir, ())
    if held:
        what = "a prepared dataset" if "index.json" in held else \
            ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise DataError(f"{out_dir} already holds {what}: import-megatron writes only a new or "
                        "empty folder (it never replaces a dataset or other files); choose "
                        "another OUTPUT folder")


def import_megatron(prefix: str | Path, out_dir: str | Path, tokenizer: dict[str, Any],
                    shard_tokens: int = 64 << 20) -> dict[str, Any]:
    """Read ``PREFIX.bin/.idx`` into a token-shard folder; a document = its sequences joined.

    ``tokenizer`` is the metadata to record (see ``Tokenizer.describe``). Every id is checked
    first (``0 <= id < vocab_size``, else :class:`DatasetError` and nothing is written); ids are
    stored in the smallest unsigned dtype holding the largest id and the vocabulary.
    ``out_dir`` must be new or an empty folder (:class:`DataError` before anything is read):
    a dataset there would lose its index to the import and keep orphaned shards.
    """
    _check_import_output(prefix, Path(out_dir))
    reader = MegatronReader(prefix)
    doc_idx = np.asarray(reader.index.doc_idx, dtype=np.int64)
    if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != len(reader):
        raise DatasetError(f"{prefix}.idx: document boundaries must run from 0 to {len(reader)}")
    if len(doc_idx) == 1:
        raise DatasetError(f"{prefix}.idx: holds no documents")
    largest = _check_ids(reader, prefix, tokenizer)
    vocab = int(tokenizer["vocab_size"])
    dtype = np.dtype(np.uint16 if max(largest, vocab - 1) <= 0xFFFF else np.uint32)
    writer = ShardSetWriter(out_dir, tokenizer, dtype.name, resume=False)
    seq_sizes = np.asarray(reader.index.sizes, dtype=np.int64)
    doc_sizes = np.add.reduceat(seq_sizes, doc_idx[:-1]) if len(seq_sizes) else seq_sizes
    doc_sizes[doc_idx[:-1] == doc_idx[1:]] = 0
    name = Path(prefix).name
    # Consecutive sequences are contiguous in .bin, so a run of documents is one slice.
    doc, shard = 0, 0
    n_docs = len(doc_idx) - 1
    while doc < n_docs:
        cum = np.cumsum(doc_sizes[doc:])
        stop = doc + max(1, int(np.searchsorted(cum, shard_tokens, side="right")))
        first_seq, last_seq = int(doc_idx[doc]), int(doc_idx[stop])
        total = int(seq_sizes[first_seq:last_seq].sum())
        start = int(reader.index.pointers[first_seq]) if total else 0
        tokens = np.frombuffer(reader.bin, dtype=reader.index.dtype, count=total, offset=start)
        ids = [f"{name}:{i}" for i in range(doc, stop)]
        writer.add(f"shard-{shard:05d}.arrow", tokens.astype(dtype), doc_sizes[doc:stop], ids,
                   [name] * (stop - doc))
        doc, shard = stop, shard + 1
    return writer.finish({"imported_from": str(prefix)})
