"""Megatron .bin/.idx (MMIDIDX): byte layout, export -> import round trip on real text."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from mt_data.corpus import iter_corpus
from mt_data.megatron import (
    MegatronReader,
    encode_index,
    export_megatron,
    import_megatron,
    read_index,
)
from mt_data.shards import ShardSetWriter, TokenDataset
from mt_data.tokenizer import gpt2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    tok = gpt2()
    docs = list(iter_corpus())[::6]  # 31 real documents
    batch = tok.encode_batch([d["text"] for d in docs])
    out = tmp_path_factory.mktemp("shards")
    writer = ShardSetWriter(out, tok.describe(), tok.dtype.name)
    half = int(np.cumsum(batch.lengths)[14])
    writer.add("shard-0.arrow", batch.tokens[:half], batch.lengths[:15],
               [d["id"] for d in docs[:15]], [d["source"] for d in docs[:15]])
    writer.add("shard-1.arrow", batch.tokens[half:], batch.lengths[15:],
               [d["id"] for d in docs[15:]], [d["source"] for d in docs[15:]])
    writer.finish()
    return TokenDataset(out)


def test_idx_bytes_layout(dataset: TokenDataset, tmp_path: Path) -> None:
    info = export_megatron(dataset, tmp_path / "corpus_text_document")
    n = len(dataset)
    raw = (tmp_path / "corpus_text_document.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)           # version
    assert raw[17] == 8                                     # dtype code 8 = uint16
    assert struct.unpack("<QQ", raw[18:34]) == (n, n + 1)   # sequences, documents
    sizes = np.frombuffer(raw, "<i4", n, 34)
    pointers = np.frombuffer(raw, "<i8", n, 34 + 4 * n)
    doc_idx = np.frombuffer(raw, "<i8", n + 1, 34 + 12 * n)
    assert len(raw) == 34 + 4 * n + 8 * n + 8 * (n + 1)
    np.testing.assert_array_equal(sizes, dataset.doc_lengths)
    np.testing.assert_array_equal(pointers, np.concatenate([[0], np.cumsum(sizes)[:-1] * 2]))
    np.testing.assert_array_equal(doc_idx, np.arange(n + 1))
    bin_ids = np.frombuffer((tmp_path / "corpus_text_document.bin").read_bytes(), "<u2")
    np.testing.assert_array_equal(bin_ids, np.concatenate([dataset.document(i) for i in range(n)]))
    assert bin_ids[sizes[0] - 1] == 50256  # EOD closes each document
    assert info["documents"] == n and info["dtype"] == "uint16"


def test_round_trip(dataset: TokenDataset, tmp_path: Path) -> None:
    export_megatron(dataset, tmp_path / "mg")
    reader = MegatronReader(tmp_path / "mg")
    assert len(reader) == len(dataset)
    np.testing.assert_array_equal(reader.get(7), dataset.document(7))
    np.testing.assert_array_equal(reader.get(7, 3, 5), dataset.document(7)[3:8])
    index = import_megatron(tmp_path / "mg", tmp_path / "back", dataset.tokenizer,
                            shard_tokens=40_000)
    back = TokenDataset(tmp_path / "back", verify=True)
    assert len(index["shards"]) > 1  # split by shard_tokens
    assert len(back) == len(dataset) and back.num_tokens == dataset.num_tokens
    for i in range(len(dataset)):
        np.testing.assert_array_equal(back.document(i), dataset.document(i))
    assert back.document(2)[-1] == 50256 and back.tokenizer == dataset.tokenizer


def test_import_joins_sequences_of_a_document(tmp_path: Path) -> None:
    # Megatron with sentence splitting: document 0 = sequences 0-1, document 1 = sequence 2.
    seqs = [np.array([5, 6, 7], np.int32), np.array([8], np.int32), np.array([9, 10], np.int32)]
    (tmp_path / "s.bin").write_bytes(np.concatenate(seqs).tobytes())
    (tmp_path / "s.idx").write_bytes(encode_index(np.dtype(np.int32), [3, 1, 2], [0, 2, 3]))
    assert read_index(tmp_path / "s.idx").dtype == np.int32
    import_megatron(tmp_path / "s", tmp_path / "out", {"name": "x", "vocab_size": 100,
                                                        "eod_id": 0})
    ds = TokenDataset(tmp_path / "out")
    assert [ds.document(i).tolist() for i in range(len(ds))] == [[5, 6, 7, 8], [9, 10]]


def test_bad_index(tmp_path: Path) -> None:
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX" + bytes(40))
    with pytest.raises(ValueError, match="bad magic"):
        read_index(tmp_path / "x.idx")
    good = encode_index(np.dtype(np.uint16), [3, 4], [0, 1, 2])
    (tmp_path / "y.idx").write_bytes(good[:-8])
    with pytest.raises(ValueError, match="header announces"):
        read_index(tmp_path / "y.idx")


def test_megatron_core_reader(dataset: TokenDataset, tmp_path: Path) -> None:
    """Cross-check with Megatron's own reader (megatron-core: a pinned test dependency)."""
    import megatron.core.datasets.indexed_dataset as indexed
    export_megatron(dataset, tmp_path / "mg")
    theirs = indexed.IndexedDataset(str(tmp_path / "mg"))
    assert len(theirs) == len(dataset)
    for i in range(len(dataset)):
        np.testing.assert_array_equal(theirs[i], dataset.document(i))
