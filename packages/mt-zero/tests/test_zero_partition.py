"""Pure tests (no processes): partitioning, bucketing, parameter groups, loss scaler,
the paper's memory formulas and the norm-counting predicate."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from mt_zero import (
    LossScaler,
    LossScalerConfig,
    ZeroConfig,
    bucketize,
    counts_once,
    decay_param_groups,
    paper_bytes,
    partition,
    split_decay,
)
from mt_zero.testing import TinyLM


@pytest.mark.parametrize(
    ("numels", "world"),
    [([10, 3, 7], 4), ([1], 3), ([5, 5], 2), ([0, 4, 0, 9], 3), ([2**20 + 1, 17], 8), ([], 2)],
)
def test_partition_covers_every_element_exactly_once(numels: list[int], world: int) -> None:
    layout = partition(numels, world)
    assert layout.padded_numel % world == 0
    assert layout.padded_numel >= max(sum(numels), 1)
    assert layout.padded_numel - sum(numels) < world or sum(numels) == 0
    seen = [torch.zeros(n, dtype=torch.int32) for n in numels]
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        assert hi - lo == layout.shard_numel
        end_in_shard = 0
        for piece in layout.pieces(rank):
            assert piece.length > 0
            # Pieces are contiguous in the flat buffer and in the shard, in order.
            flat_at = layout.param_starts[piece.param_index] + piece.param_offset
            assert flat_at == lo + piece.shard_offset
            assert piece.shard_offset >= end_in_shard
            end_in_shard = piece.shard_offset + piece.length
            seen[piece.param_index][piece.param_offset : piece.param_offset + piece.length] += 1
            assert rank in layout.owners(piece.param_index)
        assert end_in_shard <= layout.shard_numel
    for s in seen:
        assert bool((s == 1).all())


def test_partition_known_layout() -> None:
    layout = partition([10, 3, 7], 4)  # 20 elements -> shards of 5
    assert layout.shard_numel == 5 and layout.param_starts == (0, 10, 13)
    assert [(p.param_index, p.param_offset, p.shard_offset, p.length)
            for p in layout.pieces(2)] == [(1, 0, 0, 3), (2, 0, 3, 2)]
    assert layout.owners(2) == (2, 3)
    with pytest.raises(ValueError, match="rank 4 outside"):
        layout.shard_range(4)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        partition([1], 0)
    with pytest.raises(ValueError, match=r"\(1, -2\)"):
        partition([1, -2], 2)


def test_bucketize_reverse_order_and_limits() -> None:
    assert bucketize([4, 4, 4, 4], 8) == [[3, 2], [1, 0]]
    assert bucketize([100, 1, 1], 10) == [[2, 1, 0]]
    assert bucketize([1, 100, 1], 10) == [[2, 1], [0]]
    # Large parameters alone: their bucket's gradient buffer can be autograd's own tensor.
    assert bucketize([100, 1, 1], 10, own_bucket_from=10) == [[2, 1], [0]]
    assert bucketize([1, 100, 1], 10, own_bucket_from=10) == [[2], [1], [0]]
    assert bucketize([1, 100, 1], 10, own_bucket_from=200) == [[2, 1], [0]]
    with pytest.raises(ValueError, match="own_bucket_from.*got 0"):
        bucketize([1], 1, own_bucket_from=0)
    numels = [3, 9, 1, 27, 4]
    for limit in (1, 5, 10, 100):
        buckets = bucketize(numels, limit)
        assert sorted(itertools.chain(*buckets)) == list(range(len(numels)))
        assert all(buckets)
    with pytest.raises(ValueError, match="got 0"):
        bucketize([1], 0)


def test_decay_groups_exclude_biases_and_norms() -> None:
    model = TinyLM(layers=1)
    model.blocks[0].fc2.bias.requires_grad_(False)
    decay, no_decay = split_decay(model.named_parameters())
    assert decay == ["embed.weight", "blocks.0.fc1.weight", "blocks.0.fc2.weight"]
    assert no_decay == ["blocks.0.ln.weight", "blocks.0.ln.bias", "blocks.0.fc1.bias",
                        "ln_f.weight", "ln_f.bias"]
    groups = decay_param_groups(model.named_parameters(), 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in groups] == [3, 5]
    with pytest.raises(ValueError, match="-1"):
        decay_param_groups(model.named_parameters(), -1)


def test_loss_scaler_backs_off_and_grows() -> None:
    scaler = LossScaler(LossScalerConfig(init_scale=1024.0, growth_interval=3, min_scale=256.0))
    assert scaler.scale == 1024.0
    scaler = scaler.update(found_inf=True)
    assert (scaler.scale, scaler.clean_steps, scaler.skipped_steps) == (512.0, 0, 1)
    for _ in range(2):
        scaler = scaler.update(found_inf=False)
    assert (scaler.scale, scaler.clean_steps) == (512.0, 2)
    scaler = scaler.update(found_inf=False)
    assert (scaler.scale, scaler.clean_steps) == (1024.0, 0)
    for _ in range(5):
        scaler = scaler.update(found_inf=True)
    assert scaler.scale == 256.0 and scaler.skipped_steps == 6  # floored at min_scale
    restored = LossScaler(scaler.config).load_state_dict(scaler.state_dict())
    assert restored == scaler
    with pytest.raises(ValueError, match="backoff_factor 1.5"):
        LossScalerConfig(backoff_factor=1.5)


def test_paper_formulas() -> None:
    psi, n = 1000, 4
    assert paper_bytes(psi, n, 0)["total"] == 16 * psi
    assert paper_bytes(psi, n, 1)["total"] == 4 * psi + 12 * psi / n
    assert paper_bytes(psi, n, 2)["total"] == 2 * psi + 14 * psi / n
    assert paper_bytes(psi, n, 3)["total"] == 16 * psi / n
    with pytest.raises(ValueError, match="stage 4"):
        paper_bytes(psi, n, 4)


def test_counts_once() -> None:
    p = nn.Parameter(torch.zeros(1))
    replicated = counts_once(1, tp_replicated=lambda n, _: n.startswith("ln"),
                             pp_duplicate=lambda n, _: n == "head")
    assert [replicated(n, p) for n in ("ln.w", "fc.w", "head")] == [False, True, False]
    first = counts_once(0, tp_replicated=lambda n, _: True)
    assert first("ln.w", p)


def test_config_validation_names_numbers() -> None:
    with pytest.raises(ValueError, match="got 4"):
        ZeroConfig(stage=4)
    with pytest.raises(ValueError, match="'fp8'"):
        ZeroConfig(precision="fp8")
    with pytest.raises(ValueError, match="-1"):
        ZeroConfig(clip_grad=-1)
