"""English words and sentences exactly as datatrove finds them (spaCy's blank English pipeline).

datatrove's ``split_into_words(text, "eng")`` runs ``spacy.blank("en")`` (rule-based tokenizer,
no model) and drops whitespace tokens; its sentence split adds spaCy's rule-based
``sentencizer``. This module reimplements both algorithms in plain Python (spaCy's
``Tokenizer.__call__``: whitespace spans, special cases, prefix / suffix / infix regexes, URL
match, the special-case matcher pass; ``Sentencizer.predict``), driven by the data of spaCy's
English defaults (tokenizer exceptions and the affix / URL regexes, compiled with Python's
``re`` as spaCy compiles them) stored in ``assets/spacy-en-tokenizer.json.gz`` (spaCy is MIT
licensed; regenerate with :func:`export_spacy_english`). spaCy is not needed at run time.
"""

from __future__ import annotations

import gzip
import json
import re
import unicodedata
from collections.abc import Callable
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

ASSET = "spacy-en-tokenizer.json.gz"
_RUNS = re.compile(r"\S+|\s+")
_CACHE_SIZE = 1 << 17


def export_spacy_english(path: str | Path) -> dict[str, Any]:
    """Write the asset from the installed spaCy (development only: ``pip install spacy``)."""
    import spacy  # pants: no-infer-dep (development only)
    from spacy.attrs import ORTH  # pants: no-infer-dep
    from spacy.pipeline.sentencizer import Sentencizer  # pants: no-infer-dep

    tok = spacy.blank("en").tokenizer
    data: dict[str, Any] = {"spacy_version": spacy.__version__}
    for key, fn in (("prefix", tok.prefix_search), ("suffix", tok.suffix_search),
                    ("infix", tok.infix_finditer), ("url", tok.url_match)):
        data[key] = {"pattern": fn.__self__.pattern, "flags": int(fn.__self__.flags)}
    data["rules"] = {key: [sub[ORTH] if ORTH in sub else sub["ORTH"] for sub in value]
                     for key, value in sorted(tok.rules.items())}
    data["sentence_punct"] = sorted(Sentencizer.default_punct_chars)
    raw = json.dumps(data, ensure_ascii=False, sort_keys=True).encode()
    Path(path).write_bytes(gzip.compress(raw, mtime=0))
    return data


def _is_punct(text: str) -> bool:
    """spaCy's ``IS_PUNCT`` lexeme attribute (every character in a Unicode P* category)."""
    return all(unicodedata.category(ch).startswith("P") for ch in text)


class EnglishTokenizer:
    """spaCy 3's ``Tokenizer`` algorithm with spaCy's English settings (see module doc)."""

    def __init__(self, data: dict[str, Any]) -> None:
        def compile_(key: str) -> re.Pattern[str]:
            return re.compile(data[key]["pattern"], data[key]["flags"])

        self.version = data["spacy_version"]
        self._prefix, self._suffix = compile_("prefix").search, compile_("suffix").search
        self._infix, self._url = compile_("infix").finditer, compile_("url").match
        self.rules: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in data["rules"].items()}
        self.sentence_punct = frozenset(data["sentence_punct"])
        self._cache: dict[str, tuple[str, ...]] = {}  # chunk -> tokens (spaCy caches them too)
        # Special cases that affix/infix splitting would break up are re-joined by a matcher
        # over the token sequence (spaCy's _special_matcher, with faster_heuristics=True).
        self._patterns: dict[str, list[tuple[str, ...]]] = {}
        for key in sorted(self.rules):
            if (self._find_prefix(key) or self._find_suffix(key) or
                    any(True for _ in self._infix(key)) or " " in key):
                pattern = tuple(self._split(key, specials=False))
                self._patterns.setdefault(pattern[0], []).append(pattern)

    def _find_prefix(self, s: str) -> int:
        m = self._prefix(s)
        return m.end() - m.start() if m is not None else 0

    def _find_suffix(self, s: str) -> int:
        m = self._suffix(s)
        return m.end() - m.start() if m is not None else 0

    def _chunk_tokens(self, span: str, specials: bool) -> list[str]:
        """``_try_specials_and_cache`` + ``_tokenize`` (``_split_affixes``, ``_attach_tokens``)."""
        if specials and span in self.rules:
            return list(self.rules[span])
        rules = self.rules if specials else {}
        prefixes: list[str] = []
        suffixes: list[str] = []
        string, last = span, -1
        while string and len(string) != last:
            if string in rules:
                break
            last = len(string)
            pre = self._find_prefix(string)
            if pre:
                minus_pre = string[pre:]
                if minus_pre and minus_pre in rules:
                    prefixes.append(string[:pre])
                    string = minus_pre
                    break
            suf = self._find_suffix(string[pre:])
            if suf:
                minus_suf = string[:-suf]
                if minus_suf and minus_suf in rules:
                    suffixes.append(string[-suf:])
                    string = minus_suf
                    break
            if pre and suf and pre + suf <= len(string):
                prefixes.append(string[:pre])
                suffixes.append(string[-suf:])
                string = string[pre:-suf]
            elif pre:
                prefixes.append(string[:pre])
                string = string[pre:]
            elif suf:
                suffixes.append(string[-suf:])
                string = string[:-suf]
        tokens = prefixes
        if string:
            if string in rules:
                tokens.extend(rules[string])
            elif self._url(string):
                tokens.append(string)
            else:
                start = 0
                for m in self._infix(string):
                    if m.start() == 0:
                        continue
                    if m.start() != start:
                        tokens.append(string[start:m.start()])
                    if m.start() != m.end():
                        tokens.append(string[m.start():m.end()])
                    start = m.end()
                if string[start:]:
                    tokens.append(string[start:])
        tokens.extend(reversed(suffixes))
        return tokens

    def _split(self, text: str, specials: bool = True) -> list[str]:
        """Tokens (whitespace tokens included) before the special-case matcher pass."""
        return self._split_spaced(text, specials)[0]

    def _split_spaced(self, text: str, specials: bool) -> tuple[list[str], set[int]]:
        r"""Tokens, and the indices of those followed by one absorbed ``' '``.

        Text is cut into runs of space / non-space characters (``str.isspace``, which is what
        ``\s`` matches); a run of spaces after a word loses its first ``' '`` (the word's
        trailing space), and what is left of it, if anything, is a token of its own.
        """
        tokens: list[str] = []
        spaced: set[int] = set()
        cache = self._cache
        for k, run in enumerate(_RUNS.findall(text)):
            if run[0] == " " and k:
                spaced.add(len(tokens) - 1)
                if len(run) == 1:
                    continue
                run = run[1:]
            if not specials:
                tokens += self._chunk_tokens(run, False)
                continue
            try:
                tokens += cache[run]
            except KeyError:
                if len(cache) > _CACHE_SIZE:
                    cache.clear()
                tokens += cache.setdefault(run, tuple(self._chunk_tokens(run, True)))
        return tokens, spaced

    def tokenize(self, text: str) -> list[str]:
        """All token texts, whitespace tokens included, as ``spacy.blank("en")(text)``."""
        tokens, spaced = self._split_spaced(text, True)
        return self._special_pass(tokens, spaced)

    def _special_pass(self, tokens: list[str], spaced: set[int]) -> list[str]:
        """spaCy's ``_apply_special_cases``: phrase-match special cases over the tokens."""
        matches: list[tuple[int, int]] = []
        patterns = self._patterns
        for i in [i for i, tok in enumerate(tokens) if tok in patterns]:
            for pattern in patterns[tokens[i]]:
                if tuple(tokens[i:i + len(pattern)]) == pattern:
                    matches.append((i, i + len(pattern)))
        if not matches:
            return tokens
        # Longest first, then leftmost; a span overlapping an earlier one at its first or last
        # token is skipped, and every span marks its tokens as seen (as _filter_special_spans).
        matches = sorted(set(matches), key=lambda m: (m[1] - m[0], -m[0]))
        seen: set[int] = set()
        chosen: dict[int, tuple[int, str]] = {}
        for start, end in reversed(matches):
            if start not in seen and end - 1 not in seen:
                text = "".join(tokens[j] + (" " if j in spaced else "") for j in range(start, end))
                chosen[start] = (end, text[:-1] if end - 1 in spaced else text)
            seen.update(range(start, end))
        out: list[str] = []
        i = 0
        while i < len(tokens):
            if i in chosen:
                end, text = chosen[i]
                out.extend(self.rules.get(text, tokens[i:end]))
                i = end
            else:
                out.append(tokens[i])
                i += 1
        return out

    def words(self, text: str) -> list[str]:
        """datatrove's ``split_into_words(text, "eng")``: tokens stripped, blank ones dropped."""
        return [t.strip() for t in self.tokenize(text) if t.strip()]

    def sentence_count(self, text: str) -> int:
        """Number of sentences spaCy's default ``sentencizer`` finds in ``text`` (datatrove's
        ``len(split_into_sentences(text, "eng"))``); 0 for an empty text."""
        tokens = self.tokenize(text)
        if not tokens:
            return 0
        count, seen_period = 1, False
        for tok in tokens:
            in_punct = tok in self.sentence_punct
            if seen_period and not in_punct and not _is_punct(tok):
                count += 1
                seen_period = False
            elif in_punct:
                seen_period = True
        return count


@lru_cache(maxsize=1)
def english() -> EnglishTokenizer:
    """The English tokenizer (loaded once per process)."""
    path = resources.files("mt_data") / "assets" / ASSET
    return EnglishTokenizer(json.loads(gzip.decompress(path.read_bytes())))


def split_words(text: str) -> list[str]:
    """Words of ``text`` as datatrove splits English (spaCy tokens without whitespace)."""
    return english().words(text)


class BatchWords:
    """The words of a batch of texts as integer ids into the batch's distinct words (types), so
    per-word properties are computed once per type and summed per document with numpy."""

    def __init__(self, texts: list[str]) -> None:
        tok = english()
        vocab: dict[str, int] = {}
        ids: list[int] = []
        offsets = [0]
        for text in texts:
            ids.extend([vocab.setdefault(w, len(vocab)) for w in tok.words(text)])
            offsets.append(len(ids))
        self.types = list(vocab)
        self.ids = np.asarray(ids, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.doc = np.repeat(np.arange(len(texts)), np.diff(self.offsets))

    def counts(self) -> np.ndarray:
        """Words per document."""
        return np.diff(self.offsets)

    def type_values(self, fn: Callable[[str], float]) -> np.ndarray:
        """``fn`` of every distinct word, as a float64 array indexed by word id."""
        return np.fromiter((fn(t) for t in self.types), dtype=np.float64, count=len(self.types))

    def per_doc_sum(self, per_type: np.ndarray) -> np.ndarray:
        """Sum over each document's words of a per-type value."""
        return np.bincount(self.doc, weights=per_type[self.ids], minlength=len(self.offsets) - 1)

    def per_doc_distinct(self, per_type: np.ndarray) -> np.ndarray:
        """Number of distinct words of each document with a true per-type flag."""
        mask = per_type[self.ids] != 0
        pairs = np.unique(np.stack([self.doc[mask], self.ids[mask]]), axis=1)
        return np.bincount(pairs[0], minlength=len(self.offsets) - 1)
