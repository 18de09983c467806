"""Pure topology maths: no processes."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from mt_dist import Coord, Topology, TopologyError

SHAPES = [  # (tp, pp, dp)
    (1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 2, 3), (3, 5, 2), (8, 1, 4),
    (1, 4, 1), (2, 3, 1),
]


def _shape_id(shape: tuple[int, int, int]) -> str:
    return "tp{}-pp{}-dp{}".format(*shape)


@pytest.fixture(params=SHAPES, ids=_shape_id)
def topo(request: pytest.FixtureRequest) -> Topology:
    tp, pp, dp = request.param
    return Topology(tp=tp, pp=pp, dp=dp)


def _assert_partition(groups: list[tuple[int, ...]], world: int, size: int) -> None:
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(world)), "every rank in exactly one group"
    assert all(len(g) == size for g in groups)
    assert len(groups) == world // size


def test_coord_and_rank_of_are_inverse_and_follow_the_layout(topo: Topology) -> None:
    seen = set()
    for rank in range(topo.world_size):
        c = topo.coord(rank)
        assert isinstance(c, Coord)
        assert topo.rank_of(c.pp, c.dp, c.tp) == rank
        assert rank == (c.pp * topo.dp + c.dp) * topo.tp + c.tp
        seen.add(c)
    grid = itertools.product(range(topo.pp), range(topo.dp), range(topo.tp))
    assert seen == {Coord(*x) for x in grid}


def test_tp_groups_are_contiguous_and_share_pp_dp(topo: Topology) -> None:
    groups = topo.tp_groups()
    _assert_partition(groups, topo.world_size, topo.tp)
    for g in groups:
        assert g == tuple(range(g[0], g[0] + topo.tp))
        assert len({topo.coord(r)[:2] for r in g}) == 1
        assert [topo.coord(r).tp for r in g] == list(range(topo.tp))


def test_dp_groups_share_pp_tp(topo: Topology) -> None:
    groups = topo.dp_groups()
    _assert_partition(groups, topo.world_size, topo.dp)
    for g in groups:
        assert len({(topo.coord(r).pp, topo.coord(r).tp) for r in g}) == 1
        assert [topo.coord(r).dp for r in g] == list(range(topo.dp))


def test_pp_groups_share_dp_tp_in_stage_order(topo: Topology) -> None:
    groups = topo.pp_groups()
    _assert_partition(groups, topo.world_size, topo.pp)
    for g in groups:
        assert len({(topo.coord(r).dp, topo.coord(r).tp) for r in g}) == 1
        assert [topo.coord(r).pp for r in g] == list(range(topo.pp))


def test_model_parallel_groups_are_replicas(topo: Topology) -> None:
    groups = topo.model_parallel_groups()
    _assert_partition(groups, topo.world_size, topo.tp * topo.pp)
    for d, g in enumerate(groups):
        assert {topo.coord(r).dp for r in g} == {d}


def test_embedding_groups_are_first_and_last_stage(topo: Topology) -> None:
    groups = topo.embedding_groups()
    assert len(groups) == topo.dp * topo.tp
    for emb, pipe in zip(groups, topo.pp_groups()):
        assert emb == ((pipe[0],) if topo.pp == 1 else (pipe[0], pipe[-1]))
    members = [r for g in groups for r in g]
    assert len(members) == len(set(members)), "no rank in two embedding groups"
    for rank in range(topo.world_size):
        stage = topo.coord(rank).pp
        own = topo.embedding_group_ranks(rank)
        if stage in (0, topo.pp - 1):
            assert own is not None and rank in own and own in groups
        else:
            assert own is None and rank not in members


def test_per_rank_group_lookups_match_the_group_lists(topo: Topology) -> None:
    kinds = [
        (topo.tp_groups(), topo.tp_group_ranks),
        (topo.dp_groups(), topo.dp_group_ranks),
        (topo.pp_groups(), topo.pp_group_ranks),
        (topo.model_parallel_groups(), topo.model_parallel_group_ranks),
    ]
    for groups, lookup in kinds:
        for g in groups:
            for rank in g:
                assert lookup(rank) == g


def test_prev_and_next_stage(topo: Topology) -> None:
    for rank in range(topo.world_size):
        c = topo.coord(rank)
        prev, nxt = topo.prev_stage_rank(rank), topo.next_stage_rank(rank)
        if c.pp == 0:
            assert prev is None
        else:
            assert prev is not None and topo.coord(prev) == Coord(c.pp - 1, c.dp, c.tp)
            assert topo.next_stage_rank(prev) == rank
        if c.pp == topo.pp - 1:
            assert nxt is None
        else:
            assert nxt is not None and topo.coord(nxt) == Coord(c.pp + 1, c.dp, c.tp)


def test_concrete_2x2x2_layout() -> None:
    topo = Topology(tp=2, pp=2, dp=2)
    assert topo.world_size == 8
    assert topo.tp_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert topo.dp_groups() == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert topo.pp_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert topo.embedding_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert topo.model_parallel_groups() == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert topo.coord(5) == Coord(pp=1, dp=0, tp=1)


def test_mt_nlg_530b_layout() -> None:
    topo = Topology.from_world(2240, tp=8, pp=35)
    assert (topo.tp, topo.pp, topo.dp, topo.world_size) == (8, 35, 8, 2240)
    assert topo.coord(2239) == Coord(34, 7, 7)
    assert topo.embedding_groups()[0] == (0, 34 * 64)
    _assert_partition(topo.dp_groups(), 2240, 8)


def test_from_world_infers_dp() -> None:
    assert Topology.from_world(12, tp=2, pp=3) == Topology(tp=2, pp=3, dp=2)
    assert Topology.from_world(1) == Topology()


def test_from_world_error_names_every_number() -> None:
    with pytest.raises(TopologyError, match=r"world size 6 is not divisible by tp 4 x pp 1 = 4"):
        Topology.from_world(6, tp=4)
    with pytest.raises(TopologyError, match=r"world size 10 .* tp 2 x pp 3 = 6"):
        Topology.from_world(10, tp=2, pp=3)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"tp": 0}, r"tp must be >= 1, got 0"),
        ({"pp": -2}, r"pp must be >= 1, got -2"),
        ({"dp": 1.5}, r"dp must be an int, got 1.5"),
        ({"tp": True}, r"tp must be an int, got True"),
    ],
)
def test_invalid_degrees(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(TopologyError, match=pattern):
        Topology(**kwargs)  # type: ignore[arg-type]


def test_out_of_range_rank_and_coordinate() -> None:
    topo = Topology(tp=2, pp=2, dp=1)
    with pytest.raises(TopologyError, match=r"rank 4 is outside \[0, 4\) for tp 2 x pp 2 x dp 1"):
        topo.coord(4)
    with pytest.raises(TopologyError, match=r"tp index 2 is outside \[0, 2\)"):
        topo.rank_of(0, 0, 2)
    with pytest.raises(TopologyError):
        topo.coord(-1)
    assert issubclass(TopologyError, ValueError)


def test_topology_is_frozen_and_hashable() -> None:
    topo = Topology(tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.tp = 4  # type: ignore[misc]
    assert {topo: 1}[Topology(tp=2, pp=1, dp=1)] == 1


@pytest.mark.parametrize("tp,pp,dp,cp", [(2, 2, 2, 2), (1, 1, 2, 4), (2, 1, 1, 2), (1, 3, 2, 2)])
def test_context_parallel_axis(tp: int, pp: int, dp: int, cp: int) -> None:
    """The fourth axis: cp between tp and dp in the rank order; CP groups share (pp, dp, tp);
    the gradient groups (dp x cp) hold a model shard's ranks in the order of a (tp, pp,
    dp * cp) grid, which is why a CP checkpoint reads like one with dp * cp replicas."""
    topo = Topology(tp=tp, pp=pp, dp=dp, cp=cp)
    assert topo.world_size == tp * pp * dp * cp
    for rank in range(topo.world_size):
        c = topo.coord(rank)
        assert rank == ((c.pp * dp + c.dp) * cp + c.cp) * tp + c.tp
        assert topo.rank_of(c.pp, c.dp, c.tp, c.cp) == rank
        assert topo.cp_group_ranks(rank) in topo.cp_groups()
        assert topo.dp_cp_group_ranks(rank) in topo.dp_cp_groups()
    for groups, size in ((topo.cp_groups(), cp), (topo.dp_cp_groups(), dp * cp),
                         (topo.tp_groups(), tp), (topo.dp_groups(), dp),
                         (topo.pp_groups(), pp)):
        _assert_partition(groups, topo.world_size, size)
    for g in topo.cp_groups():
        assert len({topo.coord(r)._replace(cp=0) for r in g}) == 1
        assert [topo.coord(r).cp for r in g] == list(range(cp))
    flat = Topology(tp=tp, pp=pp, dp=dp * cp)
    assert sorted(topo.dp_cp_groups()) == sorted(flat.dp_groups())
    assert Topology.from_world(topo.world_size, tp=tp, pp=pp, cp=cp) == topo
    with pytest.raises(TopologyError, match=r"not divisible by tp 1 x pp 1 x cp 4 = 4"):
        Topology.from_world(6, cp=4)
    with pytest.raises(TopologyError, match=r"cp index 9 is outside \[0, 2\)"):
        Topology(cp=2).rank_of(0, 0, 0, 9)
