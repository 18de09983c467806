"""Bounded-memory fuzzy dedup (signatures spilled to Arrow, LSH band by band) equals the
in-memory path on a few thousand synthetic documents with planted near-duplicates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from mt_data.dedup import (
    DedupConfig,
    MinHasher,
    SignatureSpill,
    UnionFind,
    fuzzy_dedup,
    fuzzy_dedup_bounded,
)
from mt_data.stages import global_dedup


def synthetic_corpus(n: int, seed: int = 0) -> tuple[list[str], list[tuple[int, int]]]:
    """n random documents over a 5,000-word vocabulary; about a fifth are edited copies (1 to 6
    words replaced) of an earlier document, some copies of copies, some exact copies."""
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}x" for i in range(5000)]
    docs: list[list[int]] = []
    planted = []
    for i in range(n):
        if i > 10 and rng.random() < 0.2:
            src = int(rng.integers(0, i))
            words = list(docs[src])
            for _ in range(int(rng.integers(0, 7))):
                words[int(rng.integers(0, len(words)))] = int(rng.integers(0, 5000))
            planted.append((src, i))
        else:
            words = [int(w) for w in rng.integers(0, 5000, size=int(rng.integers(3, 120)))]
        docs.append(words)
    texts = [" ".join(vocab[w] for w in d) for d in docs]
    texts[5] = ""  # no shingles
    texts[6] = "one two"  # shorter than a shingle
    return texts, planted


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[tuple[int, int]]]:
    return synthetic_corpus(3000)


def spill(tmp_path: Path, texts: list[str], config: DedupConfig, chunk: int):
    hasher = MinHasher(config.num_perm, config.ngram, config.seed)
    sigs, has = [], []
    with SignatureSpill(tmp_path / "sig.arrow", config.num_perm) as out:
        for lo in range(0, len(texts), chunk):
            s, h = hasher.signatures(texts[lo : lo + chunk])
            out.append(s, h)
            sigs.append(s)
            has.append(h)
        store = out.close()
    return store, np.concatenate(sigs), np.concatenate(has)


@pytest.mark.parametrize("config", [DedupConfig(), DedupConfig(num_perm=64, bands=8,
                                                               threshold=0.6, ngram=3, seed=7)])
def test_bounded_equals_in_memory(tmp_path: Path, corpus, config: DedupConfig) -> None:
    texts, planted = corpus
    store, sig, has = spill(tmp_path, texts, config, chunk=700)  # chunks of unequal size
    assert store.num_docs == len(texts)
    assert np.array_equal(store.has, has)
    ref = fuzzy_dedup(sig, has, config.bands, config.threshold)
    got = fuzzy_dedup_bounded(store, config.bands, config.threshold, pair_chunk=97)
    assert ref.removed > 100  # the planted duplicates are found at all
    np.testing.assert_array_equal(got.keep, ref.keep)
    np.testing.assert_array_equal(got.cluster, ref.cluster)
    assert got.candidate_pairs == ref.candidate_pairs
    assert got.duplicate_pairs == ref.duplicate_pairs
    # A subset of documents (as after exact dedup): same as fuzzy_dedup on the sliced matrix.
    docs = np.flatnonzero(np.random.default_rng(1).random(len(texts)) < 0.7)
    ref = fuzzy_dedup(sig[docs], has[docs], config.bands, config.threshold)
    got = fuzzy_dedup_bounded(store, config.bands, config.threshold, docs=docs)
    np.testing.assert_array_equal(got.keep, ref.keep)
    np.testing.assert_array_equal(got.cluster, ref.cluster)
    assert (got.candidate_pairs, got.duplicate_pairs) == (ref.candidate_pairs,
                                                          ref.duplicate_pairs)


def test_spill_rows_and_bands(tmp_path: Path, corpus) -> None:
    config = DedupConfig()
    store, sig, _ = spill(tmp_path, corpus[0][:500], config, chunk=128)
    u = np.array([0, 499, 127, 128, 300])
    v = np.array([1, 0, 128, 128, 42])
    np.testing.assert_array_equal(store.equal_counts(u, v), (sig[u] == sig[v]).sum(axis=1))
    keys = store.band_keys(8, 16)
    assert len(keys) == 500 and keys.dtype == np.uint64
    same = keys[:, None] == keys[None, :]
    np.testing.assert_array_equal(same, (sig[:, None, 8:16] == sig[None, :, 8:16]).all(-1))


def test_union_pairs_matches_union() -> None:
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 2000, size=(2, 1500))
    one, many = UnionFind(2000), UnionFind(2000)
    for x, y in zip(a, b, strict=True):
        one.union(int(x), int(y))
    many.union_pairs(a[:700], b[:700])
    many.union_pairs(a[700:], b[700:])
    np.testing.assert_array_equal(one.roots(), many.roots())


def test_empty_and_no_candidates(tmp_path: Path) -> None:
    with SignatureSpill(tmp_path / "e.arrow", 16) as out:
        store = out.close()
    result = fuzzy_dedup_bounded(store, 4, 0.8)
    assert len(result.keep) == 0 and result.candidate_pairs == 0
    texts = ["alpha beta gamma delta epsilon zeta", "one two three four five six seven"]
    store, sig, has = spill(tmp_path, texts, DedupConfig(num_perm=16, bands=4), chunk=1)
    result = fuzzy_dedup_bounded(store, 4, 0.8)
    assert result.keep.all() and result.candidate_pairs == 0


def write_chunks(tmp_path: Path, texts: list[str], config: DedupConfig) -> list[Path]:
    """Chunk files as stage 1 writes them (hash, minhash, has_shingles columns)."""
    from mt_data.dedup import content_hashes

    hasher = MinHasher(config.num_perm, config.ngram, config.seed)
    paths = []
    for c, lo in enumerate(range(0, len(texts), 1000)):
        part = texts[lo : lo + 1000]
        sig, has = hasher.signatures(part)
        hashes = content_hashes(part)
        batch = pa.RecordBatch.from_arrays(
            [pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), len(hashes),
                                                  [None, pa.py_buffer(hashes.tobytes())]),
             pa.FixedSizeListArray.from_arrays(pa.array(sig.ravel()), config.num_perm),
             pa.array(has)], names=["hash", "minhash", "has_shingles"])
        path = tmp_path / f"clean-00000-{c:05d}.arrow"
        with pa.ipc.new_file(str(path), batch.schema) as writer:
            writer.write_batch(batch)
        paths.append(path)
    return paths


def test_global_dedup_bounded_equals_in_memory(tmp_path: Path, corpus) -> None:
    texts, _ = corpus
    texts = texts + texts[:50]  # exact duplicates first removed, then fuzzy on the rest
    config = DedupConfig()
    chunks = write_chunks(tmp_path, texts, config)
    keep, stats = global_dedup(chunks, config)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    keep_b, stats_b = global_dedup(chunks, config, spill_dir=spill_dir, bounded_min_docs=0)
    np.testing.assert_array_equal(keep, keep_b)
    assert stats == stats_b
    assert stats["exact_duplicates"] >= 50 and stats["fuzzy_duplicates"] > 50
    assert not list(spill_dir.iterdir())  # the spill file is removed
    # Below the document count the in-memory path runs (nothing spilled either way).
    assert global_dedup(chunks, config, spill_dir=spill_dir)[1] == stats


def test_prepare_bounded_equals_in_memory(tmp_path: Path, corpus,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare`` with the bounded path forced (threshold 0 documents) writes the same
    dataset and dedup counts as the default (in-memory at this size) run."""
    import json

    from mt_data import stages
    from mt_data.filters import FilterConfig
    from mt_data.pipeline import PrepareConfig, prepare

    texts, _ = corpus
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n"
                            for i, t in enumerate(texts[:1500] + texts[:20])))
    config = PrepareConfig(clean=stages.CleanConfig(filters=FilterConfig.disabled()),
                           tokenizer="tokenizer-1k", workers=0, keep_work=True)
    calls = []
    bounded = stages.fuzzy_dedup_bounded
    monkeypatch.setattr(stages, "fuzzy_dedup_bounded",
                        lambda *a, **k: calls.append(1) or bounded(*a, **k))
    runs = {}
    for name, threshold in (("memory", stages.BOUNDED_DEDUP_MIN_DOCS), ("bounded", 0)):
        monkeypatch.setattr(stages, "BOUNDED_DEDUP_MIN_DOCS", threshold)
        out = tmp_path / name
        summary = prepare([path], out, config)
        index = json.loads((out / "index.json").read_text())
        runs[name] = (np.load(out / "work" / "keep.npy"),
                      {k: summary[k] for k in ("exact_duplicates", "fuzzy_duplicates",
                                               "fuzzy_clusters", "candidate_pairs")},
                      [s["sha256"] for s in index["shards"]])
        assert not list((out / "work").glob(f"*{stages.SPILL_SUFFIX}"))
    np.testing.assert_array_equal(runs["memory"][0], runs["bounded"][0])
    assert runs["memory"][1:] == runs["bounded"][1:]
    assert runs["memory"][1]["fuzzy_duplicates"] > 20
    assert calls == [1]  # the bounded run, and only it, went through the bounded path
