"""C4's cleaning heuristics (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with
a Unified Text-to-Text Transformer", JMLR 21(140), section 2.2), as Hugging Face datatrove
0.10.1's ``C4QualityFilter`` applies them by default: lines are removed, the document is kept
with only the surviving lines, or dropped whole.

Per line (``str.splitlines``, each stripped): a line with a word (whitespace-separated) longer
than ``max_word_length`` is removed; Wikipedia citation marks (``[1]``, ``[edit]``,
``[citation needed]``) are deleted; a line not ending in ``. ? ! " '`` (or ending in ``...``) is
removed, as is a line of fewer than ``min_words_per_line`` words (counted before citations are
deleted); "lorem ipsum" anywhere in a surviving line drops the document; a line mentioning
"javascript" is removed; a ``{`` drops the document; a line with a cookie / terms-of-use /
privacy-policy phrase is removed. The document is then dropped when its kept lines hold fewer
than ``min_num_sentences`` sentences (spaCy's sentencizer, as datatrove counts them), else its
text becomes the kept lines joined by newlines. (The paper's bad-words list is not applied, as
in datatrove.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from mt_data.quality.base import KEPT, RuleSet, Verdicts
from mt_data.quality.words import english

CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
END_PUNCTUATION = (".", "?", "!", '"', "'")
POLICY_SUBSTRINGS = ("terms of use", "privacy policy", "cookie policy", "uses cookies",
                     "use of cookies", "use cookies")


@dataclass(frozen=True)
class C4Quality(RuleSet):
    """C4 line and document rules (datatrove ``C4QualityFilter`` defaults, line mode)."""

    name = "c4"
    source = "C4 (Raffel et al. 2020, section 2.2); datatrove C4QualityFilter"

    remove_citations: bool = True
    filter_no_terminal_punct: bool = True
    min_num_sentences: int | None = 5
    """Drop documents whose kept lines hold fewer sentences (None: off)."""
    min_words_per_line: int | None = 3
    """Remove lines with fewer words (None: off)."""
    max_word_length: int | None = 1000
    """Remove lines with a longer word (None: off)."""
    filter_lorem_ipsum: bool = True
    filter_javascript: bool = True
    filter_curly_bracket: bool = True
    filter_policy: bool = True

    def __post_init__(self) -> None:
        self._check(nonnegative=("min_num_sentences", "min_words_per_line", "max_word_length"))

    def rule_names(self) -> tuple[str, ...]:
        return ("lorem_ipsum", "curly_bracket", "too_few_sentences")

    def clean(self, text: str) -> tuple[int, str]:
        """(index of the rule that drops the document or -1, text with the kept lines)."""
        kept: list[str] = []
        sentences = 0
        count_sentences = self.min_num_sentences is not None
        for line in text.splitlines():
            line = line.strip()
            words = line.split()
            if self.max_word_length is not None and any(
                    len(w) > self.max_word_length for w in words):
                continue
            if self.remove_citations:
                line = CITATION.sub("", line)
            if self.filter_no_terminal_punct and (not line.endswith(END_PUNCTUATION)
                                                  or line.endswith("...")):
                continue
            if self.min_words_per_line is not None and len(words) < self.min_words_per_line:
                continue
            lower = line.lower()
            if self.filter_lorem_ipsum and "lorem ipsum" in lower:
                return 0, text
            if self.filter_javascript and "javascript" in lower:
                continue
            if self.filter_curly_bracket and "{" in line:
                return 1, text
            if self.filter_policy and any(p in lower for p in POLICY_SUBSTRINGS):
                continue
            if count_sentences:
                sentences += english().sentence_count(line)
            kept.append(line)
        if count_sentences and sentences < self.min_num_sentences:  # type: ignore[operator]
            return 2, text
        return KEPT, "\n".join(kept).strip()

    def apply(self, texts: pa.Array) -> Verdicts:
        results = [self.clean(t) for t in texts.to_pylist()]
        return Verdicts(np.array([r[0] for r in results], dtype=np.int16),
                        [r[1] for r in results])
