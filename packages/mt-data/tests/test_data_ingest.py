"""Ingest on real text: formats, compression, text folders, and bad input reported by file:line."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mt_data.corpus import iter_corpus
from mt_data.errors import DataNotFoundError
from mt_data.ingest import (
    BadInputError,
    ErrorLog,
    IngestConfig,
    expand_inputs,
    iter_documents,
    plan_work,
)


@pytest.fixture(scope="module")
def docs() -> list[dict[str, str]]:
    return list(iter_corpus())[:30]


def _texts(batches: list[pa.RecordBatch]) -> list[str]:
    return [t for b in batches for t in b.column("text").to_pylist()]


def _jsonl(docs: list[dict[str, str]], key: str = "text") -> bytes:
    return b"".join(json.dumps({"id": d["id"], key: d["text"]}).encode() + b"\n" for d in docs)


def test_jsonl_gz_zst_same_documents(docs: list[dict[str, str]], tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")  # optional dependency, for .zst input
    raw = _jsonl(docs, key="body")
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    expected = [d["text"] for d in docs]
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst"):
        log = ErrorLog()
        batches = list(iter_documents([tmp_path / name], IngestConfig(text_key="body",
                                                                       batch_docs=7), log))
        assert _texts(batches) == expected
        assert all(b.num_rows <= 7 for b in batches)  # bounded batches
        assert batches[0].column("id")[0].as_py() == docs[0]["id"]
        assert batches[0].column("source")[0].as_py() == name.split(".")[0]
        assert log.total == 0


def test_parquet_and_text_folder(docs: list[dict[str, str]], tmp_path: Path) -> None:
    table = pa.table({"content": [d["text"] for d in docs[:10]] + [None],
                      "id": [d["id"] for d in docs[:10]] + ["null-row"]})
    pq.write_table(table, tmp_path / "part.parquet", row_group_size=4)
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, d in enumerate(docs[10:20]):
        (folder / f"doc{i:02d}.txt").write_text(d["text"], encoding="utf-8")
    (folder / "doc99.txt.gz").write_bytes(gzip.compress(docs[20]["text"].encode()))
    log = ErrorLog()
    batches = list(iter_documents([tmp_path / "part.parquet"], IngestConfig(text_key="content"),
                                  log))
    assert _texts(batches) == [d["text"] for d in docs[:10]]
    assert [str(e) for e in log.errors] == [f"{tmp_path / 'part.parquet'}:11: missing_key: "
                                            "'content' is null"]
    log = ErrorLog()
    batches = list(iter_documents([folder], IngestConfig(), log))
    assert _texts(batches) == [d["text"] for d in docs[10:21]]
    assert set(_texts_sources(batches)) == {"texts"}
    items, unknown = plan_work(expand_inputs([folder]))
    assert len(items) == 1 and items[0].kind == "text" and unknown == []


def _texts_sources(batches: list[pa.RecordBatch]) -> list[str]:
    return [s for b in batches for s in b.column("source").to_pylist()]


def _bad_jsonl(docs: list[dict[str, str]]) -> bytes:
    good = [json.dumps({"text": d["text"]}).encode() for d in docs[:4]]
    lines = [
        good[0],
        b'{"text": "truncated ' ,                                   # 2: malformed JSON
        good[1],
        b'{"text": "caf\xe9 au lait"}',                             # 4: invalid UTF-8 (latin-1)
        b"",                                                        # 5: blank: ignored
        json.dumps({"body": docs[5]["text"]}).encode(),             # 6: missing text key
        json.dumps({"text": 42}).encode(),                          # 7: not a string
        good[2],
        b"[1, 2, 3]",                                               # 9: not an object
        good[3],
    ]
    return b"\n".join(lines) + b"\n"


def test_bad_input_reported_with_file_and_line(docs: list[dict[str, str]],
                                               tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_bad_jsonl(docs))
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    (tmp_path / "notes.pdf").write_bytes(b"%PDF")
    log = ErrorLog("skip")
    batches = list(iter_documents([bad, empty, tmp_path / "notes.pdf"], IngestConfig(), log))
    assert _texts(batches) == [d["text"] for d in docs[:4]]  # every good line kept
    reports = [(Path(e.file).name, e.line, e.kind) for e in log.errors]
    assert reports == [
        ("notes.pdf", 0, "unsupported"),
        ("bad.jsonl", 2, "json"), ("bad.jsonl", 4, "utf8"), ("bad.jsonl", 6, "missing_key"),
        ("bad.jsonl", 7, "not_text"), ("bad.jsonl", 9, "json"), ("empty.jsonl", 0, "empty_file"),
    ]
    assert log.total == 7
    assert dict(log.counts) == {"unsupported": 1, "json": 2, "utf8": 1, "missing_key": 1,
                                "not_text": 1, "empty_file": 1}
    assert str(log.errors[1]).startswith(f"{bad}:2: json: malformed JSON")


def test_on_error_stop(docs: list[dict[str, str]], tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_bad_jsonl(docs))
    with pytest.raises(BadInputError, match=r"bad\.jsonl:2: json"):
        list(iter_documents([bad], IngestConfig(), ErrorLog("stop")))
    with pytest.raises(ValueError, match="on_error"):
        ErrorLog("ignore")


def test_invalid_utf8_text_file_line(docs: list[dict[str, str]], tmp_path: Path) -> None:
    folder = tmp_path / "t"
    folder.mkdir()
    body = docs[0]["text"].encode()
    third_line = body.index(b"\n", body.index(b"\n") + 1) + 1
    (folder / "a.txt").write_bytes(body[:third_line] + b"\xff\xfe" + body[third_line:])
    (folder / "b.txt").write_bytes(b"   \n")
    log = ErrorLog()
    assert list(iter_documents([folder], IngestConfig(), log)) == []
    assert [(Path(e.file).name, e.line, e.kind) for e in log.errors] == [
        ("a.txt", 3, "utf8"), ("b.txt", 0, "empty_file")]


def test_missing_input(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        expand_inputs([tmp_path / "nope.jsonl"])


def test_a_linked_folder_in_an_input_folder_is_read(tmp_path: Path) -> None:
    """A folder linked into an input folder is searched like the others (not skipped without
    a word); a link back to a folder already searched (a loop) is searched once."""
    shared = tmp_path / "shared"
    (shared / "deep").mkdir(parents=True)
    (shared / "deep" / "b.txt").write_text("b")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a")
    (corpus / ".hidden.txt").write_text("hidden")
    (corpus / "linked").symlink_to(shared)
    (corpus / "linked-file.txt").symlink_to(shared / "deep" / "b.txt")
    (shared / "deep" / "back").symlink_to(corpus)  # a loop
    assert expand_inputs([corpus]) == [corpus / "a.txt", corpus / "linked" / "deep" / "b.txt",
                                       corpus / "linked-file.txt"]


def test_an_input_folder_entry_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    """A link to nothing, or a pipe, inside an input folder is refused in one line naming it,
    not left out of the dataset without a word."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a")
    (corpus / "gone.txt").symlink_to(tmp_path / "moved.txt")
    with pytest.raises(DataNotFoundError, match=r"gone.txt is a link to .*moved.txt, which "
                                                "does not exist"):
        expand_inputs([corpus])
    (corpus / "gone.txt").unlink()
    os.mkfifo(corpus / "pipe.jsonl")
    with pytest.raises(DataNotFoundError, match="pipe.jsonl is not a regular file"):
        expand_inputs([corpus])


def test_a_utf8_byte_order_mark_is_not_text(docs: list[dict[str, str]], tmp_path: Path) -> None:
    """A file starting with UTF-8's byte-order mark (as some Windows editors write them): a
    JSONL file's first document is read (not a malformed line), a text file's text does not
    start with U+FEFF; one inside a document's text stays."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + _jsonl(docs[:3]))
    (tmp_path / "b.txt").write_bytes(bom + b"plain text\n" + bom + b"kept")
    log = ErrorLog("stop")
    texts = _texts(list(iter_documents([tmp_path / "a.jsonl", tmp_path / "b.txt"],
                                       IngestConfig(), log)))
    assert texts == [d["text"] for d in docs[:3]] + ["plain text\n\ufeffkept"]
    assert log.errors == []


def test_large_jsonl_split_into_ranges(docs: list[dict[str, str]], tmp_path: Path) -> None:
    lines = [json.dumps({"text": d["text"]}) for d in docs]
    lines.insert(25, "{broken")
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    items, _ = plan_work([path], split_bytes=20_000)
    assert len(items) > 3
    assert items[0].start == 0 and items[-1].end == path.stat().st_size
    assert all(a.end == b.start for a, b in zip(items, items[1:]))
    whole = ErrorLog()
    ref = _texts(list(iter_documents([path], IngestConfig(split_bytes=10**9), whole)))
    log = ErrorLog()
    split = _texts(list(iter_documents([path], IngestConfig(split_bytes=20_000), log)))
    assert split == ref == [d["text"] for d in docs]
    # Line numbers stay those of the whole file.
    assert [(e.line, e.kind) for e in log.errors] == [(26, "json")] == \
        [(e.line, e.kind) for e in whole.errors]
