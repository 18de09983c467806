"""Issue 42 ("trust"), on real files: an input edited in place is never served stale (a
finished dataset or an unfinished run of it), mt never writes over or empties a folder it did
not write, and a JSON line nested too deep to parse is one bad input, not a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mt_data.cli import app
from mt_data.corpus import iter_corpus
from mt_data.ingest import ErrorLog, IngestConfig, iter_documents
from mt_data.megatron import export_megatron, import_megatron
from mt_data.pipeline import PrepareConfig, PrepareError, prepare
from mt_data.shards import TokenDataset
from mt_data.tokenizer import load_tokenizer

runner = CliRunner()
FAST = ["--tokenizer", "tokenizer-1k", "--workers", "1", "--no-fuzzy-dedup"]
WIDE = {"COLUMNS": "400"}
DEEP = "[" * 200_000


@pytest.fixture(scope="module")
def docs() -> list[dict[str, str]]:
    return list(iter_corpus())


def _jsonl(docs: list[dict[str, str]], n: int, start: int = 0) -> str:
    return "".join(json.dumps({"id": f"d{i}", "text": docs[i % len(docs)]["text"][:600]}) + "\n"
                   for i in range(start, start + n))


def _same_size_edit(path: Path) -> None:
    """Rewrite ``path`` in place with other text of the same length (keeps the size)."""
    data = path.read_bytes()
    at = data.index(b'"text": "') + len(b'"text": "')
    edited = data[:at] + b"x" * 40 + data[at + 40:]
    assert len(edited) == len(data) and edited != data
    path.write_bytes(edited)


def _error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    assert "Traceback" not in output
    return lines[0]


def test_prepare_refuses_a_finished_dataset_whose_input_changed(docs, tmp_path: Path) -> None:
    """An input edited in place (same path, same size) after prepare: the rerun says which
    input changed and how, exit 2."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_jsonl(docs, 40))
    out = tmp_path / "out"
    args = ["prepare", str(corpus), "-o", str(out), *FAST]
    assert runner.invoke(app, args, env=WIDE).exit_code == 0
    index = (out / "index.json").read_bytes()
    stat = corpus.stat()
    assert runner.invoke(app, args, env=WIDE).exit_code == 0  # unchanged: already complete

    _same_size_edit(corpus)  # the modified time moves with it
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 2, result.output
    line = _error(result.output)
    assert f"{corpus}" in line and "modified time" in line and "content" in line, line
    assert "size" not in line.split(str(corpus))[1].split(")")[0], line  # the size is the same
    assert "--overwrite" in line and "another --output" in line, line
    assert (out / "index.json").read_bytes() == index  # nothing touched

    # The same edit with the modified time put back: the content sample still tells.
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 2, result.output
    assert f"{corpus}, which changed since it was read (content)" in _error(result.output)
    # --overwrite prepares the new content.
    result = runner.invoke(app, [*args, "--overwrite"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, args, env=WIDE).exit_code == 0
    tok = load_tokenizer("tokenizer-1k")
    assert "x" * 40 in tok.decode(TokenDataset(out).document(0)[:-1].tolist())


def test_prepare_refuses_to_resume_a_run_whose_input_was_cut(docs, tmp_path: Path) -> None:
    """A run stopped midway (its work/ folder kept), its input then cut: resuming is refused,
    naming the input and its sizes."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_jsonl(docs, 60))
    out = tmp_path / "out"
    args = ["prepare", str(corpus), "-o", str(out), *FAST]
    result = runner.invoke(app, [*args, "--keep-work"], env=WIDE)
    assert result.exit_code == 0, result.output
    (out / "index.json").unlink()  # the run as a kill before its last step leaves it
    (out / "dropped.json").unlink()
    assert (out / "work" / "config.json").is_file()
    before = corpus.stat().st_size
    corpus.write_text(_jsonl(docs, 20))  # cut
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 2, result.output
    line = _error(result.output)
    assert "unfinished run" in line and str(corpus) in line, line
    assert f"size {before:,} -> {corpus.stat().st_size:,} bytes" in line, line
    assert "--overwrite" in line and "rerun the same command" not in line, line
    assert not (out / "index.json").exists()
    result = runner.invoke(app, [*args, "--overwrite"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "index.json").read_text())["stats"]["documents_in"] == 20


def test_prepare_refuses_a_dataset_of_older_code_it_cannot_check(docs, tmp_path: Path) -> None:
    """A dataset whose fingerprint records no size, modified time or content of its inputs
    (prepared by an earlier mt-data) is not served as 'already complete' unchecked."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_jsonl(docs, 30))
    out = tmp_path / "out"
    args = ["prepare", str(corpus), "-o", str(out), *FAST]
    assert runner.invoke(app, args, env=WIDE).exit_code == 0
    index = json.loads((out / "index.json").read_text())
    fingerprint = index["stats"]["fingerprint"]
    assert fingerprint["files"][0]["path"] == str(corpus)
    assert fingerprint["files"][0]["size"] == corpus.stat().st_size
    del fingerprint["files"]  # as earlier mt-data wrote it
    (out / "index.json").write_text(json.dumps(index))
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 2, result.output
    line = _error(result.output)
    assert "cannot be checked" in line and "--overwrite" in line, line


def test_prepare_refuses_an_input_changed_while_it_was_read(docs, tmp_path: Path) -> None:
    """An input rewritten while prepare runs: no dataset is published from the old reading."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_jsonl(docs, 40))

    class EditDuringTokenize:
        def stage(self, name: str, total: float | None, unit: str) -> None:
            if name.startswith("tokenize"):
                with corpus.open("a") as f:
                    f.write(_jsonl(docs, 1, start=50))

        def advance(self, amount: float) -> None:
            pass

        def end(self) -> None:
            pass

    with pytest.raises(PrepareError, match=rf"{corpus} changed while it was being prepared"):
        prepare([corpus], tmp_path / "out", PrepareConfig(tokenizer="tokenizer-1k", workers=1),
                EditDuringTokenize())
    assert not (tmp_path / "out" / "index.json").exists()


def test_prepare_never_writes_into_or_empties_a_folder_it_did_not_write(docs,
                                                                      tmp_path: Path) -> None:
    """--overwrite -o DIR with the user's own files in DIR: refused, naming them; without
    --overwrite too."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_jsonl(docs, 30))
    mine = tmp_path / "mine"
    (mine / "work").mkdir(parents=True)
    (mine / "thesis.txt").write_text("four years of work")
    (mine / "work" / "chapter1.tex").write_text("\\chapter{One}")
    for extra in ([], ["--overwrite"]):
        result = runner.invoke(app, ["prepare", str(corpus), "-o", str(mine), *FAST, *extra],
                               env=WIDE)
        assert result.exit_code == 2, result.output
        line = _error(result.output)
        assert "thesis.txt" in line and "work/" in line, line
        assert "mt data prepare did not write" in line, line
        assert (mine / "thesis.txt").read_text() == "four years of work"
        assert (mine / "work" / "chapter1.tex").is_file()
        assert sorted(p.name for p in mine.iterdir()) == ["thesis.txt", "work"]
    # Its own output folder is still replaced with --overwrite.
    out = tmp_path / "out"
    for extra in ([], ["--overwrite"]):
        result = runner.invoke(app, ["prepare", str(corpus), "-o", str(out), *FAST, *extra],
                               env=WIDE)
        assert result.exit_code == 0, result.output


def test_import_megatron_refuses_a_folder_holding_files(docs, tmp_path: Path) -> None:
    """import-megatron into an existing dataset or a folder with other files: one line, exit 2,
    nothing touched."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_jsonl(docs, 30))
    data = tmp_path / "data"
    prepare([corpus], data, PrepareConfig(tokenizer="tokenizer-1k", workers=1))
    export_megatron(data, tmp_path / "mg")
    other = tmp_path / "other"
    prepare([corpus], other, PrepareConfig(tokenizer="tokenizer-1k", workers=1))
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("buy milk")
    for folder in (other, notes):
        result = runner.invoke(app, ["import-megatron", str(tmp_path / "mg"), str(folder),
                                     "--tokenizer", "tokenizer-1k"], env=WIDE)
        assert result.exit_code == 2, result.output
        line = _error(result.output)
        assert str(folder) in line and "choose" in line, line
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    assert sorted(p.name for p in notes.iterdir()) == ["todo.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    index = import_megatron(tmp_path / "mg", empty, load_tokenizer("tokenizer-1k").describe())
    assert index["documents"] == len(TokenDataset(data))


def test_a_json_line_nested_too_deep_is_one_bad_input(docs, tmp_path: Path) -> None:
    """A line of 200,000 '[': one bad input with its file:line in prepare, train-tokenizer and the
    decontamination sets."""
    corpus = tmp_path / "deep.jsonl"
    good = _jsonl(docs, 20)
    corpus.write_text(good + DEEP + "\n" + '{"a": ' * 100_000 + "\n")
    log = ErrorLog("skip")
    texts = [t for b in iter_documents([corpus], IngestConfig(), log)
             for t in b.column("text").to_pylist()]
    assert len(texts) == 20 and dict(log.counts) == {"json": 2}
    assert str(log.errors[0]).startswith(f"{corpus}:21: json: ")
    assert str(log.errors[1]).startswith(f"{corpus}:22: json: ")
    result = runner.invoke(app, ["prepare", str(corpus), "-o", str(tmp_path / "out"), *FAST],
                           env=WIDE)
    assert result.exit_code == 0, result.output
    assert f"bad input {corpus}:21: json:" in result.output
    summary = json.loads((tmp_path / "out" / "index.json").read_text())["stats"]
    assert summary["bad_inputs"] == {"json": 2}
    result = runner.invoke(app, ["train-tokenizer", str(corpus), "--vocab-size", "300", "-o",
                                 str(tmp_path / "tok.json")], env=WIDE)
    assert result.exit_code == 0, result.output
    assert f"bad input {corpus}:21: json:" in result.output
    evals = tmp_path / "eval.jsonl"
    evals.write_text(DEEP + "\n")
    result = runner.invoke(app, ["prepare", str(corpus), "-o", str(tmp_path / "o2"),
                                 "--decontaminate", str(evals), *FAST],
                           env=WIDE)
    assert result.exit_code == 2, result.output
    assert f"{evals}:1: json:" in _error(result.output)
    # mt data inspect of a dataset whose index.json is nested too deep: one line.
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "index.json").write_text(DEEP)
    result = runner.invoke(app, ["inspect", str(damaged)], env=WIDE)
    assert result.exit_code == 2, result.output
    assert f"{damaged / 'index.json'}: not valid JSON" in _error(result.output)
    # A vocab.json or a group-words file nested too deep: one line too.
    tok = tmp_path / "tokdir"
    tok.mkdir()
    (tok / "vocab.json").write_text(DEEP)
    (tok / "merges.txt").write_text("#version: 0.2\n")
    words = tmp_path / "words.json"
    words.write_text(DEEP)
    for extra, where in ((["--tokenizer", str(tok)], tok / "vocab.json"),
                         (["--group-words", str(words)], words)):
        result = runner.invoke(app, ["prepare", str(corpus), "-o", str(tmp_path / "o3"),
                                     *FAST, *extra], env=WIDE)
        assert result.exit_code == 2, result.output
        assert str(where) in _error(result.output)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_where_no_file_can_be_created_is_refused_before_the_work(tmp_path: Path
                                                                          ) -> None:
    """access() says root may write in /proc, yet no file can be created there: the check
    every command makes before its work (mt_data.paths.unwritable) creates one to find out,
    so `mt eval --output /proc/r.json` is refused at once, not after the evaluation."""
    from mt_data.paths import unwritable

    assert unwritable("--output", Path("/proc/r.json")) == (
        "--output /proc/r.json: cannot create a file in /proc (No such file or directory)")
    assert unwritable("--output", tmp_path / "new" / "r.json") is None
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind


def test_train_tokenizer_and_export_replace_a_file_only_with_overwrite(docs, tmp_path: Path
                                                                      ) -> None:
    """An output file already there (the tokenizer.json, PREFIX.bin or PREFIX.idx): one line
    naming the flag and the file, exit 2, before any work, the file's bytes kept; with
    --overwrite it is replaced (atomically: no temporary file is left beside it)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_jsonl(docs, 30))
    tok = tmp_path / "tok.json"
    tok.write_bytes(b"mine")
    args = ["train-tokenizer", str(corpus), "--vocab-size", "300", "-o", str(tok)]
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 2, result.output
    assert _error(result.output) == (f"error: --output {tok} already exists; pass --overwrite "
                                     "to replace it")
    assert "train BPE" not in result.output and tok.read_bytes() == b"mine"
    result = runner.invoke(app, [*args, "--overwrite"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert json.loads(tok.read_text())["model"]["vocab"]["<|endoftext|>"] == 0

    data = tmp_path / "data"
    prepare([corpus], data, PrepareConfig(tokenizer="tokenizer-1k", workers=1))
    prefix = tmp_path / "mg"
    for name in ("mg.bin", "mg.idx"):
        (tmp_path / name).write_bytes(b"mine")
        result = runner.invoke(app, ["export-megatron", str(data), str(prefix)], env=WIDE)
        assert result.exit_code == 2, result.output
        assert _error(result.output) == (f"error: PREFIX {prefix}: {tmp_path / name} already "
                                         "exists; pass --overwrite to replace it")
        assert (tmp_path / name).read_bytes() == b"mine"
        (tmp_path / name).unlink()
    (tmp_path / "mg.bin").write_bytes(b"mine")
    result = runner.invoke(app, ["export-megatron", str(data), str(prefix), "--overwrite"],
                           env=WIDE)
    assert result.exit_code == 0, result.output
    back = import_megatron(prefix, tmp_path / "back", load_tokenizer("tokenizer-1k").describe())
    assert back["documents"] == len(TokenDataset(data))
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_train_tokenizer_and_export_say_in_one_line_that_they_cannot_write(
        docs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An output where no file can be created (/proc): refused before the work, in one line
    naming the flag and the path; a write that fails all the same (a full disk): one line
    with the operating system's reason, no Python repr of the error; not a regular file
    (/dev/null): refused even with --overwrite."""
    import errno

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_jsonl(docs, 30))
    data = tmp_path / "data"
    prepare([corpus], data, PrepareConfig(tokenizer="tokenizer-1k", workers=1))
    train = ["train-tokenizer", str(corpus), "--vocab-size", "300", "-o"]
    for args, line in (
            ([*train, "/proc/tok.json"], "error: --output /proc/tok.json: cannot create a file "
             "in /proc (No such file or directory)"),
            (["export-megatron", str(data), "/proc/mg"], "error: PREFIX /proc/mg: cannot "
             "create a file in /proc (No such file or directory)"),
            ([*train, "/dev/null", "--overwrite"], "error: --output /dev/null is not a regular "
             "file; name a file to write")):
        result = runner.invoke(app, args, env=WIDE)
        assert result.exit_code == 2, result.output
        assert _error(result.output) == line and "train BPE" not in result.output

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr("mt_data.shards.atomic_write_bytes", full)
    monkeypatch.setattr("mt_data.tokenizer.atomic_write_bytes", full)
    monkeypatch.setattr("mt_data.megatron.atomic_write_bytes", full)
    tok, prefix = tmp_path / "tok.json", tmp_path / "mg"
    for args, line in (([*train, str(tok)], f"error: --output {tok}: writing failed: No space "
                        "left on device"),
                       (["export-megatron", str(data), str(prefix)], f"error: PREFIX {prefix}: "
                        "writing failed: No space left on device")):
        result = runner.invoke(app, args, env=WIDE)
        assert result.exit_code == 2, result.output
        assert _error(result.output) == line


def test_overwrite_never_empties_a_cache_folder_it_did_not_write(docs, tmp_path: Path) -> None:
    """-o DIR whose cache/ holds the user's files (cache/ is also the name of a dataset's
    readers' cache): refused with or without --overwrite, naming it; a dataset's own cache/
    is still replaced."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_jsonl(docs, 30))
    mine = tmp_path / "mine"
    (mine / "cache").mkdir(parents=True)
    (mine / "cache" / "notes.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        result = runner.invoke(app, ["prepare", str(corpus), "-o", str(mine), *FAST, *extra],
                               env=WIDE)
        assert result.exit_code == 2, result.output
        line = _error(result.output)
        assert "holds cache/, which mt data prepare did not write" in line, line
        assert (mine / "cache" / "notes.txt").read_text() == "keep me"
        assert sorted(p.name for p in mine.rglob("*")) == ["cache", "notes.txt"]
    out = tmp_path / "out"
    prepare([corpus], out, PrepareConfig(tokenizer="tokenizer-1k", workers=1))
    TokenDataset(out).check_shards()  # writes cache/verified.json
    (out / "cache" / ".verified.json.123.tmp").write_text("{}")  # left by a killed reader
    result = runner.invoke(app, ["prepare", str(corpus), "-o", str(out), *FAST, "--overwrite"],
                           env=WIDE)
    assert result.exit_code == 0, result.output
    assert not (out / "cache").exists()


def test_a_finished_dataset_missing_a_shard_is_not_complete(docs, tmp_path: Path) -> None:
    """Rerunning prepare over a finished dataset whose shard was deleted or cut, or whose
    index.json records were damaged by hand: one line naming what is wrong and --overwrite,
    exit 2; never "prepared" over a dataset that cannot be read, never a traceback."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_jsonl(docs, 40))
    out = tmp_path / "out"
    args = ["prepare", str(corpus), "-o", str(out), *FAST]
    assert runner.invoke(app, args, env=WIDE).exit_code == 0
    shard = next(out.glob("shard-*.arrow"))
    data = shard.read_bytes()
    index = json.loads((out / "index.json").read_text())
    for damage in (shard.unlink, lambda: shard.write_bytes(data[: len(data) // 2])):
        damage()
        result = runner.invoke(app, args, env=WIDE)
        assert result.exit_code == 2, result.output
        line = _error(result.output)
        assert f"{out} holds a finished dataset that cannot be read" in line, line
        assert shard.name in line and "pass --overwrite" in line, line
    shard.write_bytes(data)
    assert runner.invoke(app, args, env=WIDE).exit_code == 0
    fingerprint = index["stats"]["fingerprint"]
    for stats in ([1], {**index["stats"], "fingerprint": {**fingerprint, "files": 5}}):
        (out / "index.json").write_text(json.dumps({**index, "stats": stats}))
        result = runner.invoke(app, args, env=WIDE)
        assert result.exit_code == 2, result.output
        assert "--overwrite" in _error(result.output)
    assert runner.invoke(app, [*args, "--overwrite"], env=WIDE).exit_code == 0
    assert runner.invoke(app, args, env=WIDE).exit_code == 0


def test_a_tokenizer_edited_between_two_prepares_of_one_process_is_loaded_again(
        docs, tmp_path: Path) -> None:
    """Two `prepare` calls in one process (a notebook) with the tokenizer file (or a file of
    a tokenizer folder) edited in between: the second dataset is tokenized by, and records,
    the tokenizer the files hold now, not the one the first call loaded."""
    from mt_data.tokenizer import train_tokenizer

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_jsonl(docs, 20))
    texts = [d["text"] for d in docs]
    for spec in (tmp_path / "tok.json", tmp_path / "folder"):
        path = spec / "tokenizer.json" if spec.suffix != ".json" else spec
        path.parent.mkdir(exist_ok=True)
        train_tokenizer(texts[:40], 400).save(path)
        prepare([corpus], tmp_path / f"{spec.name}-1", PrepareConfig(tokenizer=str(spec),
                                                                     workers=1))
        train_tokenizer(texts[40:80], 400).save(path)  # edited in place
        second = tmp_path / f"{spec.name}-2"
        prepare([corpus], second, PrepareConfig(tokenizer=str(spec), workers=1))
        now = load_tokenizer(spec)
        data = TokenDataset(second)
        assert data.tokenizer["sha256"] == now.fingerprint
        first_doc = json.loads(corpus.read_text().splitlines()[0])["text"]
        assert list(data.document(0)) == list(now.encode_batch([first_doc]).tokens)


def test_a_user_folder_named_like_one_a_command_writes_is_foreign(tmp_path: Path) -> None:
    """Ownership patterns of the form ``folder/inner``: a folder matching ``folder`` is a
    command's own only if every entry in it (at every depth) matches an inner pattern; a
    user's files inside it are named with the folder, and a look-alike name (``iter_2024_
    photos`` for seven digits) is foreign. ``folder/`` alone still owns whatever it holds."""
    from mt_data.paths import foreign_entries

    owned = ("config.json", "iter_" + "[0-9]" * 7 + "*/mp_rank_[0-9][0-9]/model.pt", "cache/")
    (tmp_path / "iter_0000004" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "iter_0000004" / "mp_rank_00" / "model.pt").write_bytes(b"w")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "anything").write_text("x")
    (tmp_path / "config.json").write_text("{}")
    assert foreign_entries(tmp_path, owned) == []
    (tmp_path / "iter_0000004" / "notes.txt").write_text("mine")
    (tmp_path / "iter_0000004" / "mp_rank_00" / "draft.md").write_text("mine")
    (tmp_path / "iter_2024_photos").mkdir()
    (tmp_path / "iter_2024_photos" / "a.jpg").write_bytes(b"jpg")
    assert foreign_entries(tmp_path, owned) == [
        "iter_0000004/mp_rank_00/draft.md", "iter_0000004/notes.txt", "iter_2024_photos/"]
    (tmp_path / "iter_0000004" / "model.pt").mkdir()  # a folder where a file is owned
    assert "iter_0000004/model.pt/" in foreign_entries(tmp_path, owned)
