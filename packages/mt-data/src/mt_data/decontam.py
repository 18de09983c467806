"""Decontamination: drop or cut training documents sharing word 13-grams with evaluation text.

Words are lower-cased runs of letters/digits (punctuation and case ignored), hashed exactly as
for MinHash. ``drop`` removes a contaminated document; ``cut`` (as GPT-3 / MT-NLG) removes each
matching n-gram plus ``margin`` characters on both sides, keeps the remaining pieces longer than
``min_piece_chars`` as separate documents, and drops documents cut into more than ``max_pieces``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from mt_data.dedup import shingle_hashes, word_hashes

MODES = ("drop", "cut")
_WORD_RE = re.compile(r"[^\W_]+")


@dataclass(frozen=True)
class DecontamConfig:
    """Decontamination parameters."""

    ngram: int = 13
    """Words per n-gram."""
    mode: str = "drop"
    """``drop`` contaminated documents or ``cut`` the matching spans out."""
    margin: int = 200
    """Characters removed on each side of a matching n-gram (cut mode)."""
    min_piece_chars: int = 200
    """Pieces shorter than this are discarded (cut mode)."""
    max_pieces: int = 10
    """Documents cut into more pieces are dropped entirely (cut mode)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.ngram < 1 or self.margin < 0 or self.min_piece_chars < 0 or self.max_pieces < 1:
            raise ValueError(
                f"need ngram ({self.ngram}) >= 1, margin ({self.margin}) >= 0, "
                f"min_piece_chars ({self.min_piece_chars}) >= 0, "
                f"max_pieces ({self.max_pieces}) >= 1"
            )


class NgramIndex:
    """Sorted, unique hashes of every word n-gram of an evaluation set."""

    def __init__(self, hashes: np.ndarray, ngram: int) -> None:
        self.hashes = np.unique(hashes)
        self.ngram = ngram

    @classmethod
    def from_texts(cls, texts: Iterable[str], ngram: int = 13) -> NgramIndex:
        """Index the n-grams of evaluation texts (texts shorter than n words contribute none)."""
        array = pa.array(list(texts), pa.string())
        hashes, _ = shingle_hashes(array, ngram, short_docs=False)
        return cls(hashes, ngram)

    def __len__(self) -> int:
        return len(self.hashes)

    def matches(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Per document: number of n-grams found in the index, and the flat match mask."""
        hashes, per_doc = shingle_hashes(texts, self.ngram, short_docs=False)
        found = np.isin(hashes, self.hashes, assume_unique=False)
        doc_of = np.repeat(np.arange(len(per_doc)), per_doc)
        return np.bincount(doc_of[found], minlength=len(per_doc)), found


def cut_spans(text: str, index: NgramIndex, config: DecontamConfig) -> list[str] | None:
    """Pieces of ``text`` left after cutting matching n-grams; None means drop the document."""
    spans = [(m.start(), m.end()) for m in _WORD_RE.finditer(text)]
    hashes, per_doc = shingle_hashes(pa.array([text]), index.ngram, short_docs=False)
    _, counts = word_hashes(pa.array([text]))
    if int(counts[0]) != len(spans):
        return None  # word splitting disagreed (exotic Unicode): be safe and drop
    hits = np.flatnonzero(np.isin(hashes, index.hashes))
    if not len(hits):
        return [text]
    cuts: list[tuple[int, int]] = []
    for k in hits:
        start = max(0, spans[k][0] - config.margin)
        end = min(len(text), spans[k + index.ngram - 1][1] + config.margin)
        if cuts and start <= cuts[-1][1]:
            cuts[-1] = (cuts[-1][0], max(cuts[-1][1], end))
        else:
            cuts.append((start, end))
    pieces, pos = [], 0
    for start, end in cuts:
        pieces.append(text[pos:start])
        pos = end
    pieces.append(text[pos:])
    if len(pieces) > config.max_pieces:
        return None
    return [p for p in pieces if len(p.strip()) >= config.min_piece_chars]


def decontaminate_batch(
    batch: pa.RecordBatch, index: NgramIndex, config: DecontamConfig
) -> tuple[pa.RecordBatch, dict[str, int]]:
    """Drop or cut contaminated documents of a batch (columns id, source, text, ...)."""
    texts = batch.column("text")
    hits, _ = index.matches(texts)
    dirty = np.flatnonzero(hits > 0)
    stats = {"contaminated": len(dirty), "dropped": 0, "pieces": 0}
    if not len(dirty):
        return batch, stats
    if config.mode == "drop":
        stats["dropped"] = len(dirty)
        keep = np.ones(batch.num_rows, dtype=bool)
        keep[dirty] = False
        return batch.filter(pa.array(keep)), stats
    rows = batch.to_pylist()
    out: list[dict[str, object]] = []
    dirty_set = set(dirty.tolist())
    for i, row in enumerate(rows):
        if i not in dirty_set:
            out.append(row)
            continue
        pieces = cut_spans(str(row["text"]), index, config)
        if not pieces:
            stats["dropped"] += 1
            continue
        stats["pieces"] += len(pieces)
        for j, piece in enumerate(pieces):
            out.append({**row, "id": f"{row['id']}#cut{j}", "text": piece})
    return pa.RecordBatch.from_pylist(out, schema=batch.schema), stats
