"""Process groups on real gloo ranks: every group reduces over exactly its ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from mt_dist import ParallelGroups, Topology, TopologyError, backend_for, build_groups
from mt_dist.testing import run_distributed


def test_backend_for() -> None:
    assert backend_for("cpu") == "gloo"
    assert backend_for(torch.device("cuda", 3)) == "nccl"
    with pytest.raises(ValueError, match="'meta'"):
        backend_for("meta")


def _reduce_over(group: Any, rank: int) -> float:
    # 10**rank makes each sum spell out exactly which ranks took part.
    value = torch.tensor([10.0**rank], dtype=torch.float64)
    dist.all_reduce(value, group=group)
    return value.item()


def _group_report(tp: int, pp: int, dp: int) -> dict[str, Any]:
    groups = build_groups(Topology(tp=tp, pp=pp, dp=dp))
    rank = dist.get_rank()
    report: dict[str, Any] = {
        "props": (groups.rank, groups.coord, groups.tp_rank, groups.tp_size, groups.dp_rank,
                  groups.dp_size, groups.pp_rank, groups.pp_size, groups.is_first_stage,
                  groups.is_last_stage, groups.backend, str(groups.device)),
        "stages": (groups.prev_stage_rank, groups.next_stage_rank),
    }
    for kind in ("tp", "dp", "pp", "embedding", "model_parallel"):
        group = getattr(groups, kind)
        if group is None:
            report[kind] = None
            continue
        members = tuple(dist.get_process_group_ranks(group))
        assert members == getattr(groups, f"{kind}_group_ranks"), kind
        report[kind] = (members, _reduce_over(group, rank))
    report["pipeline"] = _pass_along_pipeline(groups)
    return report


def _pass_along_pipeline(groups: ParallelGroups) -> list[int]:
    """Send a growing list of global ranks from the first to the last stage (P2P helpers)."""
    seen = torch.full((groups.pp_size,), -1, dtype=torch.int64)
    if groups.prev_stage_rank is not None:
        dist.recv(seen, src=groups.prev_stage_rank)
    seen[groups.pp_rank] = groups.rank
    if groups.next_stage_rank is not None:
        dist.send(seen, dst=groups.next_stage_rank)
    return seen.tolist()


def _check(reports: list[dict[str, Any]], topo: Topology) -> None:
    assert len(reports) == topo.world_size
    for rank, report in enumerate(reports):
        c = topo.coord(rank)
        assert report["props"] == (
            rank, c, c.tp, topo.tp, c.dp, topo.dp, c.pp, topo.pp, c.pp == 0,
            c.pp == topo.pp - 1, "gloo", "cpu",
        )
        assert report["stages"] == (topo.prev_stage_rank(rank), topo.next_stage_rank(rank))
        expected = {
            "tp": topo.tp_group_ranks(rank),
            "dp": topo.dp_group_ranks(rank),
            "pp": topo.pp_group_ranks(rank),
            "embedding": topo.embedding_group_ranks(rank),
            "model_parallel": topo.model_parallel_group_ranks(rank),
        }
        for kind, ranks in expected.items():
            if ranks is None:
                assert report[kind] is None, (rank, kind)
            else:
                assert report[kind] == (ranks, float(sum(10**r for r in ranks))), (rank, kind)
        if c.pp == topo.pp - 1:
            assert report["pipeline"] == list(topo.pp_group_ranks(rank))


def test_groups_tp2_pp2_dp2_on_8_ranks() -> None:
    topo = Topology(tp=2, pp=2, dp=2)
    _check(run_distributed(_group_report, 8, 2, 2, 2, timeout=120), topo)


def test_groups_pp3_dp2_middle_stage_has_no_embedding_group() -> None:
    topo = Topology(tp=1, pp=3, dp=2)
    reports = run_distributed(_group_report, 6, 1, 3, 2, timeout=120)
    _check(reports, topo)
    assert [r["embedding"] is None for r in reports] == [False, False, True, True, False, False]


def _wrong_world() -> str:
    try:
        build_groups(Topology(tp=4))
    except TopologyError as err:
        return str(err)
    return "no error"


def test_build_groups_rejects_a_mismatched_world() -> None:
    messages = run_distributed(_wrong_world, 2, timeout=60)
    assert messages == ["default process group has 2 ranks but topology tp 4 x pp 1 x dp 1 "
                        "needs 4"] * 2


def test_build_groups_needs_a_default_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialized default process group"):
        build_groups(Topology())


def _cp_report() -> dict[str, Any]:
    groups = build_groups(Topology(tp=2, dp=1, cp=2))
    rank = dist.get_rank()
    assert groups.cp is not None and groups.dp_cp is not None
    return {"cp": (tuple(dist.get_process_group_ranks(groups.cp)), _reduce_over(groups.cp, rank)),
            "grad": (tuple(dist.get_process_group_ranks(groups.grad_group)),
                     _reduce_over(groups.grad_group, rank), groups.grad_rank, groups.grad_size),
            "tp": tuple(dist.get_process_group_ranks(groups.tp)),
            "coord": (groups.cp_rank, groups.cp_size, groups.tp_rank)}


def test_context_parallel_groups_on_four_ranks() -> None:
    """tp 2 x cp 2: TP pairs are adjacent ([0, 1], [2, 3]), CP pairs across them ([0, 2],
    [1, 3]); gradients reduce over dp x cp (here the CP pair); without CP the gradient group
    is the DP group itself."""
    reports = run_distributed(_cp_report, 4, timeout=60)
    for rank, report in enumerate(reports):
        tp_rank, cp_rank = rank % 2, rank // 2
        pair = (tp_rank, tp_rank + 2)
        assert report["cp"] == (pair, 10.0 ** pair[0] + 10.0 ** pair[1])
        assert report["grad"] == (pair, 10.0 ** pair[0] + 10.0 ** pair[1], cp_rank, 2)
        assert report["tp"] == (2 * cp_rank, 2 * cp_rank + 1)
        assert report["coord"] == (cp_rank, 2, tp_rank)

