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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_SHIFT32 = np.uint64(32)
# Odd 64-bit constants for polynomial hashing (wrap-around arithmetic mod 2**64).
_P_BYTE = np.uint64(0x100000001B3)
_P_WORD = np.uint64(0x9E3779B97F4A7C15)
_P_BAND = np.uint64(0xC2B2AE3D27D4EB4F)


#: The most MinHash permutations a signature may have (datatrove and datasketch use 128-256).
MAX_PERMUTATIONS = 2**16


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
        if self.num_perm > MAX_PERMUTATIONS:
            raise ValueError(f"num_perm must be at most {MAX_PERMUTATIONS:,} (8 bytes per "
                             f"permutation per document), got {self.num_perm:,}")
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
        pairs.extend(_bucket_pairs(_band_key(block.T), idx))
    if not pairs:
        return np.zeros((0, 2), dtype=np.int64)
    allp = np.concatenate(pairs).astype(np.int64)
    allp = np.sort(allp, axis=1)
    allp = allp[allp[:, 0] != allp[:, 1]]
    return np.unique(allp, axis=0)


def _band_key(columns: Iterable[np.ndarray]) -> np.ndarray:
    """LSH bucket key of one band from its signature columns (one value per document)."""
    key: np.ndarray | None = None
    with np.errstate(over="ignore"):
        for col in columns:
            col = col.astype(np.uint64)
            key = col if key is None else key * _P_BAND + col
    assert key is not None
    return key


def _bucket_pairs(key: np.ndarray, idx: np.ndarray) -> list[np.ndarray]:
    """Pairs of ``idx`` whose keys are equal: each bucket member with the first member and
    with its predecessor (in stable key order); ``[]`` when no bucket has two members."""
    order = np.argsort(key, kind="stable")
    sk = key[order]
    same = sk[1:] == sk[:-1]
    if not same.any():
        return []
    run_start = np.flatnonzero(np.concatenate([[True], ~same]))
    first_of = run_start[np.cumsum(np.concatenate([[True], ~same])) - 1]
    members = np.flatnonzero(np.concatenate([[False], same]))
    ids = idx[order]
    return [np.stack([ids[first_of[members]], ids[members]], axis=1),
            np.stack([ids[members - 1], ids[members]], axis=1)]


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

    def find_many(self, x: np.ndarray) -> np.ndarray:
        """Roots of the elements ``x`` (vectorised), pointing them straight at their roots."""
        parent = self.parent
        r = parent[x]
        while True:
            nxt = parent[r]
            if np.array_equal(nxt, r):
                break
            r = nxt
        parent[x] = r
        return r

    def union_pairs(self, a: np.ndarray, b: np.ndarray) -> None:
        """Merge the sets of every pair (a[i], b[i]), vectorised; same sets as ``union`` calls.

        Each round points the larger root of every still-separate pair at the smallest root it
        is paired with; roots only decrease, so the rounds end (few for real duplicate graphs).
        """
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        while len(a):
            ra, rb = self.find_many(a), self.find_many(b)
            apart = ra != rb
            if not apart.any():
                return
            a, b, ra, rb = a[apart], b[apart], ra[apart], rb[apart]
            np.minimum.at(self.parent, np.maximum(ra, rb), np.minimum(ra, rb))

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


# --- Bounded-memory fuzzy dedup -------------------------------------------------------------
#
# The in-memory path holds an ``[n, num_perm]`` uint32 matrix (512 bytes per document at the
# default 128 permutations). The bounded path writes signatures to an Arrow IPC file as they are
# computed (a record batch per chunk, one uint32 column per permutation, so that one LSH band is
# a few contiguous columns), then processes LSH band by band from a memory map: the band's key
# per document, buckets by a stable sort, candidate pairs, verification by reading just the
# pairs' signature rows. Peak memory is a few ``n``-long integer arrays, one band and the
# candidate pairs; the clusters are exactly those of :func:`fuzzy_dedup`.

SPILL_SUFFIX = ".minhash.arrow"


def _spill_schema(num_perm: int) -> pa.Schema:
    return pa.schema([pa.field(f"p{j}", pa.uint32()) for j in range(num_perm)]
                     + [pa.field("has_shingles", pa.bool_())])


class SignatureSpill:
    """Writes MinHash signatures to an Arrow IPC file, one record batch per :meth:`append`.

    Use as a context manager, or call :meth:`close`, which returns the reader.
    """

    def __init__(self, path: str | Path, num_perm: int) -> None:
        self.path = Path(path)
        self.num_perm = num_perm
        self.num_docs = 0
        self._schema = _spill_schema(num_perm)
        self._sink = pa.OSFile(str(self.path), "wb")
        self._writer = pa.ipc.new_file(self._sink, self._schema)
        self._closed = False

    def append(self, sig: np.ndarray, has: np.ndarray) -> None:
        """Write the ``[m, num_perm]`` signatures and shingle mask of the next m documents."""
        if sig.ndim != 2 or sig.shape[1] != self.num_perm or len(has) != len(sig):
            raise ValueError(f"expected [m, {self.num_perm}] signatures and m flags, got "
                             f"{sig.shape} and {len(has)}")
        cols = np.ascontiguousarray(np.asarray(sig, dtype=np.uint32).T)  # one chunk: bounded
        arrays = [pa.array(c) for c in cols] + [pa.array(np.asarray(has, dtype=bool))]
        self._writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self._schema))
        self.num_docs += len(sig)

    def close(self) -> SpilledSignatures:
        """Finish the file and open it for reading."""
        if not self._closed:
            self._writer.close()
            self._sink.close()
            self._closed = True
        return SpilledSignatures(self.path)

    def __enter__(self) -> SignatureSpill:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._closed:
            self._writer.close()
            self._sink.close()
            self._closed = True


class SpilledSignatures:
    """Read side of a :class:`SignatureSpill` file, memory-mapped per operation.

    The map is opened for each band / verification step and closed after it, so that pages
    read for one band do not stay mapped (and counted as resident) for the next.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self._batches() as batches:
            if not batches:
                self.num_perm = 0
                self.has = np.zeros(0, dtype=bool)
                self.starts = np.zeros(1, dtype=np.int64)
                return
            self.num_perm = batches[0].num_columns - 1
            self.has = np.concatenate([b.column(self.num_perm).to_numpy(zero_copy_only=False)
                                       for b in batches])
            sizes = [b.num_rows for b in batches]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    @property
    def num_docs(self) -> int:
        return int(self.starts[-1])

    @contextmanager
    def _batches(self) -> Iterator[list[pa.RecordBatch]]:
        source = pa.memory_map(str(self.path), "r")
        try:
            reader = pa.ipc.open_file(source)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            yield batches
            del batches, reader
        finally:
            source.close()

    def band_keys(self, lo: int, hi: int) -> np.ndarray:
        """LSH key of the band of permutations ``lo:hi`` for every document (n uint64)."""
        keys = np.empty(self.num_docs, dtype=np.uint64)
        with self._batches() as batches:
            for b, batch in enumerate(batches):
                cols = (batch.column(j).to_numpy() for j in range(lo, hi))
                keys[self.starts[b] : self.starts[b + 1]] = _band_key(cols)
        return keys

    def _equal_counts_group(self, lo: int, hi: int, picks: list, counts: np.ndarray) -> None:
        vu = np.empty(len(counts), dtype=np.uint32)
        vv = np.empty(len(counts), dtype=np.uint32)
        with self._batches() as batches:
            for j in range(lo, hi):
                for b, batch in enumerate(batches):
                    pu, pv = picks[0][b], picks[1][b]
                    if not len(pu[0]) and not len(pv[0]):
                        continue
                    col = batch.column(j).to_numpy()
                    vu[pu[0]] = col[pu[1]]
                    vv[pv[0]] = col[pv[1]]
                counts += vu == vv

    def equal_counts(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Number of equal MinHash values of documents u[i] and v[i] (reads only their rows)."""
        u = np.asarray(u, dtype=np.int64)
        v = np.asarray(v, dtype=np.int64)
        counts = np.zeros(len(u), dtype=np.int64)
        if not len(u):
            return counts
        # Per batch: which pairs read a row there (positions) and the rows within the batch.
        picks = []
        for ends in (u, v):
            where = np.searchsorted(self.starts, ends, side="right") - 1
            order = np.argsort(where, kind="stable")
            bounds = np.searchsorted(where[order], np.arange(len(self.starts)))
            picks.append([(order[bounds[b] : bounds[b + 1]],
                           ends[order[bounds[b] : bounds[b + 1]]] - self.starts[b])
                          for b in range(len(self.starts) - 1)])
        # A fresh map per group of columns: pages read for one group are unmapped (and no
        # longer resident) before the next, so random rows never make the whole file resident.
        for lo in range(0, self.num_perm, _VERIFY_COLUMNS):
            self._equal_counts_group(lo, min(lo + _VERIFY_COLUMNS, self.num_perm), picks,
                                     counts)
        return counts


_VERIFY_COLUMNS = 8
"""Signature columns read per memory map during verification."""


def fuzzy_dedup_bounded(
    store: SpilledSignatures, bands: int, threshold: float, docs: np.ndarray | None = None,
    pair_chunk: int = 1 << 18,
) -> FuzzyResult:
    """:func:`fuzzy_dedup` over spilled signatures, band by band, in bounded memory.

    ``docs`` (ascending document ids of the store, default all) selects the documents to
    cluster, as ``fuzzy_dedup(sig[docs], valid[docs], ...)`` would: the result is indexed by
    position in ``docs`` and equals that call's (keep, cluster and both pair counts).
    """
    num_perm = store.num_perm
    if num_perm % bands:
        raise ValueError(f"num_perm ({num_perm}) must be a multiple of bands ({bands})")
    rows = num_perm // bands
    ids = np.arange(store.num_docs, dtype=np.int64) if docs is None else np.asarray(
        docs, dtype=np.int64)
    n = len(ids)
    idx = np.flatnonzero(store.has[ids])
    uf = UnionFind(n)
    seen = np.zeros(0, dtype=np.int64)  # candidate pairs so far, as sorted keys a * n + b
    duplicates = 0
    for band in range(bands):
        key = store.band_keys(band * rows, (band + 1) * rows)[ids[idx]]
        parts = _bucket_pairs(key, idx)
        del key
        if not parts:
            continue
        pairs = np.sort(np.concatenate(parts).astype(np.int64), axis=1)
        del parts
        pairs = pairs[pairs[:, 0] != pairs[:, 1]]
        codes = np.unique(pairs[:, 0] * n + pairs[:, 1])
        del pairs
        if len(seen):
            pos = np.minimum(np.searchsorted(seen, codes), len(seen) - 1)
            codes = codes[seen[pos] != codes]
        if not len(codes):
            continue
        for lo in range(0, len(codes), pair_chunk):
            part = codes[lo : lo + pair_chunk]
            a, b = part // n, part % n
            same = store.equal_counts(ids[a], ids[b]) / num_perm >= threshold
            duplicates += int(same.sum())
            uf.union_pairs(a[same], b[same])
        seen = np.concatenate([seen, codes])
        seen.sort(kind="stable")
    cluster = uf.roots()
    keep = cluster == np.arange(n)
    return FuzzyResult(keep, cluster, len(seen), duplicates)
