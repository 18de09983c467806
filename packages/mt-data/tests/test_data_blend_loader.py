"""Blending by weight, and the DP loader's exact resume across data-parallel sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mt_data.blend import BlendedDataset, blend_schedule, build_blended, parse_blend
from mt_data.corpus import iter_corpus
from mt_data.errors import DatasetError
from mt_data.gpt_dataset import GPTDataset
from mt_data.loader import BatchSchedule, DataLoaderState, DPDataLoader
from mt_data.shards import ShardSetWriter
from mt_data.tokenizer import load_tokenizer

SEQ = 64


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three prepared datasets: Moby-Dick chapters, SOTU addresses, and a tenth of Moby-Dick."""
    tok = load_tokenizer("tokenizer-1k")
    docs = list(iter_corpus())
    groups = {"moby": docs[:135], "sotu": docs[135:], "moby-tenth": docs[:13]}
    root = tmp_path_factory.mktemp("blend")
    paths = {}
    for name, group in groups.items():
        batch = tok.encode_batch([d["text"] for d in group])
        writer = ShardSetWriter(root / name, tok.describe(), tok.dtype.name)
        writer.add("shard-0.arrow", batch.tokens, batch.lengths, [d["id"] for d in group],
                   [d["source"] for d in group])
        writer.finish()
        paths[name] = root / name
    return paths


def test_parse_blend() -> None:
    assert parse_blend("0.3 /a 0.7 /b") == [(0.3, "/a"), (0.7, "/b")]
    assert parse_blend([2, "/a", 6, "/b"]) == [(0.25, "/a"), (0.75, "/b")]
    assert parse_blend([(1, "/a"), (3, "/b")]) == [(0.25, "/a"), (0.75, "/b")]
    assert parse_blend("/only") == [(1.0, "/only")]
    with pytest.raises(ValueError, match="pairs"):
        parse_blend("0.3 /a 0.7")


def test_schedule_prefix_proportions() -> None:
    weights = np.array([0.05, 0.1, 0.35, 0.5])
    owner, local = blend_schedule(weights, 20_000)
    counts = np.zeros(4)
    for n, k in enumerate(owner, start=1):  # every prefix is within one sample of its share
        counts[k] += 1
        if n % 97 == 0:
            assert np.abs(counts - n * weights).max() <= 1.0
    for k in range(4):  # each dataset's samples are drawn in order 0, 1, 2, ...
        assert local[owner == k].tolist() == list(range(int((owner == k).sum())))


def test_blend_proportions_within_one_percent(sources: dict[str, Path]) -> None:
    blend = [0.5, str(sources["moby"]), 0.3, str(sources["sotu"]), 0.2,
             str(sources["moby-tenth"])]
    ds = build_blended(blend, SEQ, num_samples=10_000, seed=11)
    assert isinstance(ds, BlendedDataset) and len(ds) == 10_000
    shares = np.bincount(ds.dataset_index, minlength=3) / 10_000
    np.testing.assert_allclose(shares, [0.5, 0.3, 0.2], atol=0.01)
    # The small source ran out and was reused: its epochs are counted.
    assert ds.datasets[2].epochs >= 2 and ds.datasets[0].epochs == 1
    # A blended sample is the source dataset's sample.
    for i in (0, 1, 2, 5000, 9999):
        k, j = ds.source(i), int(ds.sample_index[i])
        np.testing.assert_array_equal(ds[i], ds.datasets[k][j])
        assert ds[i].shape == (SEQ + 1,)
    # The MT-NLG-like 15-source form (weights on repeated paths) works too.
    fifteen = [x for i in range(15) for x in (1 + i % 4, str(sources["moby"]))]
    big = build_blended(fifteen, SEQ, num_samples=3_000, seed=1)
    assert len(big) == 3_000 and len(big.datasets) == 15


def _global(loader_cls_args: dict, dp: int, step: int) -> np.ndarray:
    """Reassemble a global batch from every rank's micro-batches (Megatron's order)."""
    per_rank = [DPDataLoader(**loader_cls_args, dp_rank=r, dp_size=dp).global_batch(step)
                for r in range(dp)]
    micro = len(per_rank[0])
    return np.concatenate([per_rank[r][m] for m in range(micro) for r in range(dp)])


def test_a_blend_of_two_tokenizers_is_refused(sources: dict[str, Path], tmp_path: Path) -> None:
    """Ids of two tokenizers mean different text: such a blend is refused, naming both."""
    gpt2 = load_tokenizer("gpt2")
    group = list(iter_corpus())[:20]
    batch = gpt2.encode_batch([d["text"] for d in group])
    writer = ShardSetWriter(tmp_path / "gpt2-moby", gpt2.describe(), gpt2.dtype.name)
    writer.add("shard-0.arrow", batch.tokens, batch.lengths, [d["id"] for d in group],
               [d["source"] for d in group])
    writer.finish()
    with pytest.raises(DatasetError) as err:
        build_blended([0.5, str(sources["moby"]), 0.5, str(tmp_path / "gpt2-moby")], SEQ, 100)
    assert str(err.value).startswith(
        f"blend: {tmp_path / 'gpt2-moby'} was prepared with tokenizer 'gpt2' and "
        f"{sources['moby']} with 'tokenizer-1k' (sha256 ")
    assert str(err.value).endswith(": blend datasets of one tokenizer")
    assert len(build_blended([0.5, str(sources["moby"]), 0.5, str(sources["sotu"])], SEQ,
                             100)) == 100


def test_global_batch_same_for_every_dp_size(sources: dict[str, Path]) -> None:
    ds = GPTDataset(sources["moby"], SEQ, num_samples=2_000, seed=4, cache=False)
    args = {"dataset": ds, "schedule": 32, "micro_batch_size": 2}
    for step in (0, 3, 10):
        ref = _global(args, 1, step)
        assert ref.shape == (32, SEQ + 1) and ref.dtype == np.int64
        np.testing.assert_array_equal(ref, np.stack([ds[i] for i in range(step * 32,
                                                                             step * 32 + 32)]))
        for dp in (2, 4, 8, 16):
            np.testing.assert_array_equal(_global(args, dp, step), ref)


def test_resume_at_another_dp_size(sources: dict[str, Path]) -> None:
    ds = GPTDataset(sources["sotu"], SEQ, num_samples=2_000, seed=4, cache=False)
    schedule = BatchSchedule(24, rampup=(8, 8, 64))

    def run(dp: int, steps: int, state: DataLoaderState) -> tuple[list[np.ndarray], dict]:
        loaders = [DPDataLoader(ds, schedule, 2, r, dp, state) for r in range(dp)]
        batches = []
        for _ in range(steps):
            per_rank = [loader.next() for loader in loaders]
            batches.append(np.concatenate([per_rank[r][m] for m in range(len(per_rank[0]))
                                           for r in range(dp)]))
        return batches, loaders[0].state.to_dict()

    uninterrupted, _ = run(2, 10, DataLoaderState())
    first, saved = run(2, 4, DataLoaderState())
    # Ramp-up: +8 every 32 samples, from 8 to 24.
    assert saved == {"consumed_samples": 4 * 8, "step": 4}
    resumed, final = run(4, 6, DataLoaderState.from_dict(saved))
    for a, b in zip(first + resumed, uninterrupted, strict=True):
        np.testing.assert_array_equal(a, b)
    assert [len(b) for b in uninterrupted] == [8, 8, 8, 8, 16, 16, 24, 24, 24, 24]
    assert final["consumed_samples"] == schedule.consumed_at(10) == 160
    # Counting on from any point of the ramp (a resumed run) gives the same sums.
    for step in range(11):
        consumed = schedule.consumed_at(step)
        assert schedule.consumed_after(consumed, 10 - step) == 160
        assert schedule.steps_to(consumed, 160) == (10 - step, 160)
    assert schedule.steps_to(40, 150) == (6, 168)  # off the ramp's grid: 16, 16, 24 x 4
    assert BatchSchedule(16).consumed_after(40, 3) == 88
    # global_batch(step) agrees with the streamed batches.
    loader = DPDataLoader(ds, schedule, 2, 1, 2)
    mine = loader.global_batch(5)  # 16 samples = 4 micro-steps of 2 ranks x 2 samples
    assert len(mine) == 4
    np.testing.assert_array_equal(np.concatenate(mine),
                                  np.concatenate([uninterrupted[5][4 * m + 2 : 4 * m + 4]
                                                  for m in range(4)]))


def test_loader_validation(sources: dict[str, Path]) -> None:
    ds = GPTDataset(sources["sotu"], SEQ, num_samples=100, cache=False)
    with pytest.raises(ValueError, match=r"global batch 30 is not divisible by micro_batch_size "
                                         r"2 x dp_size 4 = 8"):
        DPDataLoader(ds, 30, 2, 0, 4).next()
    with pytest.raises(ValueError, match=r"dp_rank \(4\) < dp_size \(4\)"):
        DPDataLoader(ds, 32, 2, 4, 4)
    with pytest.raises(IndexError, match="runs past"):
        DPDataLoader(ds, 64, 2, 0, 4).global_batch(1)
    with pytest.raises(ValueError, match="whole increments"):
        BatchSchedule(1920, rampup=(32, 50, 1000))
