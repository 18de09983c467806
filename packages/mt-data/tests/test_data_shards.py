"""Arrow token shards: round trip on real text, index contents, checksums, atomic writes, resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from mt_data.corpus import iter_corpus
from mt_data.shards import PROGRESS_FILE, ShardSetWriter, TokenDataset
from mt_data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def encoded():
    tok = load_tokenizer("tokenizer-1k")
    docs = list(iter_corpus())
    batch = tok.encode_batch([d["text"] for d in docs])
    return tok, docs, batch


def _write(out: Path, encoded, parts: int = 3, resume: bool = True) -> ShardSetWriter:
    tok, docs, batch = encoded
    writer = ShardSetWriter(out, tok.describe(), tok.dtype.name, resume=resume)
    ends = np.cumsum(batch.lengths)
    cuts = np.linspace(0, len(docs), parts + 1).astype(int)
    for k in range(parts):
        a, b = cuts[k], cuts[k + 1]
        lo = int(ends[a - 1]) if a else 0
        name = f"shard-{k:05d}.arrow"
        if writer.done(name):
            continue
        writer.add(name, batch.tokens[lo : int(ends[b - 1])], batch.lengths[a:b],
                   [d["id"] for d in docs[a:b]], [d["source"] for d in docs[a:b]])
    return writer


def test_round_trip(encoded, tmp_path: Path) -> None:
    tok, docs, batch = encoded
    index = _write(tmp_path, encoded).finish({"note": "test"})
    assert index["documents"] == 181 and index["tokens"] == len(batch.tokens)
    assert index["dtype"] == "uint16" and index["tokenizer"]["vocab_size"] == 1000
    assert index["sources"]["moby-dick"]["documents"] == 135
    assert index["sources"]["sotu"]["documents"] == 46
    assert len(index["shards"]) == 3 and all(len(s["sha256"]) == 64 for s in index["shards"])
    assert not list(tmp_path.glob(".*tmp")) and not (tmp_path / PROGRESS_FILE).exists()
    ds = TokenDataset(tmp_path, verify=True)
    assert len(ds) == 181 and ds.num_tokens == len(batch.tokens)
    for i in (0, 60, 61, 120, 180):
        ids = ds.document(i)
        np.testing.assert_array_equal(ids, batch.documents()[i])
        assert tok.decode(ids[:-1]) == docs[i]["text"]
        assert ds.metadata(i) == (docs[i]["id"], docs[i]["source"])
    np.testing.assert_array_equal(ds.tokens(70, 5, 10), batch.documents()[70][5:15])
    # Zero copy: a document is a view into the memory-mapped shard, not a copy.
    assert not ds.document(3).flags.owndata and not ds.document(3).flags.writeable


def test_shard_file_layout(encoded, tmp_path: Path) -> None:
    _write(tmp_path, encoded, parts=1).finish()
    table = pa.ipc.open_file(pa.memory_map(str(tmp_path / "shard-00000.arrow"))).read_all()
    assert table.schema.names == ["tokens", "id", "source"]
    assert table.schema.field("tokens").type == pa.list_(pa.uint16())
    assert table.num_rows == 181


def test_checksum_detects_corruption(encoded, tmp_path: Path) -> None:
    _write(tmp_path, encoded).finish()
    path = tmp_path / "shard-00001.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert TokenDataset(tmp_path).verify() == ["shard-00001.arrow"]
    with pytest.raises(ValueError, match="checksum mismatch"):
        TokenDataset(tmp_path, verify=True)


def test_resume_skips_finished_shards(encoded, tmp_path: Path) -> None:
    writer = _write(tmp_path, encoded, parts=3)
    # Simulate a crash after two shards: drop shard 2 from the log, tear the log's last line.
    lines = (tmp_path / PROGRESS_FILE).read_text().splitlines()
    (tmp_path / PROGRESS_FILE).write_text("\n".join(lines[:2]) + "\n" + lines[2][:20])
    first_two = {name: (tmp_path / name).stat().st_mtime_ns for name in list(writer.shards)[:2]}
    resumed = ShardSetWriter(tmp_path, {}, "uint16", resume=True)
    assert sorted(resumed.shards) == ["shard-00000.arrow", "shard-00001.arrow"]
    index = _write(tmp_path, encoded, parts=3).finish()
    assert index["documents"] == 181
    for name, mtime in first_two.items():
        assert (tmp_path / name).stat().st_mtime_ns == mtime  # not rewritten
    fresh = ShardSetWriter(tmp_path / "other", {}, "uint16")
    assert not fresh.shards


def test_not_a_dataset(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a prepared dataset"):
        TokenDataset(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="is not an"):
        TokenDataset(tmp_path)
