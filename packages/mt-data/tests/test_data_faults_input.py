"""Faults in the input, on real files: truncated / corrupt .gz and .zst, a wrong text key, empty
inputs and fully filtered runs, exact bad-line counts; each one clear line, CLI exit status 2."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mt_data.cli import app
from mt_data.compressed import check_stream, open_binary
from mt_data.corpus import iter_corpus
from mt_data.decontam import DecontamConfig
from mt_data.errors import StreamError
from mt_data.ingest import (
    BadInputError,
    ErrorLog,
    IngestConfig,
    InputError,
    TextKeyError,
    iter_documents,
)
from mt_data.pipeline import NoDocumentsError, PrepareConfig, prepare
from mt_data.shards import TokenDataset
from mt_data.stages import CleanConfig
from mt_data.tokenizer import load_tokenizer

zstandard = pytest.importorskip("zstandard")  # optional dependency, for .zst input
runner = CliRunner()
GZ_CUT = "truncated: the gzip stream ends before its end-of-stream marker (the file is incomplete)"
FAST = ["--tokenizer", "tokenizer-1k", "--workers", "1", "--no-fuzzy-dedup"]


@pytest.fixture(scope="module")
def docs() -> list[dict[str, str]]:
    return list(iter_corpus())


def _lines(docs: list[dict[str, str]], n: int = 1200, key: str = "text") -> bytes:
    """``n`` JSONL documents: 400-character pieces of the real corpus."""
    out = []
    for i in range(n):
        text = docs[i % len(docs)]["text"]
        start = (i // len(docs)) * 400 % max(1, len(text) - 400)
        out.append(json.dumps({"id": f"d{i}", key: text[start : start + 400]}))
    return ("\n".join(out) + "\n").encode()


def _zst(data: bytes) -> bytes:
    """A streamed zstd frame: 128 KiB blocks, so a cut one leaves whole blocks before it."""
    compressor = zstandard.ZstdCompressor().compressobj()
    return compressor.compress(data) + compressor.flush()


def _compress(kind: str, data: bytes) -> bytes:
    return _zst(data) if kind == "zst" else gzip.compress(data)


def _texts(batches: list[pa.RecordBatch]) -> list[str]:
    return [t for b in batches for t in b.column("text").to_pylist()]


@pytest.mark.parametrize("kind", ["zst", "gz"])
def test_truncated_stream_is_reported_and_yields_nothing(docs, tmp_path: Path, kind: str) -> None:
    raw = _lines(docs)
    full, cut = tmp_path / f"full.jsonl.{kind}", tmp_path / f"cut.jsonl.{kind}"
    data = _compress(kind, raw)
    full.write_bytes(data)
    cut.write_bytes(data[: len(data) // 2])
    log = ErrorLog("skip")
    assert len(_texts(list(iter_documents([full], IngestConfig(), log)))) == 1200
    assert log.total == 0
    # skip: the truncated file gives no document at all (not the ~600 before the cut), and is
    # reported and counted; the other input is read whole.
    good = tmp_path / "good.jsonl"
    good.write_bytes(raw[: raw.index(b"\n") + 1])
    log = ErrorLog("skip")
    texts = _texts(list(iter_documents([cut, good], IngestConfig(), log)))
    assert texts == [json.loads(raw.splitlines()[0])["text"]]
    assert len(log.errors) == 1 and log.errors[0].file == str(cut)
    assert (log.errors[0].line, log.errors[0].kind) == (0, "truncated")
    assert dict(log.counts) == {"truncated": 1}
    expected = (f"{cut}:0: {GZ_CUT}" if kind == "gz" else
                f"{cut}:0: truncated: the zstd stream ends inside a frame after "
                f"{len(data) // 2:,} bytes (the file is incomplete)")
    assert str(log.errors[0]) == expected
    # stop: the run stops at that file.
    with pytest.raises(BadInputError) as info:
        list(iter_documents([cut], IngestConfig(), ErrorLog("stop")))
    assert str(info.value) == expected


@pytest.mark.parametrize("kind", ["zst", "gz"])
def test_streaming_reader_raises_at_the_cut(docs, tmp_path: Path, kind: str) -> None:
    data = _compress(kind, _lines(docs))
    path = tmp_path / f"cut.jsonl.{kind}"
    path.write_bytes(data[: len(data) // 2])
    lines = 0
    with pytest.raises(StreamError) as info, open_binary(path) as f:
        for _ in f:
            lines += 1
    assert 0 < lines < 1200  # whole lines decode before the cut: the stream is not "complete"
    assert (info.value.path, info.value.kind) == (str(path), "truncated")
    with pytest.raises(StreamError, match="truncated"):
        check_stream(path)


def test_concatenated_frames_and_members_are_read_whole(docs, tmp_path: Path) -> None:
    raw = _lines(docs, 300)
    parts = [raw[:10_000], raw[10_000:50_000], raw[50_000:]]
    (tmp_path / "multi.jsonl.zst").write_bytes(b"".join(_zst(p) for p in parts))
    (tmp_path / "multi.jsonl.gz").write_bytes(b"".join(gzip.compress(p) for p in parts))
    for name in ("multi.jsonl.zst", "multi.jsonl.gz"):
        assert check_stream(tmp_path / name) == len(raw)
        with open_binary(tmp_path / name) as f:
            assert f.read() == raw


def test_corrupt_and_truncated_files_of_every_reader(docs, tmp_path: Path) -> None:
    (tmp_path / "junk.jsonl.zst").write_bytes(b"this is not zstd data at all")
    (tmp_path / "junk.jsonl.gz").write_bytes(b"this is not gzip data at all")
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text(docs[0]["text"])
    body = gzip.compress(docs[1]["text"].encode())
    (folder / "b.txt.gz").write_bytes(body[: len(body) // 2])
    log = ErrorLog("skip")
    batches = list(iter_documents([tmp_path / "junk.jsonl.zst", tmp_path / "junk.jsonl.gz",
                                   folder], IngestConfig(), log))
    assert _texts(batches) == [docs[0]["text"]]
    assert [(Path(e.file).name, e.line, e.kind) for e in log.errors] == [
        ("junk.jsonl.zst", 0, "corrupt"), ("junk.jsonl.gz", 0, "corrupt"),
        ("b.txt.gz", 0, "truncated")]
    assert log.errors[0].message.startswith("invalid zstd data (")
    assert log.errors[1].message.startswith("invalid gzip data (")
    assert str(log.errors[2]) == f"{folder / 'b.txt.gz'}:0: {GZ_CUT}"


def test_cli_truncated_input_stop_and_skip(docs, tmp_path: Path) -> None:
    raw = "".join(json.dumps({"id": d["id"], "text": d["text"]}) + "\n" for d in docs[:40])
    data = gzip.compress(raw.encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"id": d["id"], "text": d["text"]}) + "\n"
                            for d in docs[140:150]))
    result = runner.invoke(app, ["prepare", str(cut), "-o", str(tmp_path / "stop"),
                                 "--on-error", "stop", *FAST], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert f"error: {cut}:0: {GZ_CUT}\n" in result.output
    assert "Aborted" not in result.output and "Traceback" not in result.output
    zst = tmp_path / "cut.jsonl.zst"
    zdata = _zst(_lines(docs))
    zst.write_bytes(zdata[: len(zdata) // 2])
    result = runner.invoke(app, ["prepare", str(zst), "-o", str(tmp_path / "zstop"),
                                 "--on-error", "stop", *FAST], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and f"error: {zst}:0: truncated: " in result.output
    out = tmp_path / "skip"
    result = runner.invoke(app, ["prepare", str(cut), str(good), "-o", str(out), *FAST],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert f"bad input {cut}:0: {GZ_CUT}" in result.output
    stats = json.loads((out / "index.json").read_text())["stats"]
    assert stats["bad_inputs"] == {"truncated": 1} and stats["documents_in"] == 10
    ds = TokenDataset(out)
    assert [ds.metadata(i)[0] for i in range(len(ds))] == [d["id"] for d in docs[140:150]]


def test_truncated_evaluation_file_stops_the_run(docs, tmp_path: Path) -> None:
    """A partly read evaluation set would let its text through decontamination: never skipped."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": d["text"]}) + "\n" for d in docs[:5]))
    data = gzip.compress("".join(json.dumps({"text": d["text"]}) + "\n"
                                 for d in docs[140:150]).encode())
    evals = tmp_path / "eval.jsonl.gz"
    evals.write_bytes(data[: len(data) // 2])
    config = PrepareConfig(CleanConfig(decontam=DecontamConfig(), eval_paths=(str(evals),)),
                           "tokenizer-1k", workers=1)
    with pytest.raises(BadInputError) as info:  # although on_error is "skip"
        prepare([train], tmp_path / "out", config)
    assert str(info.value) == f"{evals}:0: {GZ_CUT}"


def test_text_key_missing_from_every_line(docs, tmp_path: Path) -> None:
    path = tmp_path / "body.jsonl"
    path.write_bytes(_lines(docs, 50, key="body"))
    expected = (f"{path}:0: missing_key: no line has the 'text' field (check --text-key); the "
                f"lines have 'body', 'id'")
    with pytest.raises(TextKeyError) as info:  # even when skipping bad lines
        list(iter_documents([path], IngestConfig(), ErrorLog("skip")))
    assert str(info.value) == expected
    with pytest.raises(BadInputError) as info:  # stop: the first line already stops the run
        list(iter_documents([path], IngestConfig(), ErrorLog("stop")))
    assert str(info.value) == f"{path}:1: missing_key: no 'text' field (the line has 'body', 'id')"
    # Read in byte ranges (a large uncompressed file): the verdict covers the whole file.
    split = IngestConfig(split_bytes=4000)
    with pytest.raises(TextKeyError) as info:
        list(iter_documents([path], split, ErrorLog("skip")))
    assert str(info.value) == expected
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        with pytest.raises(TextKeyError) as info:
            prepare([path], out, PrepareConfig(CleanConfig(ingest=split), "tokenizer-1k",
                                               workers=workers))
        assert str(info.value) == expected and info.value.error == InputError(
            str(path), 0, "missing_key", expected.split("missing_key: ")[1])
        assert not out.exists()  # nothing to resume: rerunning with --text-key needs no flag
    # Some lines with the field: the others are bad lines, counted, not a wrong key.
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(_lines(docs, 3) + _lines(docs, 2, key="body"))
    log = ErrorLog("skip")
    assert len(_texts(list(iter_documents([mixed], IngestConfig(), log)))) == 3
    assert dict(log.counts) == {"missing_key": 2}
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["x"], "id": ["1"]}), table)
    with pytest.raises(TextKeyError) as info:
        list(iter_documents([table], IngestConfig(), ErrorLog("skip")))
    assert str(info.value) == (f"{table}:0: missing_key: no 'text' column (check --text-key); "
                               f"the file has 'body', 'id'")


def test_cli_wrong_text_key(docs, tmp_path: Path) -> None:
    path = tmp_path / "body.jsonl"
    path.write_bytes(_lines(docs, 20, key="body"))
    result = runner.invoke(app, ["prepare", str(path), "-o", str(tmp_path / "o"), *FAST],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert (f"error: {path}:0: missing_key: no line has the 'text' field (check --text-key); "
            f"the lines have 'body', 'id'\n") in result.output
    result = runner.invoke(app, ["prepare", str(path), "-o", str(tmp_path / "o"),
                                 "--text-key", "body", "--min-chars", "10", *FAST])
    assert result.exit_code == 0, result.output  # no leftover run to --overwrite


def test_no_documents_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    config = PrepareConfig(tokenizer="tokenizer-1k", workers=1)
    with pytest.raises(NoDocumentsError) as info:
        prepare([empty], tmp_path / "o1", config)
    assert str(info.value) == (
        f"no documents in {empty}: no input line or file holds one (bad inputs: empty_file 1; "
        f"first: {empty}:0: empty_file: no documents in file)")
    assert not (tmp_path / "o1").exists()  # no 0-document dataset, no half run left
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"text": f"only {i} words"}) + "\n" for i in range(5)))
    with pytest.raises(NoDocumentsError) as info:
        prepare([short], tmp_path / "o2", config)
    assert str(info.value) == (f"no documents left from {short}: all 5 documents read were "
                               f"dropped (too_short 5)")
    assert not (tmp_path / "o2").exists()
    result = runner.invoke(app, ["prepare", str(short), "-o", str(tmp_path / "o3"), *FAST])
    assert result.exit_code == 2
    assert f"error: no documents left from {short}: all 5" in result.output
    result = runner.invoke(app, ["train-tokenizer", str(empty), "--vocab-size", "300", "-o",
                                 str(tmp_path / "tok.json")])
    assert result.exit_code == 2 and f"error: no documents in {empty}" in result.output
    assert not (tmp_path / "tok.json").exists()


def test_cli_names_an_empty_input_file(docs, tmp_path: Path) -> None:
    good, empty = tmp_path / "good.jsonl", tmp_path / "empty.jsonl.gz"
    good.write_text("".join(json.dumps({"text": d["text"]}) + "\n" for d in docs[:5]))
    empty.write_bytes(gzip.compress(b"\n\n"))
    result = runner.invoke(app, ["prepare", str(good), str(empty), "-o", str(tmp_path / "o"),
                                 *FAST], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert f"bad input {empty}:0: empty_file: no documents in file" in result.output


def test_bad_line_counts_are_exact(docs, tmp_path: Path) -> None:
    """More bad lines than the log keeps as examples (1,000): every one is still counted."""
    good = [json.dumps({"text": d["text"]}) for d in docs[:30]]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"
    a.write_text("\n".join(good[:15] + ["{broken"] * 1500) + "\n")
    b.write_bytes(gzip.compress(("\n".join(["[1, 2]"] * 845 + good[15:] + ["{"] * 1000)
                                 + "\n").encode()))
    log = ErrorLog("skip")
    assert len(_texts(list(iter_documents([a, b], IngestConfig(), log)))) == 30
    assert dict(log.counts) == {"json": 3345} and log.total == 3345
    assert len(log.errors) == 1000  # examples kept
    summary = prepare([a, b], tmp_path / "out", PrepareConfig(
        CleanConfig(ingest=IngestConfig(batch_docs=4)), "tokenizer-1k", workers=1))
    assert summary["bad_inputs"] == {"json": 3345}
    assert len(summary["bad_input_samples"]) == 100
    assert summary["bad_input_samples"][0] == (f"{a}:16: json: malformed JSON: Expecting "
                                               f"property name enclosed in double quotes "
                                               f"(column 2)")
    assert summary["documents_in"] == 30
    result = runner.invoke(app, ["prepare", str(a), str(b), "-o", str(tmp_path / "cli"), *FAST],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 0 and "3,345" in result.output
    assert "3,335 more bad inputs" in result.output


def test_overwrite_never_deletes_an_input(docs, tmp_path: Path) -> None:
    """--overwrite deletes the output folder: refused (exit 2, nothing touched) when that
    folder is an input folder, holds an input file or lies inside an input folder."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_bytes(_lines(docs, 30))
    before = {p: p.read_bytes() for p in raw.iterdir()}
    cases = [([str(raw)], raw, "is"), ([str(raw / "a.jsonl")], raw, "holds"),
             ([str(raw)], raw / "out", "lies inside"), ([str(raw / "a.jsonl")], tmp_path, "holds")]
    for inputs, output, how in cases:
        output.mkdir(exist_ok=True)
        result = runner.invoke(app, ["prepare", *inputs, "-o", str(output), "--overwrite",
                                     *FAST], env={"COLUMNS": "300"})
        assert result.exit_code == 2, result.output
        assert f"--output {output} {how} the input" in result.output, result.output
        assert "writing there would destroy what this command reads" in result.output
        assert {p: p.read_bytes() for p in raw.iterdir() if p.is_file()} == before
    # A tokenizer given as a path is an input too.
    tok = tmp_path / "tok"
    tok.mkdir()
    load_tokenizer("tokenizer-1k").save(tok / "tokenizer.json")
    saved = (tok / "tokenizer.json").read_bytes()
    result = runner.invoke(app, ["prepare", str(raw / "a.jsonl"), "-o", str(tok), "--overwrite",
                                 "--tokenizer", str(tok / "tokenizer.json"), "--workers", "1"],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "holds the input" in result.output, result.output
    assert (tok / "tokenizer.json").read_bytes() == saved
    # Without --overwrite too: the output is an input file.
    result = runner.invoke(app, ["prepare", str(raw / "a.jsonl"), "-o", str(raw / "a.jsonl"),
                                 *FAST], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "is the input" in result.output, result.output
    # train-tokenizer writing over its own corpus or
    # onto a folder.
    for output, words in ((raw / "a.jsonl", "is the input"), (tok, "is a folder")):
        result = runner.invoke(app, ["train-tokenizer", str(raw / "a.jsonl"), "--vocab-size",
                                     "300", "--output", str(output)], env={"COLUMNS": "300"})
        assert result.exit_code == 2 and words in result.output, result.output
    assert {p: p.read_bytes() for p in raw.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tok.iterdir()) == ["tokenizer.json"]


def test_a_lone_surrogate_is_a_bad_line_naming_file_and_line(docs, tmp_path: Path) -> None:
    """JSON can escape half a UTF-16 pair (\\ud800), which is no UTF-8 text: a bad line,
    counted under --on-error skip and named under stop."""
    path = tmp_path / "s.jsonl"
    good = _lines(docs, 40).decode().splitlines()
    good.insert(7, '{"text": "a lone \\ud800 surrogate among words"}')
    path.write_text("\n".join(good) + "\n")
    log = ErrorLog("skip")
    texts = _texts(list(iter_documents([path], IngestConfig(), log)))
    assert len(texts) == 40 and dict(log.counts) == {"utf8": 1}
    assert log.errors == [InputError(str(path), 8, "utf8", "the text holds a lone surrogate "
                                     "\\ud800 at character 7: not UTF-8 text")]
    result = runner.invoke(app, ["prepare", str(path), "-o", str(tmp_path / "o"),
                                 "--on-error", "stop", *FAST], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and f"{path}:8: utf8: the text holds a lone surrogate" in (
        result.output), result.output


def test_a_field_given_twice_is_a_bad_line(docs, tmp_path: Path) -> None:
    """A line giving the text (or id, or source) twice is a bad line: JSON readers differ on
    which one they keep. A name repeated inside a nested object, or as a value, is not."""
    path = tmp_path / "d.jsonl"
    good = _lines(docs, 30).decode().splitlines()
    good.insert(3, '{"text": "first words here", "id": "x", "text": "second words here"}')
    good.insert(5, '{"meta": {"text": 1, "text": 2}, "source": "text", "text": "kept words"}')
    path.write_text("\n".join(good) + "\n")
    log = ErrorLog("skip")
    texts = _texts(list(iter_documents([path], IngestConfig(), log)))
    assert len(texts) == 31 and "kept words" in texts and dict(log.counts) == {"json": 1}
    assert log.errors == [InputError(str(path), 4, "json", "'text' is given twice in the line "
                                     "(JSON readers keep one of them, which one differs): "
                                     "keep one")]


def test_a_bad_on_error_is_refused_before_any_work(docs, tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines(docs, 5))
    result = runner.invoke(app, ["prepare", str(path), "-o", str(tmp_path / "o"), "--on-error",
                                 "bogus", *FAST], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "--on-error must be skip or stop, got 'bogus'" in (
        result.output), result.output
    assert not (tmp_path / "o").exists()


def test_a_full_disk_names_the_output(docs, tmp_path: Path) -> None:
    """Writes past a file-size limit fail as on a full disk: one line naming the output
    folder."""
    import resource
    import signal
    import subprocess
    import sys

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    path = tmp_path / "in.jsonl"
    path.write_bytes(_lines(docs, 600))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", "from mt_data.cli import app; app()", "prepare",
                           str(path), "-o", str(out), *FAST], capture_output=True, text=True,
                          preexec_fn=limit, env={**os.environ, "COLUMNS": "300"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: {out}: writing failed: File too large" in done.stdout + done.stderr


def test_a_full_disk_leaves_no_partial_file(docs, tmp_path: Path) -> None:
    """export-megatron and train-tokenizer past a file-size limit: one line naming the
    output, and no temporary file left beside it."""
    import resource
    import signal
    import subprocess
    import sys

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    path = tmp_path / "in.jsonl"
    path.write_bytes(_lines(docs, 300))
    result = runner.invoke(app, ["prepare", str(path), "-o", str(tmp_path / "ds"), *FAST])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    out.mkdir()
    for args, message in (
            (["export-megatron", str(tmp_path / "ds"), str(out / "m")],
             f"PREFIX {out / 'm'}: writing failed: File too large"),
            (["train-tokenizer", str(path), "--vocab-size", "2000", "-o", str(out / "t.json")],
             f"--output {out / 't.json'}: writing failed: File too large")):
        done = subprocess.run([sys.executable, "-c", "from mt_data.cli import app; app()",
                               *args], capture_output=True, text=True, preexec_fn=limit,
                              env={**os.environ, "COLUMNS": "300"})
        assert done.returncode == 2 and message in done.stdout + done.stderr, done.stderr
        assert sorted(p.name for p in out.iterdir()) == [], args


def _one_line_error(args: list[str]) -> str:
    """The ``error:`` line of a command that must exit 2 (no traceback)."""
    result = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())


def test_bad_inputs_and_options_found_by_the_hostile_sweep(docs, tmp_path: Path) -> None:
    """Session 8's sweep, each once: a missing input is not a failed write; an input of an
    unknown kind is named; filter thresholds out of range are refused;
    `inspect` of a document that does not exist or negative --chars; an
    index.json without its fields or of another version."""
    raw = tmp_path / "raw.jsonl"
    raw.write_bytes(_lines(docs, 40))
    out = str(tmp_path / "out")
    text = _one_line_error(["prepare", str(tmp_path / "no-such.jsonl"), "-o", out, *FAST])
    assert "input" in text and "no-such.jsonl does not exist" in text
    assert "writing failed" not in text
    noext = tmp_path / "raw-noext"
    noext.write_bytes(gzip.compress(_lines(docs, 40)))
    text = _one_line_error(["prepare", str(noext), "-o", out, *FAST])
    assert f"{noext} end in no known extension (.jsonl, .json" in text
    text = _one_line_error(["prepare", str(raw), "-o", out, "--min-words", "-5", *FAST])
    assert "min_words must be >= 0, got -5" in text
    text = _one_line_error(["prepare", str(raw), "-o", out, "--max-repeated-lines", "7",
                            *FAST])
    assert "max_repeated_line_fraction is a fraction: it must be in [0, 1], got 7" in text
    ok = runner.invoke(app, ["prepare", str(raw), "-o", out, *FAST], env={"COLUMNS": "300"})
    assert ok.exit_code == 0, ok.output
    documents = len(TokenDataset(out))
    for args, words in ((["--document", "99999"], f"--document 99999: {out} holds documents "
                                                  f"0 to {documents - 1}"),
                        (["--document", "-1"], "--document -1:"),
                        (["--chars", "-5"], "--chars must be 0 or more, got -5")):
        assert words in _one_line_error(["inspect", out, *args])
    index = json.loads((Path(out) / "index.json").read_text())
    for change, words in (({"dtype": None}, "field 'dtype' missing or not a str"),
                          ({"version": 99}, "index version 99, this mt-data reads version 1"),
                          ({"shards": [{}]}, "shard 0 lacks file, sha256")):
        broken = tmp_path / f"broken-{len(words)}"
        broken.mkdir()
        (broken / "index.json").write_text(json.dumps({**index, **change}))
        assert words in _one_line_error(["inspect", str(broken)])


def test_two_prepares_into_one_folder(docs, tmp_path: Path) -> None:
    """The second is refused at once while the first holds the folder; a lock left by a killed
    process blocks nothing."""
    from mt_data.prepare_output import output_lock

    raw = tmp_path / "raw.jsonl"
    raw.write_bytes(_lines(docs, 40))
    out = tmp_path / "out"
    out.mkdir()
    with output_lock(out):
        text = _one_line_error(["prepare", str(raw), "-o", str(out), *FAST])
        assert f"{out} is being prepared by another process: wait for it to end" in text
    ok = runner.invoke(app, ["prepare", str(raw), "-o", str(out), *FAST], env={"COLUMNS": "300"})
    assert ok.exit_code == 0, ok.output


def _not_utf8(values: list[bytes]) -> pa.Array:
    """A Parquet string column as other writers may leave it: bytes never checked as UTF-8."""
    return pa.array(values, pa.binary()).view(pa.string())


def test_a_parquet_value_that_is_not_utf8_is_a_bad_row(docs, tmp_path: Path) -> None:
    """A text or id value of a Parquet string column that is not UTF-8 is one bad row naming
    the file and the row (skipped and counted, or stopping the run), not an error naming
    nothing."""
    texts = [d["text"].encode() for d in docs[:4]]
    path = tmp_path / "part.parquet"
    pq.write_table(pa.table({
        "text": _not_utf8([texts[0], b"caf\xe9 " * 40, texts[1], texts[2]]),
        "id": _not_utf8([b"a", b"b", b"c\xff", b"d"])}), path, row_group_size=3)
    log = ErrorLog("skip")
    assert _texts(list(iter_documents([path], IngestConfig(), log))) == [docs[0]["text"],
                                                                         docs[2]["text"]]
    assert [str(e) for e in log.errors] == [
        f"{path}:2: utf8: the text column holds bytes that are not UTF-8 text",
        f"{path}:3: utf8: the id column holds bytes that are not UTF-8 text"]
    with pytest.raises(BadInputError, match=f"{path}:2: utf8: the text column"):
        list(iter_documents([path], IngestConfig(), ErrorLog("stop")))
    good = tmp_path / "good.jsonl"
    good.write_bytes(_lines(docs, 40))
    ok = runner.invoke(app, ["prepare", str(path), str(good), "-o", str(tmp_path / "out"),
                             *FAST], env={"COLUMNS": "300"})
    assert ok.exit_code == 0, ok.output
    assert f"{path}:2: utf8: the text column holds bytes" in " ".join(ok.output.split())


def test_a_compressed_parquet_file_is_named_as_such(docs, tmp_path: Path) -> None:
    """A gzipped Parquet file (its name says .parquet.gz) is one bad input saying what it is
    and what to do, not "not a parquet file"."""
    path = tmp_path / "part.parquet.gz"
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": [d["text"] for d in docs[:3]]}), buffer)
    path.write_bytes(gzip.compress(buffer.getvalue().to_pybytes()))
    log = ErrorLog("skip")
    assert _texts(list(iter_documents([path], IngestConfig(), log))) == []
    assert [str(e) for e in log.errors] == [
        f"{path}:0: parquet: a compressed Parquet file, which mt reads only uncompressed "
        "(Parquet compresses its columns itself): decompress it"]
