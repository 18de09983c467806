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
from itertools import chain, compress, count, islice, repeat
from pathlib import Path
from typing import Any

import numpy as np

ASSET = "spacy-en-tokenizer.json.gz"
_RUNS = re.compile(r"\S+|\s+")
_ASCII_WORD = re.compile(r"[A-Za-z]+|[0-9]+").fullmatch
_ASCII_WORD_PUNCT = re.compile(r"([A-Za-z]+)[,;:!?]").fullmatch
_CACHE_SIZE = 1 << 18
_HARD_SPACE = re.compile(r"[^\S ]|  ")  # in every whitespace run but a single ' '


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


def _suffix_tail(pattern: str, flags: int) -> int:
    """How many last characters of a string can hold a match of the suffix regex, 0 if
    unknown. spaCy's suffix regex is one alternation of '...$' branches: all of bounded width
    (at most W characters, ending at the end or before a final newline: W + 1 from the end)
    but '\\.\\.+$', which also matches from any later position holding 2+ dots. So a search
    from ``len - tail`` finds the whole string's first match, unless that match starts
    exactly there (a run of dots that may reach further back)."""
    try:
        import re._parser as sre_parse
    except ImportError:  # another Python: search whole strings
        return 0
    tree = sre_parse.parse(pattern, flags)
    if len(tree.data) != 1 or tree.data[0][0] != sre_parse.BRANCH:
        return 0
    dots = sre_parse.parse(r"\.\.+$", flags).data
    widest = 0
    for branch in tree.data[0][1][1]:
        low, high = branch.getwidth()
        if high >= sre_parse.MAXREPEAT:
            if repr(branch.data) != repr(dots):
                return 0
        else:
            widest = max(widest, high)
    return widest + 2


def _class_chars(items: Any, sre_parse: Any) -> set[int] | None:
    """The code points of a parsed character class ``[...]`` made of literals and ranges;
    None for a category (``\\d``, ``\\w``) or a negated set."""
    out: set[int] = set()
    for op, av in items:
        if op == sre_parse.LITERAL:
            out.add(av)
        elif op == sre_parse.RANGE:
            out.update(range(av[0], av[1] + 1))
        else:
            return None
    return out


def _last_chars(items: Any, sre_parse: Any) -> set[int] | None:
    """Every character a match of the parsed regex items can end with (zero-width items
    skipped), or None when that is not simply a set of literals."""
    for op, av in reversed(list(items)):
        if op in (sre_parse.AT, sre_parse.ASSERT, sre_parse.ASSERT_NOT):
            continue
        if op == sre_parse.LITERAL:
            return {av}
        if op == sre_parse.IN:
            return _class_chars(av, sre_parse)
        if op == sre_parse.SUBPATTERN:
            return _last_chars(av[-1].data, sre_parse)
        if op == sre_parse.BRANCH:
            out: set[int] = set()
            for branch in av[1]:
                chars = _last_chars(branch.data, sre_parse)
                if chars is None:
                    return None
                out |= chars
            return out
        if op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT) and av[0] >= 1:
            return _last_chars(av[2].data, sre_parse)
        return None
    return None


_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_QUOTES = ("'", "\u2019")
_HAS_DIGIT = re.compile("[0-9]").search


def _alnum_suffixes(pattern: str, flags: int) -> bool:
    """Whether the suffix regex (an alternation of branches ending in ``$``) matches no
    string ending in an ASCII digit, and a string ending in an ASCII letter only when it
    holds a quote of ``_QUOTES`` or an ASCII digit: every branch that can end in a letter
    either is literal text holding such a quote, or starts with the lookbehind ``(?<=[0-9])``
    (spaCy's ``'s`` and unit suffixes). Checked on the regex; False (no shortcut) when
    unsure."""
    try:
        import re._parser as sre_parse
    except ImportError:
        return False
    if flags & (re.IGNORECASE | re.MULTILINE):
        return False
    tree = sre_parse.parse(pattern, flags)
    if len(tree.data) != 1 or tree.data[0][0] != sre_parse.BRANCH:
        return False
    alnum = {ord(ch) for ch in _ALNUM}
    digit = [(sre_parse.IN, [(sre_parse.RANGE, (48, 57))])]
    for branch in tree.data[0][1][1]:
        items = list(branch.data)
        chars = _last_chars(items, sre_parse)
        if chars is None:
            return False
        if not chars & alnum:
            continue
        if any(48 <= c <= 57 for c in chars):
            return False  # a branch may end in a digit
        if items and items[0][0] == sre_parse.ASSERT and items[0][1][0] == -1 \
                and repr(list(items[0][1][1].data)) == repr(digit):
            continue  # (?<=[0-9]): the string holds an ASCII digit
        literal = [av for op, av in items if op == sre_parse.LITERAL]
        if all(op in (sre_parse.LITERAL, sre_parse.AT) for op, _ in items) and any(
                chr(c) in _QUOTES for c in literal):
            continue
        return False
    return True


def _first_chars(pattern: str, flags: int) -> frozenset[str] | None:
    """Every character a match of the regex can start with (after zero-width lookarounds and
    anchors), or None when that is not simply a set of literals (a string holding none of
    them cannot match; a match of spaCy's ``^``-anchored prefix regex must start with one).
    spaCy's infix and prefix regexes are alternations of such branches."""
    try:
        import re._parser as sre_parse
    except ImportError:
        return None
    if flags & re.IGNORECASE:
        return None
    lookaround = (sre_parse.ASSERT, sre_parse.ASSERT_NOT, sre_parse.AT)  # zero-width

    def first(items: Any) -> set[int] | None:
        for op, av in items:
            if op in lookaround:
                continue
            if op == sre_parse.LITERAL:
                return {av}
            if op == sre_parse.IN:
                return _class_chars(av, sre_parse)
            if op == sre_parse.BRANCH:
                out: set[int] = set()
                for branch in av[1]:
                    chars = first(branch.data if hasattr(branch, "data") else branch)
                    if chars is None:
                        return None
                    out |= chars
                return out
            if op == sre_parse.MAX_REPEAT and av[0] >= 1:
                return first(av[2].data if hasattr(av[2], "data") else av[2])
            return None
        return None  # only lookarounds: could match the empty string anywhere

    chars = first(sre_parse.parse(pattern, flags).data)
    return None if chars is None else frozenset(map(chr, chars))


class _RunCache(dict):
    """run -> its tokens (a tuple), computed by ``fn`` on a miss; emptied when it grows past
    ``_CACHE_SIZE`` entries (a cache: results never depend on it)."""

    def __init__(self, fn: Callable[[str], tuple[str, ...]]) -> None:
        super().__init__()
        self.fn = fn

    def __missing__(self, run: str) -> tuple[str, ...]:
        if len(self) > _CACHE_SIZE:
            self.clear()
        value = self[run] = self.fn(run)
        return value


class EnglishTokenizer:
    """spaCy 3's ``Tokenizer`` algorithm with spaCy's English settings (see module doc)."""

    def __init__(self, data: dict[str, Any]) -> None:
        def compile_(key: str) -> re.Pattern[str]:
            return re.compile(data[key]["pattern"], data[key]["flags"])

        self.version = data["spacy_version"]
        self._prefix, self._suffix = compile_("prefix").search, compile_("suffix").search
        self._suffix_tail = _suffix_tail(data["suffix"]["pattern"], data["suffix"]["flags"])
        self._alnum_rule = _alnum_suffixes(data["suffix"]["pattern"], data["suffix"]["flags"])
        self._infix, self._url = compile_("infix").finditer, compile_("url").match
        self._infix_chars = _first_chars(data["infix"]["pattern"], data["infix"]["flags"])
        self._prefix_chars = _first_chars(data["prefix"]["pattern"], data["prefix"]["flags"])
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
        # The fast path (tokenize): runs -> tokens from two caches, and the special-case pass
        # restricted to patterns of 2+ tokens, found by their first two tokens. A 1-token
        # pattern is processed after every longer one and replaced by its rule, itself, so it
        # changes nothing when that rule is the token itself (checked here; else: slow path).
        self._multi: dict[tuple[str, str], list[tuple[str, ...]]] = {}
        for patterns in self._patterns.values():
            for pattern in patterns:
                if len(pattern) > 1:
                    self._multi.setdefault(pattern[:2], []).append(pattern)
        self._fast = all(self.rules.get(p[0]) == p for ps in self._patterns.values()
                         for p in ps if len(p) == 1)
        self._inner: set[str] = set()
        self._plain = _RunCache(self._noted_run_tokens)
        self._recent: dict[str, list[str]] = {}
        # words' fast path: a token of a non-space run is a word (stripping changes nothing,
        # none is blank) when every rule of a key without whitespace gives such tokens.
        self._bare = self._fast and all(
            tok and tok.strip() == tok for key, toks in self.rules.items()
            if not any(map(str.isspace, key)) for tok in toks)
        plain = self._plain
        # a run after the first: a space run loses its first ' ' (absorbed by the word before)
        self._after = _RunCache(lambda run: (plain[run[1:]] if len(run) > 1 else ())
                                if run[0] == " " else plain[run])

    def _find_prefix(self, s: str) -> int:
        if self._prefix_chars is not None and (not s or s[0] not in self._prefix_chars):
            return 0  # no prefix starts with this character
        m = self._prefix(s)
        return m.end() - m.start() if m is not None else 0

    def _find_suffix(self, s: str) -> int:
        if self._alnum_rule and s and s[-1] in _ALNUM and (
                s[-1] <= "9" or not (_HAS_DIGIT(s) or _QUOTES[0] in s or _QUOTES[1] in s)):
            return 0  # no suffix can match (see _alnum_suffixes)
        start = len(s) - self._suffix_tail
        if self._suffix_tail and start > 0:
            # Only the last characters can hold a match (see _suffix_tail), unless a '..+'
            # run reaches back to ``start``: then search the whole string as well.
            m = self._suffix(s, start)
            if m is None:
                return 0
            if m.start() > start:
                return m.end() - m.start()
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
            elif (self._infix_chars is not None and self._infix_chars.isdisjoint(string)
                  or self._url(string)):
                tokens.append(string)  # no character an infix can start with, or a URL
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

    def _run_tokens(self, run: str) -> tuple[str, ...]:
        """``_chunk_tokens(run, True)``, with shortcuts for ASCII words and numbers, bare or
        followed by one of ``,;:!?``: no prefix, suffix, infix or URL rule of spaCy's English
        applies inside them (no pattern matches an ASCII letter or digit alone), so only the
        special cases and that one trailing character split them."""
        rules = self.rules
        if run in rules:
            return rules[run]
        if _ASCII_WORD(run):
            return (run,)
        m = _ASCII_WORD_PUNCT(run)
        if m:
            word = m.group(1)
            return (*rules.get(word, (word,)), run[-1])
        return tuple(self._chunk_tokens(run, True))

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
        if not self._fast:
            return self.tokenize_reference(text)
        runs = _RUNS.findall(text)
        if not runs:
            return []
        per_run = [self._plain[runs[0]]]
        per_run += map(self._after.__getitem__, islice(runs, 1, None))
        tokens = list(chain.from_iterable(per_run))
        multi = self._multi
        starts = compress(count(), map(multi.__contains__, zip(tokens, islice(tokens, 1, None))))
        matches = [(i, i + len(pattern)) for i in starts
                   for pattern in multi[tokens[i], tokens[i + 1]]
                   if tuple(tokens[i:i + len(pattern)]) == pattern]
        if not matches:
            return tokens
        # A token is followed by an absorbed ' ' when it ends its run and the next run (not
        # the first) starts with one; only the tokens of matched spans are asked about.
        ends = np.cumsum(np.fromiter(map(len, per_run), dtype=np.int64, count=len(per_run)))
        absorbed = np.fromiter(map(str.startswith, runs, repeat(" ")), dtype=bool, count=len(runs))
        spaced = ends[np.flatnonzero(absorbed[1:])] - 1
        asked = np.concatenate([np.arange(start, end) for start, end in matches])
        spaced = set(spaced[np.isin(spaced, asked)].tolist())
        return self._replace_matches(tokens, spaced, matches)

    def tokenize_reference(self, text: str) -> list[str]:
        """:meth:`tokenize`, token by token as first written (slower; the same result)."""
        tokens, spaced = self._split_spaced(text, True)
        return self._special_pass(tokens, spaced)

    def _replace_matches(self, tokens: list[str], spaced: set[int],
                         matches: list[tuple[int, int]]) -> list[str]:
        """The rest of :meth:`_special_pass`: choose among the matches and replace them."""
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
        last = 0
        for start in sorted(chosen):  # chosen spans never overlap
            end, text = chosen[start]
            out += tokens[last:start]
            out += self.rules.get(text, tokens[start:end])
            last = end
        out += tokens[last:]
        return out

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
        return self._replace_matches(tokens, spaced, matches)

    def _noted_run_tokens(self, run: str) -> tuple[str, ...]:
        """:meth:`_run_tokens`, recording in ``_inner`` a run whose tokens hold a special case
        that changes them (see :meth:`words`)."""
        if not self._plain:  # (re)started: forget the runs of the emptied cache
            self._inner.clear()
        tokens = self._run_tokens(run)
        if (len(tokens) > 1
                and not self._multi.keys().isdisjoint(zip(tokens, islice(tokens, 1, None)))
                and any(self._changes(tokens, i) for i, pair in
                        enumerate(zip(tokens, islice(tokens, 1, None))) if pair in self._multi)):
            self._inner.add(run)
        return tokens

    def _changes(self, tokens: tuple[str, ...], i: int) -> bool:
        """Whether a special-case pattern matching ``tokens`` from ``i`` is replaced by other
        tokens than its own (its text's rule, when one exists)."""
        for pattern in self._multi[tokens[i], tokens[i + 1]]:
            if (tokens[i:i + len(pattern)] == pattern
                    and self.rules.get("".join(pattern), pattern) != pattern):
                return True
        return False

    def words(self, text: str) -> list[str]:
        """datatrove's ``split_into_words(text, "eng")``: tokens stripped, blank ones dropped.

        The special-case pass (see :meth:`tokenize`) replaces each chosen match by the rule of
        its text, else by its own tokens. A match across runs holds the ``' '`` between them
        (no rule of 2+ tokens has a space), and one inside a run has the text of its pattern:
        so when no run holds a pattern whose rule differs from it (``_inner``), the tokens are
        those of the runs whatever the matches. Whitespace tokens are blank, so the words are
        then the tokens of the non-space runs (``str.split``: the ``\\s`` runs of ``_RUNS``),
        as cached by ``tokenize`` (every such token is a word: ``_bare``); other texts are
        split by :meth:`tokenize`."""
        if not self._bare:
            return list(filter(None, map(str.strip, self.tokenize(text))))
        runs = text.split()
        plain, inner = self._plain, self._inner
        words = list(chain.from_iterable(map(plain.__getitem__, runs)))
        if inner.isdisjoint(runs):
            return words
        # Pieces between whitespace other than one ' ' (which leaves a whitespace token, in no
        # pattern): no match crosses them, so each piece is split apart, by tokenize only
        # when it holds a run of _inner.
        words = []
        for piece in _HARD_SPACE.split(text):
            runs = piece.split()
            if any(map(inner.__contains__, runs)):
                words += filter(None, map(str.strip, self.tokenize(piece)))
            else:
                words += chain.from_iterable(map(plain.__getitem__, runs))
        return words

    def words_of(self, texts: list[str]) -> list[list[str]]:
        """:meth:`words` of each text. The words of this call's texts are kept until the next
        call (:meth:`recent_words`), so rule sets applied one after the other to the same
        documents (gopher-quality, then gopher-repetition on those it kept) split them once."""
        memo = self._recent
        out = [memo[t] if t in memo else self.words(t) for t in texts]
        self._recent = dict(zip(texts, out, strict=True))
        return out

    def recent_words(self, text: str) -> list[str] | None:
        """The words of ``text`` if it was one of the texts of the last :meth:`words_of` call."""
        return self._recent.get(text)

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
        per_doc = english().words_of(texts)
        words = list(chain.from_iterable(per_doc))
        vocab = dict.fromkeys(words)  # distinct words, in order of first occurrence
        self.types = list(vocab)
        vocab = dict(zip(self.types, range(len(self.types)), strict=True))
        self.ids = np.fromiter(map(vocab.__getitem__, words), dtype=np.int64, count=len(words))
        self.offsets = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, per_doc), dtype=np.int64, count=len(per_doc)),
                  out=self.offsets[1:])
        self.doc = np.repeat(np.arange(len(texts)), np.diff(self.offsets))
        self._texts = texts
        self._lengths: np.ndarray | None = None
        self._rows: dict[str, int] | None = None
        BatchWords._last = self

    _last: BatchWords | None = None

    @staticmethod
    def recent() -> BatchWords | None:
        """The last one built (gopher-repetition reuses gopher-quality's: see doc_words)."""
        return BatchWords._last

    def doc_words(self, text: str) -> tuple[np.ndarray, np.ndarray] | None:
        """Word ids (equal for equal words) and word lengths of ``text``, if it is one of the
        batch's texts (else None)."""
        if self._rows is None:
            self._rows = dict(zip(self._texts, range(len(self._texts)), strict=True))
            self._lengths = self.type_values(len).astype(np.int64)
        row = self._rows.get(text)
        if row is None:
            return None
        ids = self.ids[self.offsets[row]:self.offsets[row + 1]]
        return ids, self._lengths[ids]

    def counts(self) -> np.ndarray:
        """Words per document."""
        return np.diff(self.offsets)

    def type_values(self, fn: Callable[[str], float]) -> np.ndarray:
        """``fn`` of every distinct word, as a float64 array indexed by word id."""
        return np.fromiter(map(fn, self.types), dtype=np.float64, count=len(self.types))

    def per_doc_sum(self, per_type: np.ndarray) -> np.ndarray:
        """Sum over each document's words of a per-type value."""
        return np.bincount(self.doc, weights=per_type[self.ids], minlength=len(self.offsets) - 1)

    def per_doc_distinct(self, per_type: np.ndarray) -> np.ndarray:
        """Number of distinct words of each document with a true per-type flag."""
        mask = per_type[self.ids] != 0
        # one integer per (document, word) pair: doc * types + id
        pairs = np.unique(self.doc[mask] * np.int64(len(self.types)) + self.ids[mask])
        return np.bincount(pairs // np.int64(max(1, len(self.types))),
                           minlength=len(self.offsets) - 1)
