"""The ``mt data`` Typer app: every command on real text, summaries, help with defaults."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mt_data.cli import app
from mt_data.corpus import corpus_path, iter_corpus
from mt_data.shards import TokenDataset

runner = CliRunner()


def test_help_states_defaults() -> None:
    result = runner.invoke(app, ["prepare", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for text in ("--text-key", "default: text", "default: gpt2", "default: 0.8",
                 "--no-fuzzy-dedup", "--decontaminate", "default: 13"):
        assert text in result.output, text
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    for command in ("prepare", "train-tokenizer", "export-megatron", "import-megatron",
                    "inspect"):
        assert command in result.output


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "sotu"
    result = runner.invoke(app, ["prepare", str(corpus_path("sotu")), "--output", str(out),
                                 "--tokenizer", "tokenizer-1k", "--workers", "1"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "documents out" in result.output and "46" in result.output
    return out


def test_prepare_and_inspect(prepared: Path) -> None:
    result = runner.invoke(app, ["inspect", str(prepared), "--verify"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "source sotu" in result.output and "checksums" in result.output
    assert "ok" in result.output and "tokenizer-1k" in result.output
    first = next(iter_corpus(("sotu",)))["text"]
    assert first[:60] in result.output  # the decoded sample is the real first address


def test_export_import_megatron(prepared: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["export-megatron", str(prepared), str(tmp_path / "sotu_doc")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "sotu_doc.bin").exists() and (tmp_path / "sotu_doc.idx").exists()
    result = runner.invoke(app, ["import-megatron", str(tmp_path / "sotu_doc"),
                                 str(tmp_path / "back"), "--tokenizer", "tokenizer-1k"])
    assert result.exit_code == 0, result.output
    a, b = TokenDataset(prepared), TokenDataset(tmp_path / "back")
    assert len(a) == len(b) == 46
    np.testing.assert_array_equal(a.document(45), b.document(45))


def test_train_tokenizer(tmp_path: Path) -> None:
    out = tmp_path / "tok.json"
    result = runner.invoke(app, ["train-tokenizer", str(corpus_path("moby-dick")),
                                 "--vocab-size", "500", "--output", str(out)])
    assert result.exit_code == 0, result.output
    vocab = json.loads(out.read_text())["model"]["vocab"]
    assert len(vocab) == 500 and vocab["<|endoftext|>"] == 0


def test_errors_exit_nonzero(tmp_path: Path) -> None:
    result = runner.invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 2 and "not a prepared dataset" in result.output
    result = runner.invoke(app, ["prepare", str(tmp_path / "missing.jsonl"), "-o",
                                 str(tmp_path / "o")])
    assert result.exit_code == 2 and "does not exist" in result.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    result = runner.invoke(app, ["prepare", str(bad), "-o", str(tmp_path / "o2"),
                                 "--on-error", "stop"])
    assert result.exit_code == 2 and "bad.jsonl:2: json" in result.output
