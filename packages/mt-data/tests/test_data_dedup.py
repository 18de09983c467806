"""Exact and fuzzy dedup on real text with planted near-duplicates (edited real documents)."""

from __future__ import annotations

import random
import re

import numpy as np
import pyarrow as pa
import pytest

from mt_data.corpus import corpus_texts
from mt_data.dedup import (
    DedupConfig,
    MinHasher,
    UnionFind,
    content_hashes,
    estimated_jaccard,
    first_occurrences,
    fuzzy_dedup,
    lsh_candidate_pairs,
)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return corpus_texts()


def edit(text: str, fraction: float, seed: int) -> str:
    """A near-duplicate: replace, delete or insert about ``fraction`` of the words."""
    rng = random.Random(seed)
    words = text.split(" ")
    for _ in range(max(1, int(len(words) * fraction))):
        i = rng.randrange(len(words))
        op = rng.choice(("replace", "delete", "insert"))
        if op == "replace":
            words[i] = rng.choice(("whale", "ship", "sea", "Congress", "nation"))
        elif op == "delete":
            del words[i]
        else:
            words.insert(i, rng.choice(("indeed", "moreover", "verily")))
    return " ".join(words)


def shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = re.findall(r"[^\W_]+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_exact_dedup_keeps_first(texts: list[str]) -> None:
    docs = texts[:20] + [texts[3], texts[7], texts[3]] + texts[20:25]
    keep = first_occurrences(content_hashes(docs))
    assert keep.tolist() == [True] * 20 + [False] * 3 + [True] * 5
    # One changed character is not an exact duplicate.
    assert first_occurrences(content_hashes([texts[0], texts[0] + "."])).all()


def test_minhash_estimates_jaccard(texts: list[str]) -> None:
    pairs = [(texts[10], edit(texts[10], f, s)) for f, s in ((0.01, 1), (0.03, 2), (0.1, 3))]
    pairs.append((texts[10], texts[11]))
    hasher = MinHasher(num_perm=256, ngram=5, seed=7)
    for a, b in pairs:
        sig, has = hasher.signatures([a, b])
        assert has.all()
        sa, sb = shingles(a), shingles(b)
        true = len(sa & sb) / len(sa | sb)
        est = float(estimated_jaccard(sig, np.array([0]), np.array([1]))[0])
        assert abs(est - true) < 0.08, (true, est)


def test_signatures_are_batch_independent(texts: list[str]) -> None:
    hasher = MinHasher()
    together, _ = hasher.signatures(pa.array(texts[:12]))
    alone = np.concatenate([hasher.signatures([t])[0] for t in texts[:12]])
    np.testing.assert_array_equal(together, alone)


def test_fuzzy_dedup_finds_planted_near_duplicates(texts: list[str]) -> None:
    originals = texts  # 135 Moby-Dick chapters + 46 State of the Union addresses
    planted = {5: edit(texts[5], 0.01, 11), 42: edit(texts[42], 0.02, 12),
               140: edit(texts[140], 0.02, 13), 170: edit(texts[170], 0.01, 14)}
    # A chain: each copy is a light edit of the previous one (transitive cluster).
    chain = [edit(texts[90], 0.01, 20)]
    chain.append(edit(chain[-1], 0.01, 21))
    docs = originals + list(planted.values()) + chain
    config = DedupConfig()
    sig, has = MinHasher(config.num_perm, config.ngram, config.seed).signatures(docs)
    result = fuzzy_dedup(sig, has, config.bands, config.threshold)
    n = len(originals)
    assert result.keep[:n].all()  # every distinct real document kept
    assert not result.keep[n:].any()  # every planted near-duplicate removed
    expected_roots = list(planted) + [90, 90]
    assert result.cluster[n:].tolist() == expected_roots
    assert result.clusters == 5 and result.removed == 6


def test_different_documents_not_merged(texts: list[str]) -> None:
    # Far edits (30% of words) are different documents at threshold 0.8.
    docs = [texts[12], edit(texts[12], 0.3, 5)]
    sig, has = MinHasher().signatures(docs)
    assert fuzzy_dedup(sig, has, 16, 0.8).keep.all()


def test_short_and_empty_documents(texts: list[str]) -> None:
    docs = ["Call me Ishmael.", "Call me Ishmael.", "", "...", texts[0]]
    sig, has = MinHasher().signatures(docs)
    assert has.tolist() == [True, True, False, False, True]
    result = fuzzy_dedup(sig, has, 16, 0.8)
    assert result.keep.tolist() == [True, False, True, True, True]  # no-word docs never merged


def test_lsh_and_union_find() -> None:
    sig = np.array([[1, 2, 3, 4], [1, 2, 9, 9], [8, 8, 3, 4], [5, 6, 7, 0]], dtype=np.uint32)
    pairs = lsh_candidate_pairs(sig, bands=2)
    assert pairs.tolist() == [[0, 1], [0, 2]]
    uf = UnionFind(6)
    uf.union(4, 2)
    uf.union(5, 4)
    uf.union(1, 3)
    assert uf.roots().tolist() == [0, 1, 2, 1, 2, 2]


def test_config_validation() -> None:
    with pytest.raises(ValueError,
                       match=r"num_perm \(100\) must be a positive multiple of bands \(16\)"):
        DedupConfig(num_perm=100)
