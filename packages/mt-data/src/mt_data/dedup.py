"""Exact and fuzzy deduplication.

Exact: a 128-bit BLAKE2b hash of each (normalised) text; the first occurrence is kept.
Fuzzy (as MT-NLG): MinHash signatures of word n-gram shingles, LSH banding to find candidate
pairs, candidates verified by their estimated Jaccard similarity (>= threshold), connected
components of the verified pairs by union-find, and one document (the first) kept per cluster.
Word and shingle hashing and the MinHash permutations are vectorised with numpy over a whole
batch: no Python loop per word or per shingle.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_SHIFT32 = np.uint64(32)
# Odd 64-bit constants for polynomial hashing (wrap-around arithmetic mod 2**64).
_P_BYTE = np.uint64(0x100000001B3)
_P_WORD = np.uint64(0x9E3779B97F4A7C15)
_P_BAND = np.uint64(0xC2B2AE3D27D4EB4F)


@dataclass(frozen=True)
class DedupConfig:
    """Deduplication switches and MinHash/LSH parameters."""

    exact: bool = True
    """Drop documents whose normalised text is identical to an earlier one."""
    fuzzy: bool = True
    """Drop near-duplicates (MinHash + LSH, Jaccard >= threshold), one kept per cluster."""
    num_perm: int = 128
    """MinHash permutations (signature length)."""
    bands: int = 16
    """LSH bands; num_perm must be a multiple (rows per band = num_perm // bands)."""
    ngram: int = 5
    """Words per shingle."""
    threshold: float = 0.8
    """Estimated Jaccard similarity from which two documents are duplicates."""
    seed: int = 1234
    """Seed of the MinHash permutations (must be equal for all shards of one run)."""

    def __post_init__(self) -> None:
        if self.num_perm < 1 or self.bands < 1 or self.num_perm % self.bands:
            raise ValueError(
                f"num_perm ({self.num_perm}) must be a positive multiple of bands ({self.bands})"
            )
        if self.ngram < 1:
            raise ValueError(f"ngram must be >= 1, got {self.ngram}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")


def content_hashes(texts: Iterable[str]) -> np.ndarray:
    """128-bit BLAKE2b digest of each text, as an ``[n, 16]`` uint8 array."""
    digests = b"".join(hashlib.blake2b(t.encode("utf-8"), digest_size=16).digest() for t in texts)
    return np.frombuffer(digests, dtype=np.uint8).reshape(-1, 16)


def first_occurrences(hashes: np.ndarray) -> np.ndarray:
    """Boolean mask keeping the first document of every distinct ``[n, 16]`` hash."""
    keys = np.ascontiguousarray(hashes).view(np.dtype([("hi", "<u8"), ("lo", "<u8")])).ravel()
    _, first = np.unique(keys, return_index=True)
    keep = np.zeros(len(keys), dtype=bool)
    keep[first] = True
    return keep


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: spreads polynomial hashes over all 64 bits."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _segment_poly_hash(values: np.ndarray, starts: np.ndarray, base: np.uint64) -> np.ndarray:
    """sum_j values[start + j] * base**j per non-empty segment (segments tile ``values``)."""
    n = len(values)
    seg = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))
    pos = np.arange(n) - starts[seg]
    longest = int(pos.max()) + 1 if n else 1
    powers = np.ones(longest, dtype=np.uint64)
    with np.errstate(over="ignore"):
        powers[1:] = np.cumprod(np.full(longest - 1, base, dtype=np.uint64))
    with np.errstate(over="ignore"):
        return np.add.reduceat(values.astype(np.uint64) * powers[pos], starts)


def word_hashes(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hash of every lower-cased word (letters/digits runs) and words per document."""
    lower = pc.utf8_lower(texts)
    words = pc.split_pattern_regex(lower, r"[^\pL\pN]+")
    flat = pc.list_flatten(words)
    parents = pc.list_parent_indices(words).to_numpy()
    nonempty = pc.greater(pc.binary_length(flat), 0)
    flat = flat.filter(nonempty)
    parents = parents[nonempty.to_numpy(zero_copy_only=False)]
    counts = np.bincount(parents, minlength=len(texts)).astype(np.int64)
    if len(flat) == 0:
        return np.zeros(0, dtype=np.uint64), counts
    offsets = np.frombuffer(flat.buffers()[1], dtype=np.int32)
    offsets = offsets[flat.offset : flat.offset + len(flat) + 1]
    data = np.frombuffer(flat.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    starts = (offsets[:-1] - offsets[0]).astype(np.int64)
    return _mix64(_segment_poly_hash(data, starts, _P_BYTE)), counts


def shingle_hashes(
    texts: pa.Array, ngram: int, short_docs: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of word n-gram shingles, grouped by document, and shingles per document.

    Shingle k of a document starts at its word k. With ``short_docs``, a document with fewer
    than ``ngram`` (but some) words has a single shingle of all its words; otherwise none.
    """
    words, counts = word_hashes(texts)
    ends = np.cumsum(counts)
    starts = ends - counts
    if len(words) == 0:
        return words, np.zeros(len(counts), dtype=np.int64)
    nwin = max(len(words) - ngram + 1, 0)
    win = np.zeros(nwin, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(ngram):
            win = win * _P_WORD + words[j : j + nwin]
    doc_of = np.repeat(np.arange(len(counts)), counts)[:nwin]
    valid = np.arange(nwin) + ngram <= ends[doc_of]
    long_hashes = win[valid]
    per_doc = np.bincount(doc_of[valid], minlength=len(counts)).astype(np.int64)
    short = np.flatnonzero((counts > 0) & (counts < ngram))
    if short_docs and len(short):
        sel = np.concatenate([np.arange(starts[d], ends[d]) for d in short])
        seg_starts = np.concatenate([[0], np.cumsum(counts[short])[:-1]])
        short_hashes = _segment_poly_hash(words[sel], seg_starts, _P_WORD)
        # Merge short-document shingles into document order.
        doc_all = np.concatenate([doc_of[valid], short])
        hashes = np.concatenate([long_hashes, short_hashes])
        order = np.argsort(doc_all, kind="stable")
        long_hashes = hashes[order]
        per_doc[short] = 1
    return _mix64(long_hashes), per_doc


class MinHasher:
    """MinHash signatures ``h_p(x) = (a_p * x + b_p) mod 2**64 >> 32`` over shingle hashes."""

    def __init__(self, num_perm: int = 128, ngram: int = 5, seed: int = 1234) -> None:
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + 1
        self.b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
        self.num_perm = num_perm
        self.ngram = ngram

    def signatures(self, texts: pa.Array | list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``[n, num_perm]`` uint32 signatures and a mask of documents that have shingles."""
        if not isinstance(texts, pa.Array):
            texts = pa.array(texts, pa.string())
        hashes, per_doc = shingle_hashes(texts, self.ngram)
        sig = np.full((len(per_doc), self.num_perm), np.iinfo(np.uint32).max, dtype=np.uint32)
        has = per_doc > 0
        if not len(hashes):
            return sig, has
        starts = (np.cumsum(per_doc) - per_doc)[has]
        # Permutations along rows of a reused buffer: in-place, contiguous ops are ~20x faster
        # than a broadcast [shingles, perms] product; the buffer is bounded to ~32 MiB.
        chunk = max(1, min(self.num_perm, (1 << 22) // len(hashes)))
        buf = np.empty((chunk, len(hashes)), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for lo in range(0, self.num_perm, chunk):
                hi = min(lo + chunk, self.num_perm)
                part = buf[: hi - lo]
                np.multiply(self.a[lo:hi, None], hashes[None, :], out=part)
                part += self.b[lo:hi, None]
                part >>= _SHIFT32
                sig[has, lo:hi] = np.minimum.reduceat(part, starts, axis=1).T
        return sig, has


def estimated_jaccard(sig: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Fraction of equal MinHash values for each pair (u[i], v[i])."""
    return (sig[u] == sig[v]).mean(axis=1)


def lsh_candidate_pairs(sig: np.ndarray, bands: int, valid: np.ndarray | None = None) -> np.ndarray:
    """Candidate pairs ``[m, 2]`` (i < j) of documents sharing at least one LSH band.

    Within each bucket every member is paired with the first member and with its predecessor,
    which connects the bucket with a linear number of pairs.
    """
    n, num_perm = sig.shape
    rows = num_perm // bands
    idx = np.arange(n) if valid is None else np.flatnonzero(valid)
    pairs = []
    for band in range(bands):
        block = sig[idx, band * rows : (band + 1) * rows].astype(np.uint64)
        key = np.zeros(len(idx), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for j in range(rows):
                key = key * _P_BAND + block[:, j]
        order = np.argsort(key, kind="stable")
        sk = key[order]
        same = sk[1:] == sk[:-1]
        if not same.any():
            continue
        run_start = np.flatnonzero(np.concatenate([[True], ~same]))
        first_of = run_start[np.cumsum(np.concatenate([[True], ~same])) - 1]
        members = np.flatnonzero(np.concatenate([[False], same]))
        ids = idx[order]
        pairs.append(np.stack([ids[first_of[members]], ids[members]], axis=1))
        pairs.append(np.stack([ids[members - 1], ids[members]], axis=1))
    if not pairs:
        return np.zeros((0, 2), dtype=np.int64)
    allp = np.concatenate(pairs).astype(np.int64)
    allp = np.sort(allp, axis=1)
    allp = allp[allp[:, 0] != allp[:, 1]]
    return np.unique(allp, axis=0)


class UnionFind:
    """Disjoint sets over ``0..n-1``; the root of each set is its smallest member."""

    def __init__(self, n: int) -> None:
        self.parent = np.arange(n, dtype=np.int64)

    def find(self, x: int) -> int:
        """Root of x's set, halving the path on the way."""
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = int(parent[x])
        return x

    def union(self, a: int, b: int) -> None:
        """Merge the sets of a and b (the smaller root wins)."""
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def roots(self) -> np.ndarray:
        """Root of every element."""
        roots = self.parent.copy()
        while True:  # parents always point to smaller indices, so pointer jumping converges
            nxt = roots[roots]
            if np.array_equal(nxt, roots):
                return roots
            roots = nxt


@dataclass(frozen=True)
class FuzzyResult:
    """Outcome of fuzzy dedup over n documents."""

    keep: np.ndarray
    """Boolean mask: True for documents kept (the first of each cluster, and singletons)."""
    cluster: np.ndarray
    """Cluster id (smallest member index) of every document."""
    candidate_pairs: int
    """Pairs proposed by LSH."""
    duplicate_pairs: int
    """Candidate pairs verified as duplicates (estimated Jaccard >= threshold)."""

    @property
    def clusters(self) -> int:
        """Number of clusters with more than one document."""
        sizes = np.bincount(self.cluster, minlength=len(self.cluster))
        return int((sizes > 1).sum())

    @property
    def removed(self) -> int:
        """Documents dropped as near-duplicates."""
        return int((~self.keep).sum())


def fuzzy_dedup(
    sig: np.ndarray, valid: np.ndarray, bands: int, threshold: float
) -> FuzzyResult:
    """Cluster near-duplicate documents from their MinHash signatures; keep one per cluster."""
    n = len(sig)
    cand = lsh_candidate_pairs(sig, bands, valid)
    sim = estimated_jaccard(sig, cand[:, 0], cand[:, 1]) if len(cand) else np.zeros(0)
    dup = cand[sim >= threshold]
    uf = UnionFind(n)
    for a, b in dup:
        uf.union(int(a), int(b))
    cluster = uf.roots()
    keep = cluster == np.arange(n)
    return FuzzyResult(keep, cluster, len(cand), len(dup))
