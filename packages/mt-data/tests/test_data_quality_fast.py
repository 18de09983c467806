"""The fast paths of the quality rules agree with their plain reference implementations.

English word splitting (``EnglishTokenizer.tokenize`` vs ``tokenize_reference``, the shortcuts
of ``_run_tokens`` and ``_find_suffix``), Gopher's repeated n-gram characters (``NgramChars``
vs ``duplicated_ngram_chars``), the word memo shared by the two Gopher rule sets, and the
byte-range size ``prepare`` plans work items with, and ``prepare``'s task runner (this
process working beside the pool).
"""

from __future__ import annotations

import random
import string
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pyarrow as pa
import pytest

from mt_data.corpus import corpus_texts
from mt_data.ingest import MIN_SPLIT_BYTES, SPLIT_PIECES, parallel_split_bytes, plan_work
from mt_data.pipeline import NoProgress, _run_tasks
from mt_data.quality import GopherQuality, GopherRepetition
from mt_data.quality.gopher import NgramChars, duplicated_ngram_chars
from mt_data.quality.words import english

PIECES = ["a", "b", "ab", "ba", "aab", "é", "😀", "c", "..", "it", "'s"]


def test_ngram_chars_equal_reference_on_random_words() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        vocab = PIECES[: rng.randint(1, len(PIECES))]
        words = [rng.choice(vocab) for _ in range(rng.randint(0, 60))]
        grams = NgramChars(words)
        for n in range(1, 11):
            assert grams.chars(n) == duplicated_ngram_chars(words, n), (words, n)


def test_ngram_chars_equal_reference_on_corpus() -> None:
    tok = english()
    for text in corpus_texts()[::7]:
        words = tok.words(text[:20_000])
        grams = NgramChars(words)
        for n in (2, 5, 7, 10):
            assert grams.chars(n) == duplicated_ngram_chars(words, n)


def test_ngram_chars_joined_text_not_word_tuples() -> None:
    # "ab"+"c" and "a"+"bc" join to the same n-gram text: a repeat for datatrove too
    words = ["ab", "c", "x", "a", "bc"]
    assert NgramChars(words).chars(2) == duplicated_ngram_chars(words, 2) == 3


def test_tokenize_equals_reference_on_random_text() -> None:
    tok = english()
    rng = random.Random(1)
    pieces = list("ab :()'-8.<>=;_*\n\t,!?\"") + [
        "it", "'s", "a.m.", "p.m.", "Adm.", "—", "’", "  ", "don't", ":)", "(:", "e.g.",
        "U.S.", "...", "5km", "°C.", "http://x.org", "Mr", "can't"]
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert tok.tokenize(text) == tok.tokenize_reference(text), repr(text)


def test_tokenize_equals_reference_on_corpus() -> None:
    tok = english()
    for text in corpus_texts()[::5]:
        assert tok.tokenize(text) == tok.tokenize_reference(text)


def test_run_and_suffix_shortcuts_equal_regex_search() -> None:
    tok = english()
    rng = random.Random(2)
    chars = string.ascii_letters + string.digits + ".,;:!?'\"()[]-_$%#…’—\n °"
    runs = {"".join(rng.choice(chars) for _ in range(rng.randint(1, 14)))
            for _ in range(50_000)}
    runs |= {"".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(1, 9)))
             + rng.choice(["", ",", ";", ":", "!", "?"]) for _ in range(20_000)}
    runs |= {w + p for w in tok.rules for p in ("", ",", "?")}
    runs |= {"x" * k + "." * j + nl for k in range(4) for j in range(12) for nl in ("", "\n")}
    for run in runs:
        assert tok._run_tokens(run) == tuple(tok._chunk_tokens(run, True)), repr(run)
        m = tok._suffix(run)
        assert tok._find_suffix(run) == (m.end() - m.start() if m else 0), repr(run)


def test_gopher_repetition_reuses_words_of_gopher_quality() -> None:
    texts = pa.array([t[:5000] for t in corpus_texts()[:40]])
    GopherQuality().apply(texts)
    tok = english()
    assert tok.recent_words(texts[0].as_py()) == tok.words(texts[0].as_py())
    with_memo = GopherRepetition().apply(texts).failed
    tok.words_of([])  # forget them
    assert tok.recent_words(texts[0].as_py()) is None
    assert (GopherRepetition().apply(texts).failed == with_memo).all()


def test_parallel_split_bytes(tmp_path: Path) -> None:
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "x"}\n' * 1000)
    assert parallel_split_bytes([small], 8 << 20) == MIN_SPLIT_BYTES
    assert parallel_split_bytes([small], 4000) == 4000  # a smaller configured size wins
    big = tmp_path / "big.jsonl"
    line = '{"text": "' + "y" * 998 + '"}\n'
    big.write_text(line * 40_000)  # 40 MB
    size = big.stat().st_size
    split = parallel_split_bytes([big], 8 << 20)
    assert split == -(-size // SPLIT_PIECES)
    items, _ = plan_work([big], split_bytes=split)
    assert len(items) == SPLIT_PIECES
    assert parallel_split_bytes([big], 1 << 20) == 1 << 20


def test_run_tasks_shares_work_with_the_pool_and_reports_the_first_failure() -> None:
    seen: list[int] = []
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        tasks = [(str(i),) for i in range(12)]
        assert _run_tasks(int, tasks, [1.0] * 12, pool, NoProgress(), seen.append) == list(
            range(12))
        assert sorted(seen) == list(range(12))
        for bad in ([3, 5], [7, 2], [0, 11], [10]):
            tasks = [(f"x{i}" if i in bad else str(i),) for i in range(12)]
            with pytest.raises(ValueError, match=f"'x{min(bad)}'"):
                _run_tasks(int, tasks, [1.0] * 12, pool, NoProgress())
