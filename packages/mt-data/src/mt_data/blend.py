"""Blending several prepared datasets by weight (MT-NLG drew from 15 weighted sources).

The schedule is deterministic stride scheduling: dataset k's j-th sample is due at "time"
``(j + 0.5) / w_k``; merging all due times in order gives the blended sequence. After any
prefix of n samples every dataset has contributed ``n * w_k`` samples to within one, and the
schedule is a vectorised merge (argsort), not a sequential loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mt_data.errors import DatasetError
from mt_data.gpt_dataset import DEFAULT_SPLIT, GPTDataset, SplitSpec


def parse_blend(spec: str | Sequence[object]) -> list[tuple[float, str]]:
    """Normalise a blend config to ``[(weight, path), ...]`` with weights summing to 1.

    Accepts Megatron's ``"0.3 /data/a 0.7 /data/b"`` string, a flat list ``[0.3, "a", 0.7,
    "b"]``, a list of ``(weight, path)`` pairs, or a single path (weight 1).
    """
    items: list[object]
    if isinstance(spec, (str, Path)):
        items = str(spec).split()
    else:
        items = list(spec)
    if len(items) == 1 and not isinstance(items[0], (tuple, list)):
        return [(1.0, str(items[0]))]
    pairs: list[tuple[float, str]] = []
    if items and all(isinstance(it, (tuple, list)) for it in items):
        pairs = [(float(w), str(p)) for w, p in items]  # type: ignore[misc]
    elif len(items) % 2 == 0:
        pairs = [(float(items[i]), str(items[i + 1])) for i in range(0, len(items), 2)]
    else:
        raise ValueError(f"blend {spec!r}: expected weight/path pairs")
    total = sum(w for w, _ in pairs)
    if not all(0 <= w < math.inf for w, _ in pairs) or not 0 < total < math.inf:

        raise ValueError(f"blend weights must be finite numbers >= 0 with a positive sum, "
                         f"got {pairs}")
    return [(w / total, p) for w, p in pairs]


def blend_schedule(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample: which dataset, and which sample of that dataset."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    times, owner, local = [], [], []
    for k, wk in enumerate(w):
        if wk <= 0:
            continue
        count = int(np.ceil(num_samples * wk)) + 1
        j = np.arange(count, dtype=np.int64)
        times.append((j + 0.5) / wk)
        owner.append(np.full(count, k, dtype=np.int16))
        local.append(j)
    t = np.concatenate(times)
    order = np.lexsort((np.concatenate(owner), t))[:num_samples]
    return np.concatenate(owner)[order], np.concatenate(local)[order]


class BlendedDataset:
    """Samples drawn from several datasets in proportion to their weights."""

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float],
                 num_samples: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = [float(x) / float(sum(weights)) for x in weights]
        self.num_samples = num_samples
        self.dataset_index, self.sample_index = blend_schedule(self.weights, num_samples)
        for k, ds in enumerate(self.datasets):
            need = int(self.sample_index[self.dataset_index == k].max(initial=-1)) + 1
            if need > len(ds):
                raise ValueError(f"dataset {k} has {len(ds)} samples but the blend needs {need}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]

    def source(self, i: int) -> int:
        """Index of the dataset sample i comes from."""
        return int(self.dataset_index[i])

    @property
    def max_token_id(self) -> int:
        """Largest token id over the blended datasets (a model needs a larger vocab_size)."""
        return max(ds.max_token_id for ds in self.datasets)


def build_blended(blend: str | Sequence[object], seq_len: int, num_samples: int,
                  seed: int = 1234, split: str = "train",
                  split_spec: SplitSpec = DEFAULT_SPLIT) -> BlendedDataset | GPTDataset:
    """GPT dataset over a blend config; each source gets exactly the samples the blend draws.

    A source that runs out is reused for further epochs (its ``epochs`` counts them).
    """
    pairs = parse_blend(blend)
    if len(pairs) == 1:
        return GPTDataset(pairs[0][1], seq_len, num_samples, seed, split, split_spec)
    weights = [w for w, _ in pairs]
    owner, local = blend_schedule(weights, num_samples)
    datasets = []
    for k, (_, path) in enumerate(pairs):
        need = max(1, int(local[owner == k].max(initial=-1)) + 1)
        # Different seeds per source so identical sources would not shuffle identically.
        datasets.append(GPTDataset(path, seq_len, need, seed + 7919 * k, split, split_spec))
    check_one_tokenizer([(str(p), ds.data.tokenizer) for (_, p), ds in zip(pairs, datasets)])
    return BlendedDataset(datasets, weights, num_samples)


def check_one_tokenizer(records: Sequence[tuple[str, dict]]) -> None:
    """The datasets of a blend (``(path, index.json's tokenizer)``) were prepared with one
    tokenizer: ids of two tokenizers mean different text, so their blend trains on noise."""
    from mt_data.tokenizer import tokenizer_differs

    first, want = records[0]
    for path, record in records[1:]:
        if why := tokenizer_differs(want, record):
            raise DatasetError(f"blend: {path} was prepared with tokenizer "
                               f"{record.get('name')!r} and {first} with "
                               f"{want.get('name')!r} ({why}): blend datasets of one tokenizer")
