"""RNGTracker: dropout masks differ across TP ranks inside ``fork()`` and agree outside it;
the default stream is left exactly where it was; a fork stream is shared by DP replicas."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mt_dist import Topology, build_groups
from mt_dist.testing import run_distributed
from mt_tensor_parallel import RNGRegion, RNGTracker

N = 4096


def _mask(drop: nn.Module) -> torch.Tensor:
    return drop(torch.ones(N)) != 0


def _masks() -> dict[str, torch.Tensor]:
    groups = build_groups(Topology(tp=2, dp=2))  # ranks (0, 1) and (2, 3) are TP groups
    drop = nn.Dropout(0.5)
    torch.manual_seed(0)  # the same default seed on every rank
    tracker = RNGTracker(seed=1234, tp_rank=groups.tp_rank)
    out = {"replicated": _mask(drop)}
    with tracker.fork():
        out["sharded_1"] = _mask(drop)
    out["replicated_after_fork"] = _mask(drop)
    with tracker.fork():
        out["sharded_2"] = _mask(drop)
    saved = tracker.state_dict()
    out["region"] = _mask(RNGRegion(drop, tracker))
    tracker.load_state_dict(saved)
    with tracker.fork():
        out["region_replayed"] = _mask(drop)
    torch.manual_seed(0)  # what the default stream gives with no fork at all
    _mask(drop)
    out["no_fork_second"] = _mask(drop)
    out["rank"] = torch.tensor(dist.get_rank())
    return out


def test_tp_rng_masks_differ_across_tp_ranks_and_agree_elsewhere() -> None:
    results = run_distributed(_masks, 4, timeout=120)
    r0, r1, r2 = results[0], results[1], results[2]
    for masks in results:
        assert 0.4 < masks["sharded_1"].float().mean() < 0.6  # dropout really ran
        # Forking leaves the default stream where it was ...
        assert torch.equal(masks["replicated_after_fork"], masks["no_fork_second"])
        # ... and saves the TP stream's progress: consecutive forks draw new masks.
        assert not torch.equal(masks["sharded_1"], masks["sharded_2"])
        assert torch.equal(masks["region"], masks["region_replayed"])
    for key in ("replicated", "replicated_after_fork"):  # default stream: same everywhere
        assert all(torch.equal(m[key], r0[key]) for m in results)
    for key in ("sharded_1", "sharded_2", "region"):
        assert not torch.equal(r0[key], r1[key])  # TP ranks 0 and 1: different masks
        assert torch.equal(r0[key], r2[key])  # same tp rank in another DP replica: same
        assert not torch.equal(r0[key], r0["replicated"])


def test_tp_rng_region_is_a_no_op_in_eval_mode() -> None:
    tracker = RNGTracker(seed=0, tp_rank=0)
    region = RNGRegion(nn.Dropout(0.5), tracker).eval()
    before = torch.get_rng_state()
    assert torch.equal(region(torch.ones(8)), torch.ones(8))
    assert torch.equal(torch.get_rng_state(), before)


def test_keyed_rng_draws_by_key_and_region_not_by_history() -> None:
    """KeyedRNG.enter(key, region) makes the next draws a function of (seed, key, region):
    the same after any other draws, different for another key or region, and the TP tracker's
    streams re-seeded too, still apart per TP rank."""
    import torch

    from mt_tensor_parallel import KeyedRNG, RNGTracker, mix_seed

    def draw(rng: KeyedRNG, key: int, region: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng.enter(key, region)
        default = torch.rand(4)
        assert rng.tracker is not None
        with rng.tracker.fork():
            tp = torch.rand(4)
        return default, tp

    a = KeyedRNG(7, RNGTracker(7, tp_rank=0), use_cuda=False)
    b = KeyedRNG(7, RNGTracker(7, tp_rank=1), use_cuda=False)
    first = draw(a, key=16, region=3)
    torch.rand(100)  # whatever ran in between
    again = draw(a, key=16, region=3)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], draw(a, key=17, region=3)[0])
    assert not torch.equal(first[0], draw(a, key=16, region=4)[0])
    other_rank = draw(b, key=16, region=3)
    assert torch.equal(other_rank[0], first[0])  # replicated regions: the same masks
    assert not torch.equal(other_rank[1], first[1])  # sharded regions: per-rank masks
    assert mix_seed(1, 2) != mix_seed(2, 1) and 0 <= mix_seed(1, 2) < 2**63
