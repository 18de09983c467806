"""Each cleaning filter on real text: the corpus passes, planted bad documents are caught."""

from __future__ import annotations

import unicodedata

import pyarrow as pa
import pytest

from mt_data.corpus import iter_corpus
from mt_data.filters import FILTERS, FilterConfig, filter_batch, repeated_line_fraction


@pytest.fixture(scope="module")
def docs() -> list[dict[str, str]]:
    return list(iter_corpus())


def _batch(texts: list[str]) -> pa.RecordBatch:
    n = len(texts)
    return pa.RecordBatch.from_pydict({"id": [f"d{i}" for i in range(n)],
                                       "source": ["test"] * n, "text": texts})


def test_real_corpus_passes_every_filter(docs: list[dict[str, str]]) -> None:
    kept, counts = filter_batch(_batch([d["text"] for d in docs]), FilterConfig())
    assert kept.num_rows == len(docs) == 181
    assert set(counts) == set(FILTERS) and sum(counts.values()) == 0  # each filter counted


def _planted(docs: list[dict[str, str]]) -> dict[str, str]:
    """One bad document per filter, each made from a real chapter."""
    chapter = docs[1]["text"]
    paragraph = chapter[:1500]
    words = paragraph.split()
    return {
        "too_short": chapter[:60],
        "too_long": chapter * (100_000 // len(chapter) + 1),
        "too_few_words": "Whaling " * 3 + "x" * 150,
        "symbols": " ".join(f"{w} ### {{}} |" for w in words),
        "non_alpha": " ".join(f"{w} 1{i} 2{i} 3{i} 4{i}" for i, w in enumerate(words)),
        "html": "<html><body>" + " ".join(f"<p><b>{w}</b></p>" for w in words) + "</body></html>",
        "repeated_lines": "\n".join([paragraph.splitlines()[0]] * 8 + paragraph.splitlines()[2:4]),
    }


def test_each_filter_catches_its_planted_document(docs: list[dict[str, str]]) -> None:
    planted = _planted(docs)
    config = FilterConfig(max_chars=100_000)  # the longest real document has 90,451
    for name, text in planted.items():
        kept, counts = filter_batch(_batch([docs[0]["text"], text, docs[150]["text"]]), config)
        assert kept.column("id").to_pylist() == ["d0", "d2"], name
        assert counts[name] == 1 and sum(counts.values()) == 1, (name, dict(counts))


def test_counts_over_a_mixed_batch(docs: list[dict[str, str]]) -> None:
    planted = _planted(docs)
    texts = [d["text"] for d in docs[:40]] + list(planted.values())
    config = FilterConfig(max_chars=100_000)  # the longest real document has 90,451
    kept, counts = filter_batch(_batch(texts), config)
    assert kept.num_rows == 40
    assert dict(counts) == {name: 1 for name in FILTERS}


def test_switches_off() -> None:
    texts = ["<b>x</b>", "### ### ###"]
    kept, counts = filter_batch(_batch(texts), FilterConfig.disabled())
    assert kept.num_rows == 2 and sum(counts.values()) == 0


def test_nfc_normalisation(docs: list[dict[str, str]]) -> None:
    text = docs[3]["text"][:500] + " The café in Nantucket."
    decomposed = unicodedata.normalize("NFD", text)
    assert decomposed != text
    kept, _ = filter_batch(_batch([decomposed]), FilterConfig())
    assert kept.column("text")[0].as_py() == unicodedata.normalize("NFC", text)
    kept, _ = filter_batch(_batch([decomposed]), FilterConfig(normalize=None))
    assert kept.column("text")[0].as_py() == decomposed


def test_repeated_line_fraction() -> None:
    assert repeated_line_fraction("a\nb\na\n\n  a  \nc") == pytest.approx(2 / 5)
    assert repeated_line_fraction("") == 0.0


def test_config_validation() -> None:
    with pytest.raises(ValueError, match=r"min_chars \(10\) <= max_chars \(5\)"):
        FilterConfig(min_chars=10, max_chars=5)
    with pytest.raises(ValueError, match="max_symbol_ratio must be >= 0, got -1"):
        FilterConfig(max_symbol_ratio=-1)
