"""Fuzzy dedup as independent tasks, for an executor spread over machines (Ray).

The signatures stay where stage 1 wrote them (the chunk files, on storage every worker
reads); no process ever holds all of them. Each task takes a few LSH bands: for each, it
computes the band's bucket key of every document from the memory-mapped chunks, pairs the
members of each bucket (as :func:`mt_data.dedup.lsh_candidate_pairs` does), and verifies its
candidate pairs by reading just their two signature rows. It returns the pairs as codes
(``a * n + b``) with a verdict each: 8 bytes and a flag per candidate pair, where a signature
is 512 bytes per document. The driver merges the tasks' pairs (a pair found by several bands
counts once) and clusters the verified ones; the clusters, keep mask and counts are those of
:func:`mt_data.dedup.fuzzy_dedup` on the same documents (the root of each cluster is its
smallest member, whatever order the pairs come in). A task's memory: a few n-long integer
arrays and one band of signature columns, as the bounded local path
(:func:`mt_data.dedup.fuzzy_dedup_bounded`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np
import pyarrow as pa

from mt_data.dedup import FuzzyResult, UnionFind, _band_key, _bucket_pairs

__all__ = ["band_pairs", "fuzzy_dedup_tasks"]

#: Candidate pairs verified at a time (two signature rows each).
_PAIR_CHUNK = 1 << 16


class _Chunks:
    """The signatures of chunk files, addressed by global document index.

    Each read maps the chunk files it needs and lets them go before it returns: a band's
    columns are a few bytes of every row, so reading one touches every page of every file,
    and pages left mapped would stay in the task's resident memory (all the signatures, by
    the last band). Unmapped, they are the kernel's page cache, shared and reclaimable.
    """

    def __init__(self, paths: Sequence[str], num_perm: int) -> None:
        self.paths, self.num_perm = list(paths), num_perm
        self.has = [self._batch(path).column("has_shingles").to_numpy(zero_copy_only=False)
                    for path in self.paths]
        self.starts = np.concatenate([[0], np.cumsum([len(h) for h in self.has])]
                                     ).astype(np.int64)

    @staticmethod
    def _batch(path: str) -> pa.RecordBatch:
        return pa.ipc.open_file(pa.memory_map(path, "r")).get_batch(0)

    def _read(self, c: int, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """A copy of columns ``lo:hi`` of rows ``rows`` of chunk ``c``; the file is unmapped
        when this returns (nothing else refers to it)."""
        batch = self._batch(self.paths[c])
        sig = batch.column("minhash").values.to_numpy().reshape(-1, self.num_perm)
        return sig[rows, lo:hi]

    def rows(self, docs: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Signature columns ``lo:hi`` of documents ``docs`` (ascending or not)."""
        out = np.empty((len(docs), hi - lo), dtype=np.uint32)
        where = np.searchsorted(self.starts, docs, side="right") - 1
        order = np.argsort(where, kind="stable")  # the documents of each chunk together
        chunks, first = np.unique(where[order], return_index=True)
        for c, a, b in zip(chunks, first, [*first[1:], len(order)], strict=True):
            pick = order[a:b]
            out[pick] = self._read(int(c), docs[pick] - self.starts[c], lo, hi)
        return out

    def has_shingles(self, docs: np.ndarray) -> np.ndarray:
        return np.concatenate(self.has)[docs] if len(docs) else np.zeros(0, dtype=bool)


def band_pairs(paths: Sequence[str], num_perm: int, docs: np.ndarray, bands: Sequence[int],
               rows: int, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """One task: the candidate pairs of LSH ``bands`` (``rows`` permutations each) among
    documents ``docs`` (global indices into the chunks ``paths``, ascending), as codes
    ``a * n + b`` of positions in ``docs`` (a < b, unique), and whether each pair's estimated
    Jaccard similarity reaches ``threshold``."""
    chunks, n = _Chunks(paths, num_perm), len(docs)
    idx = np.flatnonzero(chunks.has_shingles(docs))
    found = []
    for band in bands:
        block = chunks.rows(docs[idx], band * rows, (band + 1) * rows)
        parts = _bucket_pairs(_band_key(block.T), idx)
        del block
        if parts:
            pairs = np.sort(np.concatenate(parts).astype(np.int64), axis=1)
            pairs = pairs[pairs[:, 0] != pairs[:, 1]]
            found.append(np.unique(pairs[:, 0] * n + pairs[:, 1]))
    codes = np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)
    same = np.zeros(len(codes), dtype=bool)
    for lo in range(0, len(codes), _PAIR_CHUNK):
        part = codes[lo : lo + _PAIR_CHUNK]
        u = chunks.rows(docs[part // n], 0, num_perm)
        v = chunks.rows(docs[part % n], 0, num_perm)
        same[lo : lo + len(part)] = (u == v).sum(axis=1) / num_perm >= threshold
    return codes, same


def fuzzy_dedup_tasks(paths: Sequence[str], num_perm: int, docs: np.ndarray, bands: int,
                      threshold: float, pool: Executor | None, tasks: int,
                      run: Callable[..., list[Any]] | None = None) -> FuzzyResult:
    """:func:`mt_data.dedup.fuzzy_dedup` of documents ``docs`` of the chunks ``paths``, as
    ``tasks`` :func:`band_pairs` tasks on ``pool`` (None: here, one after the other); the
    result is indexed by position in ``docs``. ``run`` runs the tasks (default
    :func:`mt_data.sharing.run_shared`)."""
    if num_perm % bands:
        raise ValueError(f"num_perm ({num_perm}) must be a multiple of bands ({bands})")
    from mt_data.sharing import run_shared

    run = run or (lambda fn, jobs: run_shared(fn, jobs, pool))
    n, rows = len(docs), num_perm // bands
    groups = [list(range(bands))[t::max(1, tasks)] for t in range(min(max(1, tasks), bands))]
    results = run(band_pairs, [(list(paths), num_perm, docs, group, rows, threshold)
                               for group in groups])
    codes = np.concatenate([c for c, _ in results]) if results else np.zeros(0, np.int64)
    same = np.concatenate([s for _, s in results]) if results else np.zeros(0, bool)
    codes, first = np.unique(codes, return_index=True)  # a pair of several bands: once
    same = same[first]
    uf = UnionFind(n)
    uf.union_pairs(codes[same] // n, codes[same] % n)
    cluster = uf.roots()
    return FuzzyResult(cluster == np.arange(n), cluster, len(codes), int(same.sum()))
