"""Layer partitioning into (stage, chunk) pieces."""

from __future__ import annotations

import pytest

from mt_pipeline import (
    PartitionError,
    PipelinePlan,
    StagePlan,
    balanced_partition,
    explicit_partition,
    partition_layers,
    uniform_partition,
)


def test_uniform_mt_nlg_layout() -> None:
    plan = uniform_partition(105, 35)
    assert plan.layer_counts == (3,) * 35
    assert plan.stages[0].chunks == ((0, 3),) and plan.stages[34].chunks == ((102, 105),)
    assert plan.stages[0].has_embedding and not plan.stages[0].has_head
    assert plan.stages[34].has_head and not plan.stages[34].has_embedding
    assert not any(s.has_embedding or s.has_head for s in plan.stages[1:34])
    assert plan.locate(104) == (34, 0) and plan.locate(50) == (16, 0)


def test_uniform_raises_naming_numbers() -> None:
    with pytest.raises(PartitionError, match=r"num_layers \(10\).*num_stages \(4\)"):
        uniform_partition(10, 4)
    with pytest.raises(PartitionError, match=r"\(12\).*\(4\).*virtual_stages \(2\) = 8"):
        uniform_partition(12, 4, virtual_stages=2)


def test_interleaved_mapping() -> None:
    plan = uniform_partition(16, 4, virtual_stages=2)
    # Virtual stage u = chunk * p + stage holds layers [2u, 2u + 2).
    assert plan.stages[1].chunks == ((2, 4), (10, 12))
    assert plan.stages[1].layers == (2, 3, 10, 11) and plan.stages[1].num_layers == 4
    assert plan.locate(9) == (0, 1) and plan.locate(15) == (3, 1)
    assert plan.stages[0].has_embedding and plan.stages[3].has_head
    with pytest.raises(PartitionError, match="outside"):
        plan.locate(16)


def test_single_stage_holds_everything() -> None:
    (stage,) = uniform_partition(4, 1).stages
    assert stage == StagePlan(0, ((0, 4),), has_embedding=True, has_head=True)


def test_balanced_equal_weights_is_even() -> None:
    assert balanced_partition([7] * 12, 4).layer_counts == (3, 3, 3, 3)
    assert balanced_partition([1] * 10, 4).layer_counts in {(3, 3, 2, 2), (2, 2, 3, 3)}
    assert max(balanced_partition([1] * 10, 4).layer_counts) == 3


def test_balanced_minimises_heaviest_stage() -> None:
    weights = [1, 1, 1, 10, 1, 1, 1]
    plan = balanced_partition(weights, 3)
    assert plan.layer_counts == (3, 1, 3)
    # Brute force over all contiguous splits agrees on the optimum.
    best = min(
        max(sum(weights[:a]), sum(weights[a:b]), sum(weights[b:]))
        for a in range(1, 6) for b in range(a + 1, 7)
    )
    bounds = [0, 3, 4, 7]
    assert max(sum(weights[bounds[i]:bounds[i + 1]]) for i in range(3)) == best


def test_balanced_counts_embedding_and_head() -> None:
    # A heavy embedding pushes layers off the first stage, a heavy head off the last.
    plan = balanced_partition([4] * 8, 4, embedding_weight=8, head_weight=8)
    assert plan.layer_counts[0] == 1 and plan.layer_counts[-1] == 1
    assert sum(plan.layer_counts) == 8
    weights = [4 * c for c in plan.layer_counts]
    weights[0] += 8
    weights[-1] += 8
    assert max(weights) == 12


def test_balanced_interleaved_and_errors() -> None:
    plan = balanced_partition([1] * 8, 2, virtual_stages=2)
    assert plan.layer_counts == (2, 2, 2, 2) and plan.stages[0].chunks == ((0, 2), (4, 6))
    with pytest.raises(PartitionError, match=r"3 layers < num_stages \(2\) x virtual_stages"):
        balanced_partition([1, 1, 1], 2, virtual_stages=2)
    with pytest.raises(PartitionError, match=">= 0"):
        balanced_partition([1, -1, 1], 2)


def test_explicit() -> None:
    plan = explicit_partition([1, 3, 0, 2], 4)
    assert [s.chunks for s in plan.stages] == [((0, 1),), ((1, 4),), ((4, 4),), ((4, 6),)]
    assert plan.num_layers == 6
    with pytest.raises(PartitionError, match=r"needs 4 layer counts .* got 3"):
        explicit_partition([1, 2, 3], 4)
    with pytest.raises(PartitionError, match=">= 0"):
        explicit_partition([1, -2, 3, 4], 4)


def test_partition_dispatcher() -> None:
    assert partition_layers(8, 2) == uniform_partition(8, 2)
    assert partition_layers(4, 2, "balanced", layer_weights=[3, 1, 1, 1]).layer_counts == (1, 3)
    assert partition_layers(5, 2, "explicit", layer_counts=[2, 3]).layer_counts == (2, 3)
    with pytest.raises(PartitionError, match="sum to 5, model has 6"):
        partition_layers(6, 2, "explicit", layer_counts=[2, 3])
    with pytest.raises(PartitionError, match="needs 4 layer weights, got 3"):
        partition_layers(4, 2, "balanced", layer_weights=[1, 1, 1])
    with pytest.raises(PartitionError, match="unknown partition method"):
        partition_layers(4, 2, "random")


def test_plan_validation() -> None:
    with pytest.raises(PartitionError, match="expected to start at 2"):
        PipelinePlan(4, 2, 1, (StagePlan(0, ((0, 2),), True, False),
                               StagePlan(1, ((3, 4),), False, True)))
    with pytest.raises(PartitionError, match="embedding must be on stage 0"):
        PipelinePlan(4, 2, 1, (StagePlan(0, ((0, 2),), False, False),
                               StagePlan(1, ((2, 4),), False, True)))
    with pytest.raises(PartitionError, match="num_stages must be a positive int"):
        uniform_partition(4, 0)
