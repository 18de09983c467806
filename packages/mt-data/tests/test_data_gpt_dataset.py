"""Packed GPT samples, splits, epochs, caching and index build time, on the embedded corpus."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mt_data.corpus import iter_corpus
from mt_data.gpt_dataset import GPTDataset, SplitSpec, build_sample_index, split_documents
from mt_data.shards import ShardSetWriter, TokenDataset
from mt_data.tokenizer import load_tokenizer

SEQ = 128


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    tok = load_tokenizer("tokenizer-1k")
    docs = list(iter_corpus())
    batch = tok.encode_batch([d["text"] for d in docs])
    out = tmp_path_factory.mktemp("corpus")
    writer = ShardSetWriter(out, tok.describe(), tok.dtype.name)
    writer.add("shard-0.arrow", batch.tokens, batch.lengths, [d["id"] for d in docs],
               [d["source"] for d in docs])
    writer.finish()
    return TokenDataset(out)


def _stream(data: TokenDataset, doc_idx: np.ndarray) -> np.ndarray:
    return np.concatenate([data.document(int(d)) for d in doc_idx])


def test_samples_are_the_packed_document_stream(data: TokenDataset, tmp_path: Path) -> None:
    ds = GPTDataset(data, SEQ, seed=3, split="train", cache=tmp_path)
    stream = _stream(data, ds.index.doc_idx)
    tokens = int(data.doc_lengths[ds.docs].sum())
    assert len(ds) == -(-tokens // SEQ)  # one epoch: every sample starting inside it
    for i in range(len(ds)):
        k = int(ds.index.shuffle[i])
        sample = ds[i]
        assert sample.shape == (SEQ + 1,)
        np.testing.assert_array_equal(sample, stream[k * SEQ : k * SEQ + SEQ + 1])
    # EOD (id 0) separates documents inside samples: as many EODs as document ends.
    eod = data.tokenizer["eod_id"]
    assert int((stream == eod).sum()) == len(ds.index.doc_idx)
    assert sorted(ds.index.shuffle.tolist()) == list(range(len(ds)))  # a permutation


def test_order_does_not_depend_on_the_run_length(data: TokenDataset) -> None:
    """The first k samples are the same whatever num_samples says (5 steps then 10 steps
    equals one 10-step run), within an epoch and across epochs."""
    one = len(GPTDataset(data, SEQ, cache=False))
    sizes = [7, one - 3, one, one + 5, int(one * 2.5)]
    runs = [GPTDataset(data, SEQ, num_samples=n, seed=11, cache=False) for n in sizes]
    longest = runs[-1]
    for ds in runs[:-1]:
        for i in range(len(ds)):
            np.testing.assert_array_equal(ds[i], longest[i], err_msg=f"sample {i} of {len(ds)}")
    # Whole epochs are shuffled: each epoch of the long run is a permutation of its samples.
    shuffle, epochs = longest.index.shuffle, np.array([longest.epoch(i) for i in range(len(
        longest))])
    for e in range(longest.epochs):
        served = shuffle[: len(epochs)][epochs == e]
        if e < longest.epochs - 1:  # the last epoch is only partly served
            assert sorted(served.tolist()) == list(range(served.min(), served.max() + 1))


def test_splits_by_document(data: TokenDataset) -> None:
    spec = SplitSpec(80, 15, 5, seed=9)
    splits = split_documents(len(data), spec)
    sizes = {k: len(v) for k, v in splits.items()}
    assert sizes == {"train": 145, "valid": 27, "test": 9}
    assert sorted(np.concatenate(list(splits.values())).tolist()) == list(range(len(data)))
    train = GPTDataset(data, SEQ, split="train", split_spec=spec, cache=False)
    valid = GPTDataset(data, SEQ, split="valid", split_spec=spec, cache=False)
    assert set(train.index.doc_idx.tolist()) == set(splits["train"].tolist())
    assert set(valid.index.doc_idx.tolist()) == set(splits["valid"].tolist())
    assert SplitSpec.parse("969,30,1") == SplitSpec(969, 30, 1)


def test_deterministic_by_seed(data: TokenDataset) -> None:
    a = GPTDataset(data, SEQ, seed=1, cache=False)
    b = GPTDataset(data, SEQ, seed=1, cache=False)
    c = GPTDataset(data, SEQ, seed=2, cache=False)
    np.testing.assert_array_equal(np.stack([a[i] for i in range(50)]),
                                  np.stack([b[i] for i in range(50)]))
    assert not np.array_equal(np.stack([a[i] for i in range(50)]),
                              np.stack([c[i] for i in range(50)]))


def test_epochs_counted(data: TokenDataset) -> None:
    one = GPTDataset(data, SEQ, cache=False)
    ds = GPTDataset(data, SEQ, num_samples=int(len(one) * 2.5), cache=False)
    assert ds.epochs == 3
    epochs = np.array([ds.epoch(i) for i in range(len(ds))])
    assert (np.diff(epochs) >= 0).all() and epochs[0] == 0 and epochs[-1] == 2
    n_docs = len(ds.docs)
    for e in range(2):  # every full epoch visits each training document exactly once
        part = ds.index.doc_idx[e * n_docs : (e + 1) * n_docs]
        assert sorted(part.tolist()) == sorted(ds.docs.tolist())
    assert not np.array_equal(ds.index.doc_idx[:n_docs], ds.index.doc_idx[n_docs : 2 * n_docs])


def test_index_cached_next_to_data(data: TokenDataset) -> None:
    first = GPTDataset(data, 64, num_samples=1000, seed=5)
    files = list((data.path / "cache").glob("gpt-train-*.npz"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    second = GPTDataset(data, 64, num_samples=1000, seed=5)
    assert files[0].stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(first.index.shuffle, second.index.shuffle)
    GPTDataset(data, 64, num_samples=1000, seed=6)  # other parameters: another cache entry
    assert len(list((data.path / "cache").glob("gpt-train-*.npz"))) == 2


def test_million_documents_index() -> None:
    """A million documents, the scale the vectorised index is for: whole epochs, the order
    a permutation of the samples. (No timing here: a test's verdict must not depend on the
    machine's speed or load.)"""
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 4000, size=1_000_000)
    index = build_sample_index(lengths, np.arange(1_000_000), 2048, 1_000_000, seed=1)
    assert index.epochs == 2 and len(index.shuffle) >= 1_000_000  # two whole epochs
    np.testing.assert_array_equal(np.sort(index.shuffle), np.arange(len(index.shuffle)))


def test_errors(data: TokenDataset) -> None:
    with pytest.raises(ValueError, match="split must be one of"):
        GPTDataset(data, SEQ, split="dev")
    with pytest.raises(ValueError, match="no sample of"):
        GPTDataset(data, 10**7, split="test", cache=False)
    with pytest.raises(IndexError, match="out of range"):
        GPTDataset(data, SEQ, num_samples=10, cache=False)[10]
