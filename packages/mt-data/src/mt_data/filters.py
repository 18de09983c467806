"""Cleaning and quality filters on Arrow record batches, each filter counted.

Most measures are computed for a whole batch at once with Arrow compute kernels (RE2 regexes
in C++); only the repeated-line measure loops in Python (``str.split`` + ``set``, C speed).
A document is dropped by the first filter it fails, in the order of :data:`FILTERS`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

FILTERS = ("too_short", "too_long", "too_few_words", "symbols", "non_alpha", "html",
           "repeated_lines")
# Symbols that are rare in prose but frequent in code, markup, spam and boilerplate.
SYMBOL_RE = r"[#{}\[\]|\\@$%^*_=+~]|\.\.\.|…"
HTML_TAG_RE = r"<(?:!--|!doctype|/?[a-zA-Z][a-zA-Z0-9]*(?:\s[^<>]*)?/?>)"


@dataclass(frozen=True)
class FilterConfig:
    """Cleaning and quality thresholds (each check switched off by ``None``)."""

    normalize: str | None = "NFC"
    """Unicode normalisation form applied to every text (NFC, NFKC, ...), or None."""
    min_chars: int | None = 100
    """Drop documents shorter than this many characters (after normalisation)."""
    max_chars: int | None = 5_000_000
    """Drop documents longer than this many characters."""
    min_words: int | None = 20
    """Drop documents with fewer whitespace-separated words."""
    max_symbol_ratio: float | None = 0.1
    """Drop documents with more than this many symbols (# { } [ ] | ... etc.) per word."""
    min_alpha_word_fraction: float | None = 0.7
    """Drop documents where fewer than this fraction of words contain a letter."""
    max_html_tag_ratio: float | None = 0.02
    """Drop documents with more HTML/XML tags per word than this (raw markup)."""
    max_repeated_line_fraction: float | None = 0.3
    """Drop documents whose non-empty lines are duplicates of earlier lines more than this."""

    def __post_init__(self) -> None:
        if self.min_chars is not None and self.max_chars is not None:
            if not 0 <= self.min_chars <= self.max_chars:
                raise ValueError(
                    f"need 0 <= min_chars ({self.min_chars}) <= max_chars ({self.max_chars})"
                )
        for name in ("min_chars", "max_chars", "min_words", "max_symbol_ratio",
                     "max_html_tag_ratio"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be >= 0, got {value}")
        for name in ("min_alpha_word_fraction", "max_repeated_line_fraction"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"{name} is a fraction: it must be in [0, 1], got {value}")

    @classmethod
    def disabled(cls) -> FilterConfig:
        """A config that keeps every document (normalisation off too)."""
        return cls(None, None, None, None, None, None, None, None)


def repeated_line_fraction(text: str) -> float:
    """Fraction of non-empty lines that repeat an earlier line of the same text."""
    lines = [line.strip() for line in text.split("\n")]
    lines = [line for line in lines if line]
    if not lines:
        return 0.0
    return 1.0 - len(set(lines)) / len(lines)


def _np(array: pa.Array) -> np.ndarray:
    return np.asarray(array.to_numpy(zero_copy_only=False), dtype=np.float64)


_MEASURES = {
    "chars": lambda t: _np(pc.utf8_length(t)),
    "words": lambda t: _np(pc.count_substring_regex(t, r"\S+")),
    "symbols": lambda t: _np(pc.count_substring_regex(t, SYMBOL_RE)),
    "alpha_words": lambda t: _np(pc.count_substring_regex(t, r"\S*\pL\S*")),
    "html_tags": lambda t: _np(pc.count_substring_regex(t, HTML_TAG_RE, ignore_case=True)),
}


def measure(texts: pa.Array, names: tuple[str, ...] = tuple(_MEASURES)) -> dict[str, np.ndarray]:
    """Per-document counts (chars, words, symbols, alpha_words, html_tags), vectorised."""
    return {name: _MEASURES[name](texts) for name in names}


def _needed(config: FilterConfig) -> tuple[str, ...]:
    needs = set()
    if config.min_chars is not None or config.max_chars is not None:
        needs.add("chars")
    for field_name, measure_name in (("max_symbol_ratio", "symbols"),
                                     ("min_alpha_word_fraction", "alpha_words"),
                                     ("max_html_tag_ratio", "html_tags")):
        if getattr(config, field_name) is not None:
            needs.update(("words", measure_name))
    if config.min_words is not None:
        needs.add("words")
    return tuple(sorted(needs))


def failed_filters(texts: pa.Array, config: FilterConfig) -> np.ndarray:
    """Index into :data:`FILTERS` of the first filter each text fails (-1: kept); no
    normalisation (see :func:`filter_batch`)."""
    m = measure(texts, _needed(config))
    n = len(texts)
    words = np.maximum(m.get("words", np.ones(n)), 1.0)

    def check(limit: float | None, values: str, below: bool,
              per_word: bool = False) -> np.ndarray | None:
        if limit is None:
            return None
        x = m[values] / words if per_word else m[values]
        return x < limit if below else x > limit

    checks = [
        check(config.min_chars, "chars", below=True),
        check(config.max_chars, "chars", below=False),
        check(config.min_words, "words", below=True),
        check(config.max_symbol_ratio, "symbols", False, per_word=True),
        check(config.min_alpha_word_fraction, "alpha_words", True, per_word=True),
        check(config.max_html_tag_ratio, "html_tags", False, per_word=True),
    ]
    failed = np.full(n, -1, dtype=np.int16)
    for k, bad in enumerate(checks):
        if bad is not None:
            failed[(failed == -1) & bad] = k
    if config.max_repeated_line_fraction is not None:
        limit = config.max_repeated_line_fraction
        for i in np.flatnonzero(failed == -1):
            if repeated_line_fraction(texts[int(i)].as_py()) > limit:
                failed[i] = FILTERS.index("repeated_lines")
    return failed


def enabled_filters(config: FilterConfig) -> list[str]:
    """The filters of :data:`FILTERS` that ``config`` switches on."""
    limits = (config.min_chars, config.max_chars, config.min_words, config.max_symbol_ratio,
              config.min_alpha_word_fraction, config.max_html_tag_ratio,
              config.max_repeated_line_fraction)
    return [name for name, limit in zip(FILTERS, limits, strict=True) if limit is not None]


def normalize_batch(batch: pa.RecordBatch, form: str | None) -> pa.RecordBatch:
    """The batch with its ``text`` column in Unicode normal form ``form`` (None: unchanged)."""
    if not form:
        return batch
    texts = pc.utf8_normalize(batch.column("text"), form)
    return batch.set_column(batch.schema.get_field_index("text"), "text", texts)


def filter_batch(
    batch: pa.RecordBatch, config: FilterConfig
) -> tuple[pa.RecordBatch, Counter[str]]:
    """Normalise and filter a batch with a ``text`` column; returns kept rows and drop counts
    (every enabled filter is listed, with 0 when it dropped nothing)."""
    batch = normalize_batch(batch, config.normalize)
    failed = failed_filters(batch.column("text"), config)
    counts: Counter[str] = Counter({name: 0 for name in enabled_filters(config)})
    for k in failed[failed >= 0]:
        counts[FILTERS[k]] += 1
    return batch.filter(pa.array(failed == -1)), counts
