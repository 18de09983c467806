"""GPT training samples: documents packed into sequences of ``seq_len + 1`` tokens.

Documents already end with EOD (appended at tokenization), so concatenating them puts EOD
between documents. Index construction follows Megatron's GPTDataset but is vectorised numpy
(no C++ helper): per epoch a seeded permutation of the split's documents (``doc_idx``), sample
boundaries found with ``searchsorted`` on cumulative lengths, and the samples of each whole
epoch shuffled among themselves, so the epoch of the i-th sample never decreases and the
sample sequence is a function of (data, seq_len, seed, split) alone: a run of 5 steps sees the
first samples of a run of 10. (Megatron shuffles only as many samples as the run consumes, so
its order changes with the run's length.) The index arrays are cached in ``<data>/cache/``
keyed by everything they depend on.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mt_data.shards import TokenDataset, atomic_replace

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class SplitSpec:
    """Relative sizes of the train / valid / test splits (by document) and their seed."""

    train: float = 969.0
    valid: float = 30.0
    test: float = 1.0
    seed: int = 1234

    def __post_init__(self) -> None:
        if min(self.train, self.valid, self.test) < 0 or self.train + self.valid + self.test <= 0:
            raise ValueError(
                f"split weights must be >= 0 with a positive sum, got train={self.train}, "
                f"valid={self.valid}, test={self.test}"
            )

    @classmethod
    def parse(cls, text: str, seed: int = 1234) -> SplitSpec:
        """Parse Megatron's ``"969,30,1"`` form."""
        parts = [float(p) for p in text.replace("/", ",").split(",") if p.strip()]
        if len(parts) != 3:
            raise ValueError(f"split {text!r} must have 3 comma-separated weights")
        return cls(*parts, seed=seed)


DEFAULT_SPLIT = SplitSpec()


def split_documents(num_docs: int, spec: SplitSpec) -> dict[str, np.ndarray]:
    """Sorted document indices of each split: contiguous ranges of a seeded permutation."""
    weights = np.array([spec.train, spec.valid, spec.test], dtype=np.float64)
    bounds = np.round(np.cumsum(weights / weights.sum()) * num_docs).astype(np.int64)
    bounds[-1] = num_docs
    perm = np.random.default_rng([spec.seed, 0x5EED]).permutation(num_docs)
    lo = np.concatenate([[0], bounds[:-1]])
    return {name: np.sort(perm[a:b]) for name, a, b in zip(SPLITS, lo, bounds, strict=True)}


@dataclass(frozen=True)
class SampleIndex:
    """The three Megatron index arrays plus the sample order, over whole epochs."""

    doc_idx: np.ndarray
    """Document order over all epochs (dataset-wide document numbers)."""
    sample_doc: np.ndarray
    """For boundary k (k = 0..samples of the indexed epochs): position in ``doc_idx`` where
    sample k starts."""
    sample_offset: np.ndarray
    """Token offset inside that document."""
    shuffle: np.ndarray
    """Sample order: the i-th sample served is sample ``shuffle[i]`` (whole epochs)."""
    epochs: int
    """Epochs whose samples are indexed (and shuffled)."""


def epoch_starts(tokens_per_epoch: int, seq_len: int, epochs: int) -> np.ndarray:
    """First sample of each epoch 0..epochs: sample k belongs to the epoch that holds its
    first token, so epoch e starts at sample ceil(e * T / seq_len)."""
    e = np.arange(epochs + 1, dtype=np.int64)
    return -(-(e * tokens_per_epoch) // seq_len)


def epochs_for(tokens_per_epoch: int, seq_len: int, num_samples: int) -> int:
    """Whole epochs needed to serve ``num_samples`` samples (at least one)."""
    epochs = 1
    while epoch_starts(tokens_per_epoch, seq_len, epochs)[-1] < num_samples:
        epochs = max(epochs + 1, num_samples * seq_len // tokens_per_epoch)
    return epochs


def build_sample_index(
    doc_lengths: np.ndarray, docs: np.ndarray, seq_len: int, num_samples: int, seed: int
) -> SampleIndex:
    """Vectorised sample index over ``docs`` (indices into ``doc_lengths``).

    The packed stream is epoch after epoch of documents, each epoch in its own seeded
    order; sample k is tokens ``[k * seq_len, (k + 1) * seq_len + 1)`` of that stream. The
    samples of each epoch are shuffled among themselves with a seed of their own, and whole
    epochs are indexed, so the order depends only on (data, seq_len, seed, split):
    ``num_samples`` only decides how many epochs exist, and any run sees the same first k
    samples whatever its length.
    """
    tokens_per_epoch = int(doc_lengths[docs].sum())
    if tokens_per_epoch <= seq_len:
        raise ValueError(
            f"split has {tokens_per_epoch} tokens in {len(docs)} documents: fewer than one "
            f"sample of seq_len + 1 = {seq_len + 1}"
        )
    epochs = epochs_for(tokens_per_epoch, seq_len, num_samples)
    starts = epoch_starts(tokens_per_epoch, seq_len, epochs)
    total = int(starts[-1])
    dtype = np.int32 if len(doc_lengths) < 2**31 else np.int64
    # One more epoch of documents: the last sample of the last epoch reads past its end.
    doc_idx = np.concatenate(
        [np.random.default_rng([seed, e]).permutation(docs).astype(dtype)
         for e in range(epochs + 1)]
    )
    ends = np.cumsum(doc_lengths[doc_idx], dtype=np.int64)
    bounds = np.arange(total + 1, dtype=np.int64) * seq_len
    sample_doc = np.searchsorted(ends, bounds, side="right")
    sample_offset = bounds - (ends[sample_doc] - doc_lengths[doc_idx[sample_doc]])
    shuffle = np.concatenate(
        [starts[e] + np.random.default_rng([seed, 0xC0FFEE, e]).permutation(
            int(starts[e + 1] - starts[e])) for e in range(epochs)]
    )
    return SampleIndex(doc_idx, sample_doc.astype(np.int64), sample_offset.astype(np.int64),
                       shuffle.astype(np.int64), epochs)


class GPTDataset:
    """Packed GPT samples of ``seq_len + 1`` tokens from one prepared dataset's split.

    Args:
        data: a :class:`TokenDataset` or the path of a prepared folder.
        seq_len: model sequence length (a sample has ``seq_len + 1`` tokens: inputs + shift).
        num_samples: samples served (more than one epoch is fine); None = one epoch. The
            order does not depend on it: whole epochs are indexed and shuffled.
        seed: shuffle seed.
        split: ``train``, ``valid`` or ``test``.
        split_spec: split weights and seed.
        cache: cache the index in ``<data>/cache`` (or the given folder); False disables.
    """

    def __init__(self, data: TokenDataset | str | Path, seq_len: int,
                 num_samples: int | None = None, seed: int = 1234, split: str = "train",
                 split_spec: SplitSpec = DEFAULT_SPLIT, cache: bool | str | Path = True) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.data = data if isinstance(data, TokenDataset) else TokenDataset(data)
        self.seq_len = seq_len
        self.seed = seed
        self.split = split
        self.docs = split_documents(len(self.data), split_spec)[split]
        tokens = int(self.data.doc_lengths[self.docs].sum())
        if num_samples is None and tokens > seq_len:
            num_samples = int(epoch_starts(tokens, seq_len, 1)[-1])
        if num_samples is None or num_samples < 1 or tokens <= seq_len:
            raise ValueError(
                f"{split} split of {self.data.path} has {len(self.docs)} documents and {tokens} "
                f"tokens: no sample of {seq_len + 1} tokens (num_samples={num_samples})"
            )
        self.num_samples = num_samples
        # Keyed by the epochs indexed, not the run's length: runs of any length share it.
        key = {"shards": [s["sha256"] for s in self.data.index["shards"]], "seq_len": seq_len,
               "epochs": epochs_for(tokens, seq_len, num_samples), "seed": seed,
               "split": split, "split_spec": [split_spec.train, split_spec.valid,
                                              split_spec.test, split_spec.seed], "version": 2}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        folder = None
        if cache is not False:
            folder = self.data.path / "cache" if cache is True else Path(cache)
        self.index = self._load_or_build(folder, f"gpt-{split}-{digest}.npz")

    def _load_or_build(self, folder: Path | None, name: str) -> SampleIndex:
        if folder is not None and (folder / name).exists():
            try:
                with np.load(folder / name) as z:
                    return SampleIndex(z["doc_idx"], z["sample_doc"], z["sample_offset"],
                                       z["shuffle"], int(z["epochs"]))
            except (OSError, ValueError, KeyError, zipfile.BadZipFile):
                pass  # an unreadable cache file (e.g. cut by a crash) is rebuilt below
        index = build_sample_index(self.data.doc_lengths, self.docs, self.seq_len,
                                   self.num_samples, self.seed)
        if folder is not None:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                # A per-process temporary name: every DP rank may build the same index at once.
                tmp = folder / f".{name}.{os.getpid()}.tmp.npz"
                np.savez(tmp, doc_idx=index.doc_idx, sample_doc=index.sample_doc,
                         sample_offset=index.sample_offset, shuffle=index.shuffle,
                         epochs=np.int64(index.epochs))
                atomic_replace(tmp, folder / name)
            except OSError:
                pass  # read-only data: the index is rebuilt next time, which is only slower
        return index

    def __len__(self) -> int:
        return self.num_samples

    @property
    def max_token_id(self) -> int:
        """Largest token id of the underlying dataset (all splits; see
        :attr:`TokenDataset.max_token_id`)."""
        return self.data.max_token_id

    @property
    def epochs(self) -> int:
        """Epochs indexed: the passes over the split that ``num_samples`` samples reach."""
        return self.index.epochs

    def epoch(self, i: int) -> int:
        """Epoch (0-based) of the i-th sample served."""
        k = int(self.index.shuffle[i])
        return int(self.index.sample_doc[k]) // len(self.docs)

    def __getitem__(self, i: int) -> np.ndarray:
        """The i-th sample: ``seq_len + 1`` token ids (data dtype)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        k = int(self.index.shuffle[i])
        first, last = int(self.index.sample_doc[k]), int(self.index.sample_doc[k + 1])
        start, stop = int(self.index.sample_offset[k]), int(self.index.sample_offset[k + 1]) + 1
        doc_idx, data = self.index.doc_idx, self.data
        if first == last:
            return data.tokens(int(doc_idx[first]), start, stop - start).copy()
        parts = [data.tokens(int(doc_idx[first]), start,
                             int(data.doc_lengths[doc_idx[first]]) - start)]
        parts.extend(data.document(int(d)) for d in doc_idx[first + 1 : last])
        parts.append(data.tokens(int(doc_idx[last]), 0, stop))
        return np.concatenate(parts)
