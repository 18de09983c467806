"""The per-chunk and global steps of ``prepare``, kept free of orchestration and display.

Stage 1 (``clean_item``, run in worker processes): read one work item, normalise, count group
words (``ChunkStats.groups``), filter, decontaminate, hash and MinHash each chunk, and write it
as ``work/clean-IIIII-CCCCC.arrow`` with a ``.json`` sidecar (its stats and bad-input reports).
Stage 2 (``global_dedup``): exact and fuzzy dedup over all chunks at once. Stage 3 is
tokenization (in ``pipeline``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from mt_data.decontam import DecontamConfig, NgramIndex, decontaminate_batch
from mt_data.dedup import (
    SPILL_SUFFIX,
    DedupConfig,
    MinHasher,
    SignatureSpill,
    SpilledSignatures,
    content_hashes,
    first_occurrences,
    fuzzy_dedup,
    fuzzy_dedup_bounded,
)
from mt_data.dedup_tasks import fuzzy_dedup_tasks
from mt_data.filters import FilterConfig, normalize_batch
from mt_data.groups import GroupCounter, GroupWords, merge_counts
from mt_data.ingest import ErrorLog, IngestConfig, WorkItem, iter_documents, read_work_item
from mt_data.quality import SAMPLES_PER_RULE, MtBasic, RuleSet, apply_rule_sets
from mt_data.shards import atomic_replace, atomic_write_bytes, atomic_write_json


@dataclass(frozen=True)
class CleanConfig:
    """Everything stage 1 needs (picklable: sent to worker processes)."""

    ingest: IngestConfig = IngestConfig()
    filters: FilterConfig = FilterConfig()
    """Unicode normalisation (always applied first) and the thresholds of ``mt-basic``."""
    dedup: DedupConfig = DedupConfig()
    decontam: DecontamConfig | None = None
    eval_paths: tuple[str, ...] = ()
    on_error: str = "skip"
    rule_sets: tuple[RuleSet, ...] | None = None
    """Quality rule sets applied in order (:mod:`mt_data.quality`); None: ``mt-basic`` with
    ``filters``, the filters of every earlier release."""

    def quality(self) -> tuple[RuleSet, ...]:
        """The rule sets this config applies."""
        return self.rule_sets if self.rule_sets is not None else (MtBasic(self.filters),)


MAX_SAMPLES = 100
"""Bad-input examples kept per chunk and per run (every bad input is still counted)."""


@dataclass
class ChunkStats:
    """Counts of one chunk (also summed over a whole run)."""

    documents_in: int = 0
    bytes_in: int = 0
    documents_out: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)
    dropped_samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Up to ``SAMPLES_PER_RULE`` dropped documents per rule (id, source, chars, text)."""
    groups: dict[str, Any] | None = None
    """Group-word counts (:class:`~mt_data.groups.GroupCounter`) of the documents read, after
    normalisation and before every rule; None when not counted."""

    def add(self, other: ChunkStats) -> None:
        """Accumulate another chunk's counts (keeps at most ``MAX_SAMPLES`` error samples)."""
        self.documents_in += other.documents_in
        self.bytes_in += other.bytes_in
        self.documents_out += other.documents_out
        self.dropped.update(other.dropped)
        self.errors.update(other.errors)
        room = max(0, MAX_SAMPLES - len(self.error_samples))
        self.error_samples.extend(other.error_samples[:room])
        for rule, samples in other.dropped_samples.items():
            mine = self.dropped_samples.setdefault(rule, [])
            mine.extend(samples[:max(0, SAMPLES_PER_RULE - len(mine))])
        if other.groups is not None:
            self.groups = merge_counts([c for c in (self.groups, other.groups) if c])

    def to_json(self) -> dict[str, Any]:
        """Plain dict (for sidecars and the index); the dropped samples are stored apart."""
        data = asdict(self)
        data.pop("dropped_samples")
        data["dropped"], data["errors"] = dict(self.dropped), dict(self.errors)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChunkStats:
        """Inverse of :meth:`to_json`."""
        return cls(data["documents_in"], data["bytes_in"], data["documents_out"],
                   Counter(data["dropped"]), Counter(data["errors"]),
                   list(data["error_samples"]), groups=data.get("groups"))


EVAL_NGRAMS = "eval-ngrams.npy"


def load_eval_index(config: CleanConfig, work_dir: Path | None = None) -> NgramIndex | None:
    """N-gram index of the evaluation files (None when decontamination is off); read from
    ``work_dir/eval-ngrams.npy`` when present, so workers do not re-read the evaluation set.

    Evaluation files are read whole or not at all: any bad input in them (a truncated file, a
    malformed line) raises :class:`BadInputError`, since a partly read evaluation set would let
    its text through decontamination unnoticed."""
    if config.decontam is None or not config.eval_paths:
        return None
    cached = work_dir / EVAL_NGRAMS if work_dir is not None else None
    if cached is not None and cached.exists():
        return NgramIndex(np.load(cached), config.decontam.ngram)
    texts: list[str] = []
    for batch in iter_documents(config.eval_paths, config.ingest, ErrorLog("stop")):
        texts.extend(batch.column("text").to_pylist())
    index = NgramIndex.from_texts(texts, config.decontam.ngram)
    if cached is not None:
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp.npy")
        np.save(tmp, index.hashes)
        atomic_replace(tmp, cached)
    return index


def count_groups(texts: pa.Array | pa.ChunkedArray, lists: GroupWords) -> dict[str, Any]:
    """The group-word counts of ``texts`` (one document each)."""
    counter = GroupCounter(lists)
    for text in texts.to_pylist():
        counter.add(text)
    return counter.counts


def clean_chunk(batch: pa.RecordBatch, config: CleanConfig, hasher: MinHasher,
                eval_index: NgramIndex | None, groups: GroupWords | None = None,
                ) -> tuple[pa.RecordBatch, ChunkStats]:
    """Normalise, apply the quality rule sets, decontaminate and fingerprint one batch; with
    ``groups``, count their words in the normalised documents before any rule."""
    stats = ChunkStats(batch.num_rows, int(pa.compute.sum(
        pa.compute.binary_length(batch.column("text"))).as_py() or 0))
    batch = normalize_batch(batch, config.filters.normalize)
    if groups is not None:
        stats.groups = count_groups(batch.column("text"), groups)
    batch, dropped, stats.dropped_samples = apply_rule_sets(batch, config.quality())
    stats.dropped.update(dropped)
    if eval_index is not None and config.decontam is not None:
        batch, dstats = decontaminate_batch(batch, eval_index, config.decontam)
        stats.dropped["contaminated"] += dstats["dropped"]
        stats.dropped["contaminated_cut_pieces"] += dstats["pieces"]
    texts = batch.column("text")
    hashes = content_hashes(texts.to_pylist())
    if config.dedup.fuzzy:
        sig, has = hasher.signatures(texts)
    else:
        sig = np.zeros((batch.num_rows, config.dedup.num_perm), dtype=np.uint32)
        has = np.zeros(batch.num_rows, dtype=bool)
    num_perm = config.dedup.num_perm
    out = pa.RecordBatch.from_arrays(
        [batch.column("id"), batch.column("source"), texts,
         pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), len(hashes),
                                              [None, pa.py_buffer(hashes.tobytes())]),
         pa.FixedSizeListArray.from_arrays(pa.array(sig.ravel()), num_perm),
         pa.array(has)],
        names=["id", "source", "text", "hash", "minhash", "has_shingles"],
    )
    stats.documents_out = out.num_rows
    return out, stats


def _write_chunk(path: Path, batch: pa.RecordBatch, stats: ChunkStats) -> None:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())
    if stats.dropped_samples:
        atomic_write_json(path.with_suffix(".samples.json"), stats.dropped_samples)
    atomic_write_json(path.with_suffix(".json"), stats.to_json())  # the chunk's "done" mark


def read_chunk_stats(path: Path, totals: ChunkStats) -> ChunkStats:
    """A finished chunk's stats, with its dropped samples only when ``totals`` still lacks
    samples of a rule that dropped documents in it (most chunks' samples are never read)."""
    stats = ChunkStats.from_json(json.loads(path.with_suffix(".json").read_text()))
    wanted = [rule for rule, count in stats.dropped.items() if count
              and len(totals.dropped_samples.get(rule, ())) < SAMPLES_PER_RULE]
    samples = path.with_suffix(".samples.json")
    if wanted and samples.exists():
        stats.dropped_samples = json.loads(samples.read_text())
    return stats


def clean_item(index: int, item: WorkItem, config: CleanConfig, work: str,
               groups: GroupWords | None = None) -> dict[str, Any]:
    """Stage 1 for one work item; chunks finished by an earlier run are skipped.

    Bad inputs are counted exactly per chunk (the log keeps only examples); the result also
    carries the item's text-key tallies (``keyless`` / ``keyed``, see ``check_text_key``).
    """
    work_dir = Path(work)
    done_mark = work_dir / f"item-{index:05d}.json"
    if done_mark.exists():
        return json.loads(done_mark.read_text())
    hasher = MinHasher(config.dedup.num_perm, config.dedup.ngram, config.dedup.seed)
    eval_index = load_eval_index(config, work_dir)
    log = ErrorLog(config.on_error)
    chunks: list[str] = []
    seen, counted = 0, Counter[str]()

    def new_errors(stats: ChunkStats | None) -> None:
        nonlocal seen, counted
        fresh = log.errors[seen:]
        if stats is not None:
            stats.error_samples = [str(e) for e in fresh[:MAX_SAMPLES]]
            stats.errors = log.counts - counted
        seen, counted = len(log.errors), log.counts.copy()

    for c, batch in enumerate(read_work_item(item, config.ingest, log)):
        path = work_dir / f"clean-{index:05d}-{c:05d}.arrow"
        chunks.append(path.name)
        if path.with_suffix(".json").exists() and path.exists():
            new_errors(None)  # counted by the run that wrote the chunk
            continue
        out, stats = clean_chunk(batch, config, hasher, eval_index, groups)
        new_errors(stats)
        _write_chunk(path, out, stats)
    tail = ChunkStats()
    new_errors(tail)
    result = {"item": index, "files": list(item.files), "chunks": chunks, "tail": tail.to_json(),
              "keyless": log.keyless, "keyed": sorted(log.keyed)}
    atomic_write_json(done_mark, result)
    return result


BOUNDED_DEDUP_MIN_DOCS = 1_000_000
"""From this many documents (after exact dedup) ``global_dedup`` with a ``spill_dir`` runs the
bounded-memory fuzzy dedup (same clusters, signatures never all in memory)."""


def _spill_chunks(chunk_paths: list[Path], num_perm: int, spill_dir: Path) -> SpilledSignatures:
    """Copy the chunks' signatures into one column-per-permutation Arrow file, chunk by chunk."""
    path = spill_dir / f".dedup-{os.getpid()}{SPILL_SUFFIX}"
    try:
        with SignatureSpill(path, num_perm) as spill:
            for chunk in chunk_paths:
                source = pa.memory_map(str(chunk), "r")
                try:
                    batch = pa.ipc.open_file(source).get_batch(0)
                    sig = batch.column("minhash").values.to_numpy().reshape(-1, num_perm)
                    spill.append(sig[: batch.num_rows],
                                 batch.column("has_shingles").to_numpy(zero_copy_only=False))
                    del batch, sig
                finally:
                    source.close()
            return spill.close()
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def global_dedup(chunk_paths: list[Path], config: DedupConfig, spill_dir: Path | None = None,
                 bounded_min_docs: int | None = None, pool: Executor | None = None,
                 ) -> tuple[np.ndarray, dict[str, int]]:
    """Keep mask over all documents of all chunks (in order) and dedup counts.

    With ``spill_dir`` and at least ``bounded_min_docs`` documents left after exact dedup, fuzzy
    dedup runs band by band over signatures spilled to ``spill_dir`` (removed afterwards):
    the same keep mask and counts as in memory, without holding every signature.
    ``bounded_min_docs`` defaults to ``BOUNDED_DEDUP_MIN_DOCS``. With a ``pool`` (an executor
    over several machines) fuzzy dedup runs as tasks of a few LSH bands each on it
    (:mod:`mt_data.dedup_tasks`), the signatures read where they lie: the same result.
    """
    if bounded_min_docs is None:
        bounded_min_docs = BOUNDED_DEDUP_MIN_DOCS
    hashes, sigs, has = [], [], []
    for path in chunk_paths:
        batch = pa.ipc.open_file(pa.memory_map(str(path), "r")).get_batch(0)
        hashes.append(np.frombuffer(batch.column("hash").buffers()[1], dtype=np.uint8)
                      .reshape(-1, 16)[batch.column("hash").offset:][: batch.num_rows])
        minhash = batch.column("minhash")
        sigs.append(minhash.values.to_numpy().reshape(-1, config.num_perm)[: batch.num_rows])
        has.append(batch.column("has_shingles").to_numpy(zero_copy_only=False))
    n = sum(len(h) for h in hashes)
    stats = {"documents": n, "exact_duplicates": 0, "fuzzy_duplicates": 0,
             "fuzzy_clusters": 0, "candidate_pairs": 0}
    keep = np.ones(n, dtype=bool)
    if n == 0:
        return keep, stats
    if config.exact:
        keep = first_occurrences(np.concatenate(hashes))
        stats["exact_duplicates"] = int(n - keep.sum())
    if config.fuzzy:
        alive = np.flatnonzero(keep)
        if pool is not None:
            del sigs, has
            result = fuzzy_dedup_tasks([str(p) for p in chunk_paths], config.num_perm, alive,
                                       config.bands, config.threshold, pool,
                                       getattr(pool, "_max_workers", 1))
        elif spill_dir is not None and len(alive) >= bounded_min_docs:
            # Drop every view of the mapped chunks, so that the chunks' pages read while
            # spilling are unmapped chunk by chunk instead of staying resident.
            del sigs, has, hashes, batch, minhash
            store = _spill_chunks(chunk_paths, config.num_perm, Path(spill_dir))
            try:
                result = fuzzy_dedup_bounded(store, config.bands, config.threshold, alive)
            finally:
                store.path.unlink(missing_ok=True)
        else:
            result = fuzzy_dedup(np.concatenate(sigs)[alive], np.concatenate(has)[alive],
                                 config.bands, config.threshold)
        keep[alive[~result.keep]] = False
        stats["fuzzy_duplicates"] = result.removed
        stats["fuzzy_clusters"] = result.clusters
        stats["candidate_pairs"] = result.candidate_pairs
    return keep, stats
