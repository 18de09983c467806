"""13-gram decontamination on real text: drop and cut modes."""

from __future__ import annotations

import re

import pyarrow as pa
import pytest

from mt_data.corpus import corpus_texts
from mt_data.decontam import DecontamConfig, NgramIndex, cut_spans, decontaminate_batch


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return corpus_texts()


def _batch(texts: list[str]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"id": [f"d{i}" for i in range(len(texts))],
                                       "source": ["t"] * len(texts), "text": texts})


def test_drop(texts: list[str]) -> None:
    # An "evaluation set": a passage of chapter 10 (re-cased and re-punctuated) + a SOTU passage.
    passage = texts[10][3000:3400]
    evals = [passage.upper().replace(",", " ;"), texts[150][5000:5600], "too short to count"]
    index = NgramIndex.from_texts(evals, 13)
    assert len(index) > 0
    docs = texts[:20] + texts[140:160]
    out, stats = decontaminate_batch(_batch(docs), index, DecontamConfig())
    assert stats == {"contaminated": 2, "dropped": 2, "pieces": 0}
    dropped = set(f"d{i}" for i in range(len(docs))) - set(out.column("id").to_pylist())
    assert dropped == {"d10", "d30"}  # chapter 10 and SOTU #150 (position 30 in the batch)


def test_twelve_shared_words_are_not_contamination(texts: list[str]) -> None:
    words = re.findall(r"[^\W_]+", texts[20])
    index = NgramIndex.from_texts([" ".join(words[100:112])], 13)  # only 12 words
    out, stats = decontaminate_batch(_batch([texts[20]]), index, DecontamConfig())
    assert stats["contaminated"] == 0 and out.num_rows == 1


def test_cut(texts: list[str]) -> None:
    doc = texts[10]
    passage = doc[3000:3400]
    index = NgramIndex.from_texts([passage], 13)
    config = DecontamConfig(mode="cut")
    pieces = cut_spans(doc, index, config)
    assert pieces is not None and len(pieces) == 2
    assert doc.startswith(pieces[0]) and doc.endswith(pieces[1])
    # The passage and a margin of ~200 characters around it are gone.
    removed = len(doc) - len(pieces[0]) - len(pieces[1])
    assert 400 <= removed <= 400 + 2 * 200 + 40
    assert passage[50:350] not in "".join(pieces)
    out, stats = decontaminate_batch(_batch([texts[9], doc]), index, config)
    assert stats == {"contaminated": 1, "dropped": 0, "pieces": 2}
    assert out.column("id").to_pylist() == ["d0", "d1#cut0", "d1#cut1"]


def test_cut_too_many_pieces_drops(texts: list[str]) -> None:
    doc = max(texts, key=len)  # 90k characters
    evals = [doc[i : i + 300] for i in range(1000, 1000 + 12 * 1500, 1500)]
    index = NgramIndex.from_texts(evals, 13)
    assert cut_spans(doc, index, DecontamConfig(mode="cut", max_pieces=10)) is None
    assert len(cut_spans(doc, index, DecontamConfig(mode="cut", max_pieces=20)) or []) > 10


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        DecontamConfig(mode="mask")
