"""mt_plan.checkpoints: the bytes of a save by hand for small layouts, the time it stops
training, and the interval that costs least against a brute-force search over intervals."""

from __future__ import annotations

import math

import pytest

from mt_plan import GPUS, ParallelLayout
from mt_plan.checkpoints import failure_costs, save_costs

A100 = GPUS["a100-80gb"]  # 8 GPUs per node


def _layout(tp: int, pp: int, dp: int, zero: int, cp: int = 1) -> ParallelLayout:
    return ParallelLayout(tp, pp, dp, 8 * dp * cp, 1, zero, "1f1b", 1, False, "full", "bf16",
                          True, True, cp)


def test_save_bytes_by_hand() -> None:
    # tp 2 x pp 2 x dp 4, ZeRO 1, 1000 parameters on the fullest GPU, 3600 in all.
    cost = save_costs(3600, 1000, _layout(2, 2, 4, 1), A100, 1e9, 1e10)
    assert cost.rank_bytes == 1000 * 4 + 1000 * 12 / 4
    assert cost.checkpoint_bytes == 3600 * (4 + 12)
    # The first node: ranks 0-7, its first TP pair (replica 0) writes the weights.
    assert cost.node_bytes == 2 * 4000 + 8 * 3000
    assert cost.sync_s == pytest.approx(cost.node_bytes / 1e9)
    assert cost.async_s == pytest.approx(cost.rank_bytes / 1e10)
    assert cost.host_bytes_per_node == cost.node_bytes
    # ZeRO 0: every replica keeps (and writes) the whole optimizer state of its slice.
    zero0 = save_costs(3600, 1000, _layout(2, 2, 4, 0), A100, 1e9, 1e10)
    assert zero0.rank_bytes == 1000 * 16 and zero0.checkpoint_bytes == 3600 * (4 + 4 * 12)
    # Context parallelism: ZeRO shards over dp x cp ranks; weights once per TP slice.
    cp = save_costs(3600, 1000, _layout(2, 1, 2, 1, cp=2), A100, 1e9, 1e10)
    assert cp.rank_bytes == 4000 + 12000 / 4 and cp.checkpoint_bytes == 3600 * 16
    with pytest.raises(ValueError, match="bandwidths must be > 0"):
        save_costs(1, 1, _layout(1, 1, 1, 1), A100, 0.0, 1.0)


def _total(blocking: float, write: float, step: float, n: int, rate: float,
           restart: float) -> float:
    return failure_costs(blocking, write, step, n, rate, restart).total_fraction


@pytest.mark.parametrize("blocking, write", [(20.0, 0.0), (0.5, 20.0), (0.05, 60.0)])
def test_the_least_costly_interval_is_the_brute_force_one(blocking: float,
                                                          write: float) -> None:
    step, rate, restart = 10.0, 2.0, 600.0
    costs = failure_costs(blocking, write, step, 50, rate, restart)
    brute = min(range(1, 2000), key=lambda n: _total(blocking, write, step, n, rate, restart))
    assert _total(blocking, write, step, costs.best_interval_steps, rate, restart) == \
        pytest.approx(_total(blocking, write, step, brute, rate, restart), rel=1e-3)
    # The expected loss of one failure: half an interval, the write in flight, the restart.
    assert costs.lost_per_failure_s == 250.0 + write + 600.0
    assert costs.failure_fraction == pytest.approx(2.0 / 86400 * (250.0 + write + 600.0))


def test_young_daly_and_edges() -> None:
    # Without a write in flight the optimum is Young's sqrt(2 c / rate).
    costs = failure_costs(30.0, 0.0, 1.0, 100, 4.0, 0.0)
    assert costs.best_interval_steps == pytest.approx(math.sqrt(2 * 30.0 * 86400 / 4.0),
                                                      abs=1.0)
    # An interval shorter than the write waits for it at each save.
    short = failure_costs(0.1, 30.0, 1.0, 10, 1.0, 0.0)
    assert short.saving_fraction == pytest.approx((0.1 + 20.0) / (10.0 + 20.1))
    assert failure_costs(1.0, 0.0, 1.0, 10, 0.0, 0.0).failure_fraction == 0.0
    with pytest.raises(ValueError, match="interval_steps >= 1"):
        failure_costs(1.0, 0.0, 1.0, 0, 1.0, 0.0)
