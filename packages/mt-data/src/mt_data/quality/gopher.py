"""Gopher's quality and repetition rules (Rae et al. 2021, "Scaling Language Models: Methods,
Analysis & Insights from Training Gopher", arXiv:2112.11446, appendix A and table A1), as
Hugging Face datatrove 0.10.1 implements them (``GopherQualityFilter``,
``GopherRepetitionFilter``), defaults included. Words are datatrove's English words (spaCy's
tokenizer, :mod:`mt_data.quality.words`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import pyarrow as pa

from mt_data.quality.base import KEPT, RuleSet, Verdicts, first_failure, ratio
from mt_data.quality.charsets import PUNCTUATION_SET
from mt_data.quality.words import BatchWords, english

STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")


def _has_alpha(word: str) -> bool:
    """Whether a character of ``word`` is alphabetic (``str.isalpha``)."""
    return any(map(str.isalpha, word))


def _counts(texts: list[str], sub: str) -> np.ndarray:
    """Non-overlapping occurrences of ``sub`` in each text (``str.count``)."""
    return np.fromiter(map(str.count, texts, repeat(sub)), dtype=np.int64, count=len(texts))


def _line_stats(text: str) -> tuple[int, int, int]:
    """(lines, lines starting with a bullet, lines ending with an ellipsis); str.splitlines."""
    lines = text.splitlines()
    bullets = (sum(1 for s in lines if s.lstrip().startswith(("•", "-")))
               if "-" in text or "•" in text else 0)
    ellipses = (sum(1 for s in lines if s.rstrip().endswith(("...", "…")))
                if "..." in text or "…" in text else 0)
    return len(lines), bullets, ellipses


@dataclass(frozen=True)
class GopherQuality(RuleSet):
    """Gopher quality rules; each threshold ``None`` switches its rule off.

    Words are all non-blank tokens; "non-symbol" words hold a character outside datatrove's
    punctuation set. datatrove also treats a threshold of 0 as off; here 0 is a threshold.
    """

    name = "gopher-quality"
    source = "Gopher (Rae et al. 2021, table A1); datatrove GopherQualityFilter"

    min_doc_words: int | None = 50
    """Drop documents with fewer non-symbol words."""
    max_doc_words: int | None = 100_000
    """Drop documents with more non-symbol words."""
    min_avg_word_length: float | None = 3
    """Drop documents whose mean non-symbol word length is below this (characters)."""
    max_avg_word_length: float | None = 10
    """... or above this."""
    max_symbol_word_ratio: float | None = 0.1
    """Drop documents with more '#' per word, or more ellipses ('...', '…') per word."""
    max_bullet_lines_ratio: float | None = 0.9
    """Drop documents where more of the lines start with a bullet ('•' or '-')."""
    max_ellipsis_lines_ratio: float | None = 0.3
    """Drop documents where more of the lines end with an ellipsis."""
    min_alpha_words_ratio: float | None = 0.8
    """Drop documents where fewer of the words hold an alphabetic character."""
    min_stop_words: int | None = 2
    """Drop documents holding fewer distinct stop words (case-sensitive)."""
    stop_words: tuple[str, ...] = STOP_WORDS

    def __post_init__(self) -> None:
        self._check(nonnegative=("min_doc_words", "max_doc_words", "min_avg_word_length",
                                 "max_avg_word_length", "max_symbol_word_ratio", "min_stop_words"),
                    fractions=("max_bullet_lines_ratio", "max_ellipsis_lines_ratio",
                               "min_alpha_words_ratio"))

    def rule_names(self) -> tuple[str, ...]:
        return ("too_few_words", "too_many_words", "short_words", "long_words", "hashes",
                "ellipses", "bullet_lines", "ellipsis_lines", "non_alpha_words", "stop_words")

    def apply(self, texts: pa.Array) -> Verdicts:
        pytexts = texts.to_pylist()
        words = BatchWords(pytexts)
        n = len(pytexts)
        n_words = words.counts().astype(np.float64)
        symbol = words.type_values(PUNCTUATION_SET.issuperset)  # every character punctuation
        lengths = words.type_values(len)
        content = words.per_doc_sum(1 - symbol)
        mean_length = ratio(words.per_doc_sum(lengths * (1 - symbol)), content)
        mean_length[content == 0] = np.nan  # np.mean([]): no length rule fires
        alpha = words.per_doc_sum(words.type_values(_has_alpha))
        stop = words.per_doc_distinct(words.type_values(frozenset(self.stop_words).__contains__))
        hashes = _counts(pytexts, "#")
        ellipses = _counts(pytexts, "...") + _counts(pytexts, "…")
        lines = np.array([_line_stats(t) for t in pytexts], dtype=np.float64).reshape(n, 3)

        def over(limit: float | None, x: np.ndarray) -> np.ndarray | None:
            return None if limit is None else x > limit

        def under(limit: float | None, x: np.ndarray) -> np.ndarray | None:
            return None if limit is None else x < limit

        return Verdicts(first_failure([
            under(self.min_doc_words, content),
            over(self.max_doc_words, content),
            under(self.min_avg_word_length, mean_length),
            over(self.max_avg_word_length, mean_length),
            over(self.max_symbol_word_ratio, ratio(hashes, n_words)),
            over(self.max_symbol_word_ratio, ratio(ellipses, n_words)),
            over(self.max_bullet_lines_ratio, ratio(lines[:, 1], lines[:, 0])),
            over(self.max_ellipsis_lines_ratio, ratio(lines[:, 2], lines[:, 0])),
            under(self.min_alpha_words_ratio, ratio(alpha, n_words)),
            under(self.min_stop_words, stop),
        ], n))


_PARAGRAPHS = re.compile(r"\n{2,}")
_LINES = re.compile(r"\n+")


def duplicates(items: Sequence[str]) -> tuple[int, int]:
    """(number, characters) of the items that repeat an earlier item."""
    seen: set[str] = set()
    count = chars = 0
    for item in items:
        if item in seen:
            count += 1
            chars += len(item)
        else:
            seen.add(item)
    return count, chars


def top_ngram_chars(ids: np.ndarray, lengths: np.ndarray, n: int) -> int:
    """Characters covered by the most frequent word n-gram: its length (words joined by one
    space) times its count; ties go to the n-gram seen first (``Counter.most_common``)."""
    grams = np.lib.stride_tricks.sliding_window_view(ids, n)
    base = int(ids.max()) + 1
    if base ** n < 2 ** 62:  # exact integer key per n-gram
        keys = grams @ (base ** np.arange(n - 1, -1, -1, dtype=np.int64))
        values, counts = np.unique(keys, return_counts=True)
        best = int(counts.max())
        # the first n-gram whose key is one of the most frequent
        start = int(np.argmax(np.isin(keys, values[counts == best])))
    else:
        _, first, counts = np.unique(grams, axis=0, return_index=True, return_counts=True)
        best = int(counts.max())
        start = int(first[counts == best].min())
    return (int(lengths[start:start + n].sum()) + n - 1) * best


def duplicated_ngram_chars(words: list[str], n: int) -> int:
    """Characters of the n-grams (words joined with no space) that repeat an earlier one,
    scanning left to right and jumping over each repeat (datatrove's ``find_all_duplicate``)."""
    seen: set[str] = set()
    chars = i = 0
    last = len(words) - n + 1
    while i < last:
        gram = "".join(words[i:i + n])
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


_DENSE_IDS = 40_000
"""Word ids below this make exact integer keys for 4-grams (see top_ngram_chars)."""

_HASH_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: invertible modulo 2**64
_HASH_BASE_INV = np.uint64(pow(0x9E3779B97F4A7C15, -1, 1 << 64))


class NgramChars:
    """:func:`duplicated_ngram_chars` of one document's words for any ``n``, with the same
    result computed with numpy: each n-gram's joined text is identified by a polynomial hash
    of its characters (prefix sums modulo 2**64, so any substring's hash costs O(1)); every
    n-gram whose hash was seen before is compared as text with the first one holding that hash
    (a collision falls back to :func:`duplicated_ngram_chars`), and only those n-grams are
    visited in Python, in the order of the left-to-right scan."""

    def __init__(self, words: list[str]) -> None:
        self.words = words
        lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        self.starts = np.zeros(len(words) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.starts[1:])
        self.text = "".join(words)
        size = len(self.text)
        points = np.frombuffer(self.text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
        with np.errstate(over="ignore"):
            inv = np.full(size + 1, _HASH_BASE_INV, dtype=np.uint64)
            inv[0] = 1
            inv = np.cumprod(inv, dtype=np.uint64)  # BASE**-t, wrapping modulo 2**64
            base = np.full(size + 1, _HASH_BASE, dtype=np.uint64)
            base[0] = 1
            self.power = np.cumprod(base, dtype=np.uint64)  # BASE**t
            self.prefix = np.zeros(size + 1, dtype=np.uint64)
            np.cumsum((points + np.uint64(1)) * inv[:size], dtype=np.uint64,
                      out=self.prefix[1:])

    def chars(self, n: int) -> int:
        """``duplicated_ngram_chars(words, n)``."""
        count = len(self.words) - n + 1
        if count <= 1:
            return 0
        a, b = self.starts[:count], self.starts[n:n + count]
        with np.errstate(over="ignore"):
            keys = (self.prefix[b] - self.prefix[a]) * self.power[a]
            keys ^= (b - a).astype(np.uint64) * np.uint64(0xD6E8FEB86659FD93)
        ordered = np.sort(keys)
        twice = ordered[1:][ordered[1:] == ordered[:-1]]
        if len(twice) == 0:  # no hash seen twice: no n-gram repeats
            return 0
        involved = np.flatnonzero(np.isin(keys, twice))  # n-grams whose hash repeats
        _, first_pos, group = np.unique(keys[involved], return_index=True, return_inverse=True)
        first = involved[first_pos[group]]  # first n-gram holding each one's hash
        repeats = involved[first != involved]
        text = self.text
        first = first[first != involved]
        lo, hi = a[repeats].tolist(), b[repeats].tolist()
        flo, fhi = a[first].tolist(), b[first].tolist()
        for k in range(len(lo)):
            if text[lo[k]:hi[k]] != text[flo[k]:fhi[k]]:
                return duplicated_ngram_chars(self.words, n)  # a hash collision
        firsts = first.tolist()
        sizes = (b[repeats] - a[repeats]).tolist()
        chars = i = 0
        skipped: set[int] = set()
        visited: set[int] = set()  # first positions of the groups of visited repeats
        for pos, f, size in zip(repeats.tolist(), firsts, sizes, strict=True):
            if pos < i:  # jumped over
                continue
            if f in visited or f not in skipped:  # an equal n-gram was visited before
                chars += size
                skipped.update(range(pos + 1, pos + n))
                i = pos + n
            else:
                visited.add(f)
                i = pos + 1
        return chars


@dataclass(frozen=True)
class GopherRepetition(RuleSet):
    """Gopher repetition rules (fractions of the document's characters, or of its lines /
    paragraphs); each threshold ``None`` switches its rule off. Paragraphs are split on 2+
    newlines (after stripping the text), lines on 1+ newlines."""

    name = "gopher-repetition"
    source = "Gopher (Rae et al. 2021, table A1); datatrove GopherRepetitionFilter"

    dup_line_frac: float | None = 0.3
    """Max fraction of lines that repeat an earlier line."""
    dup_para_frac: float | None = 0.3
    """Max fraction of paragraphs that repeat an earlier paragraph."""
    dup_line_char_frac: float | None = 0.2
    """Max characters in repeated lines, per character of the document."""
    dup_para_char_frac: float | None = 0.2
    """Max characters in repeated paragraphs, per character of the document."""
    top_n_grams: tuple[tuple[int, float], ...] = ((2, 0.2), (3, 0.18), (4, 0.16))
    """(n, max fraction of characters covered by the most frequent n-gram)."""
    dup_n_grams: tuple[tuple[int, float], ...] = (
        (5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10))
    """(n, max fraction of characters in repeated n-grams)."""

    def __post_init__(self) -> None:
        self._check(fractions=("dup_line_frac", "dup_para_frac", "dup_line_char_frac",
                               "dup_para_char_frac"))
        for field_name in ("top_n_grams", "dup_n_grams"):
            for n, frac in getattr(self, field_name):
                if n < 1 or not 0 <= frac <= 1:
                    raise ValueError(f"{self.name}: {field_name} needs n >= 1 and a fraction in "
                                     f"[0, 1], got ({n}, {frac})")

    def rule_names(self) -> tuple[str, ...]:
        return ("empty", "dup_paragraphs", "dup_paragraph_chars", "dup_lines", "dup_line_chars",
                *(f"top_{n}_gram" for n, _ in self.top_n_grams),
                *(f"dup_{n}_grams" for n, _ in self.dup_n_grams))

    def first_failure(self, text: str, words: list[str] | None = None,
                      known: tuple[np.ndarray, np.ndarray] | None = None) -> int:
        """Index of the first rule ``text`` fails, or -1 (``words``: its English words, when
        known already; ``known``: their ids (equal ids for equal words) and lengths, too)."""
        if not text:
            return 0
        size = len(text)
        paragraphs = _PARAGRAPHS.split(text.strip())
        count, chars = duplicates(paragraphs)
        if self.dup_para_frac is not None and count / len(paragraphs) > self.dup_para_frac:
            return 1
        if self.dup_para_char_frac is not None and chars / size > self.dup_para_char_frac:
            return 2
        lines = _LINES.split(text)
        count, chars = duplicates(lines)
        if self.dup_line_frac is not None and count / len(lines) > self.dup_line_frac:
            return 3
        if self.dup_line_char_frac is not None and chars / size > self.dup_line_char_frac:
            return 4
        if words is None:
            words = english().words(text)
        if not words:
            return KEPT
        if known is not None:
            ids, lengths = known
            if int(ids.max()) >= _DENSE_IDS:  # keep top_ngram_chars on its integer keys
                ids = np.unique(ids, return_inverse=True)[1].reshape(-1)
        else:
            types = list(dict.fromkeys(words))  # in order of first occurrence
            vocab = dict(zip(types, range(len(types)), strict=True))
            ids = np.fromiter(map(vocab.__getitem__, words), dtype=np.int64, count=len(words))
            lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        k = 5
        for n, frac in self.top_n_grams:
            if len(words) >= n and top_ngram_chars(ids, lengths, n) / size > frac:
                return k
            k += 1
        grams = NgramChars(words) if self.dup_n_grams else None
        for n, frac in self.dup_n_grams:
            if grams.chars(n) / size > frac:
                return k
            k += 1
        return KEPT

    def apply(self, texts: pa.Array) -> Verdicts:
        # Split by gopher-quality just before, if it ran: its words, their ids and lengths.
        words, batch = english().recent_words, BatchWords.recent()
        return Verdicts(np.array([
            self.first_failure(t, words(t), batch.doc_words(t) if batch is not None else None)
            for t in texts.to_pylist()], dtype=np.int16))
