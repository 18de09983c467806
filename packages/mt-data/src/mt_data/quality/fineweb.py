"""FineWeb's quality rules (Penedo et al. 2024, "The FineWeb Datasets: Decanting the Web for the
Finest Text Data at Scale", arXiv:2406.17557, its additional heuristic filters), as Hugging Face
datatrove 0.10.1's ``FineWebQualityFilter`` applies them by default.

Lines are the text split on ``\\n`` without the blank ones. A document is dropped when fewer
than ``line_punct_thr`` of its lines end in terminal punctuation (of any script), when more than
``short_line_thr`` of its lines are at most ``short_line_length`` characters long, when the lines
that repeat an earlier line hold more than ``char_duplicates_ratio`` of its non-newline
characters, or when it has more than ``new_line_ratio`` newlines per word (datatrove's
"list_ratio", English words as :mod:`mt_data.quality.words` splits them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from mt_data.quality.base import KEPT, RuleSet, Verdicts
from mt_data.quality.charsets import TERMINAL_PUNCTUATION
from mt_data.quality.gopher import duplicates
from mt_data.quality.words import english

_STOPS = tuple(TERMINAL_PUNCTUATION)


@dataclass(frozen=True)
class FineWebQuality(RuleSet):
    """FineWeb rules (datatrove ``FineWebQualityFilter`` defaults); ``None`` switches one off."""

    name = "fineweb"
    source = "FineWeb (Penedo et al. 2024); datatrove FineWebQualityFilter"

    line_punct_thr: float | None = 0.12
    """Min fraction of lines ending in terminal punctuation."""
    line_punct_exclude_zero: bool = False
    """Keep documents where no line ends in punctuation (the rule then only limits > 0)."""
    short_line_thr: float | None = 0.67
    """Max fraction of short lines."""
    short_line_length: int = 30
    """A line of at most this many characters is short."""
    char_duplicates_ratio: float | None = 0.01
    """Max fraction of (non-newline) characters in lines that repeat an earlier line."""
    new_line_ratio: float | None = 0.3
    """Max newlines per word."""
    stop_chars: tuple[str, ...] | None = None
    """Line endings that count as punctuation (None: datatrove's TERMINAL_PUNCTUATION)."""

    def __post_init__(self) -> None:
        self._check(nonnegative=("new_line_ratio", "short_line_length"),
                    fractions=("line_punct_thr", "short_line_thr", "char_duplicates_ratio"))

    def rule_names(self) -> tuple[str, ...]:
        return ("empty", "line_punct_ratio", "short_line_ratio", "char_dup_ratio", "list_ratio")

    def first_failure(self, text: str) -> int:
        """Index of the first rule ``text`` fails, or -1."""
        lines = [line for line in text.split("\n") if line.strip() != ""]
        if not lines:
            return 0
        stops = _STOPS if self.stop_chars is None else self.stop_chars
        if self.line_punct_thr is not None:
            punct = sum(1 for line in lines if line.endswith(stops)) / len(lines)
            if punct < self.line_punct_thr and not (punct == 0 and self.line_punct_exclude_zero):
                return 1
        if self.short_line_thr is not None:
            short = sum(1 for line in lines if len(line) <= self.short_line_length) / len(lines)
            if short > self.short_line_thr:
                return 2
        if self.char_duplicates_ratio is not None:
            chars = duplicates(lines)[1] / len(text.replace("\n", ""))
            if chars > self.char_duplicates_ratio:
                return 3
        if self.new_line_ratio is not None:
            words = len(english().words(text))
            if text.count("\n") / max(words, 1) > self.new_line_ratio:
                return 4
        return KEPT

    def apply(self, texts: pa.Array) -> Verdicts:
        return Verdicts(np.array([self.first_failure(t) for t in texts.to_pylist()],
                                 dtype=np.int16))
