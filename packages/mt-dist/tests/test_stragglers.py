"""mt_dist.stragglers: a rank persistently slower than its data-parallel peers is named once,
over a full window, against its own peers only; noise within the factor names nobody; a
recovered rank is said to be so."""

from __future__ import annotations

import pytest

from mt_dist import Topology
from mt_dist.stragglers import BusyClock, StragglerWatch, gather_busy


def test_a_slow_rank_is_named_against_its_peers_once() -> None:
    # tp 1 x pp 2 x dp 2: stage 1 (ranks of the second pipeline stage) computes the loss
    # and always takes longer; that is no straggler. Rank 2 of stage 0 is.
    topo = Topology.from_world(4, pp=2)
    groups = topo.dp_groups()
    slow_rank = groups[0][1]
    watch = StragglerWatch(groups, window=5, factor=1.25)
    stage = {r: topo.coord(r).pp for r in range(4)}

    def row(step: int, slow: bool = True) -> list[float]:
        noise = 0.01 * (step % 3)
        return [(2.0 if stage[r] else 1.0) + noise + (0.5 if slow and r == slow_rank else 0)
                for r in range(4)]

    for step in range(4):
        assert watch.add(row(step)) == ([], [])  # the window is not full yet
    new, recovered = watch.add(row(4))
    assert [s.rank for s in new] == [slow_rank] and recovered == []
    assert new[0].peers == (groups[0][0],)
    assert new[0].ratio == pytest.approx(1.5, rel=0.02)
    assert f"rank {slow_rank} on node7 is a straggler: its steps' work takes 1.5" in \
        new[0].line("node7")
    assert watch.add(row(5)) == ([], [])  # named once
    for step in (6, 7):  # the window's median: still a slow step
        assert watch.add(row(step, slow=False)) == ([], [])
    assert watch.add(row(8, slow=False)) == ([], [slow_rank])  # 3 of 5 steps fast
    assert watch.slow == set()


def test_noise_within_the_factor_names_nobody_and_one_rank_has_no_peers() -> None:
    watch = StragglerWatch([(0, 1, 2)], window=3, factor=1.25)
    for step in range(20):
        assert watch.add([1.0, 1.2 if step % 2 else 0.8, 1.1]) == ([], [])
    alone = StragglerWatch([(0,), (1,)], window=1)
    assert alone.add([1.0, 9.0]) == ([], [])
    with pytest.raises(ValueError, match="factor > 1"):
        StragglerWatch([(0, 1)], factor=1.0)


def test_a_cpu_clock_and_one_process() -> None:
    import torch

    clock = BusyClock()
    for _ in range(2):
        clock.start()
        torch.ones(256, 256) @ torch.ones(256, 256)
        clock.stop()
    assert 0 < clock.take() < 5
    assert clock.take() == 0.0
    assert gather_busy(0.5, torch.device("cpu")) == [0.5]
