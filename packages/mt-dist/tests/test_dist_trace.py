"""mt_dist.trace on 2 gloo ranks: every kind of collective recorded once with its group and
bytes, whoever issues it (mt's helpers, torch.distributed directly, a nested call counted as
the outer one); synchronous calls all exposed, an asynchronous one's compute in between hidden;
the functions unwrapped afterwards."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from mt_dist.collectives import all_gather_along, all_reduce, all_reduce_sum
from mt_dist.testing import run_distributed
from mt_dist.trace import CollectiveTrace, summarize


def _traced(_: None) -> dict:
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    x = torch.ones(1000)  # 4,000 bytes
    originals = dist.all_reduce, dist.broadcast
    with CollectiveTrace({pair: "tp"}) as trace:
        all_reduce(x, pair)  # mt's helper (synchronous)
        dist.broadcast(x, src=0)  # torch directly, default group
        out = torch.empty(2000)
        dist.all_gather_into_tensor(out, x)
        all_gather_along(x, 0, pair)  # mt's helper: torch's newer name, all_gather_single
        handle = all_reduce_sum(torch.ones(250), pair)  # asynchronous: 1,000 bytes
        began = time.perf_counter()
        while time.perf_counter() - began < 0.2:  # "compute" while it is in flight
            torch.ones(64, 64) @ torch.ones(64, 64)
        handle.wait()
        ops = [dist.P2POp(dist.isend if rank == 0 else dist.irecv, torch.ones(10), 1 - rank)]
        for work in dist.batch_isend_irecv(ops):  # isend inside: counted as the batch
            work.wait()
        dist.all_gather_object([None, None], {"rank": rank})
        first = trace.take()
        dist.barrier()
        second = trace.take()
    after = dist.all_reduce, dist.broadcast
    return {"first": first, "second": second, "unwrapped": after == originals}


def test_every_collective_is_recorded_once_with_group_bytes_and_waits() -> None:
    results = run_distributed(_traced, 2, None)
    for rank, result in enumerate(results):
        first, second = result["first"], result["second"]
        assert result["unwrapped"]
        kinds = [(r.kind, r.group, r.bytes) for r in first]
        assert kinds == [("all_reduce", "tp", 4000), ("broadcast", "world", 4000),
                         ("all_gather_into_tensor", "world", 8000),
                         ("all_gather_single", "tp", 8000), ("all_reduce", "tp", 1000),
                         ("batch_isend_irecv", "world", 40), ("all_gather_object", "world", 0)
                         ], rank
        assert [r.kind for r in second] == ["barrier"]
        assert all(r.waited for r in first)
        launched = [r.launched_s for r in first]
        assert launched == sorted(launched) and launched[0] >= 0
        sync = [r for i, r in enumerate(first) if i not in (4, 5)]  # 5: batch of waits
        assert all(r.in_flight_s == pytest.approx(r.blocked_s) for r in sync)
        async_ = first[4]
        assert async_.in_flight_s >= 0.2 > async_.blocked_s  # the compute ran under it
        summary = summarize(first)
        assert summary["collectives"] == 7
        assert summary["comm_bytes"] == 4000 + 4000 + 8000 + 8000 + 1000 + 40
        assert summary["by_kind"]["all_reduce tp"]["n"] == 2
        # Hidden: the time the asynchronous one was in flight while nothing blocked (and the
        # batch's microseconds between its launch and its waits).
        assert summary["comm_hidden_s"] == pytest.approx(
            async_.in_flight_s - async_.blocked_s, abs=1e-3)
        assert summary["comm_exposed_s"] == pytest.approx(sum(r.blocked_s for r in first))


def test_one_trace_at_a_time() -> None:
    with CollectiveTrace(), pytest.raises(RuntimeError, match="already active"):
        CollectiveTrace().__enter__()


def _coalesced(_: None) -> dict:
    """megatron-core reduces its buckets in torch's ``_coalescing_manager``: the calls in the
    block return no work of their own; the block launches them at its exit."""
    with CollectiveTrace() as trace:
        with dist._coalescing_manager(async_ops=True) as block:
            dist.all_reduce(torch.ones(100), async_op=True)
            dist.all_reduce(torch.ones(50), async_op=True)
        began = time.perf_counter()
        while time.perf_counter() - began < 0.1:
            torch.ones(64, 64) @ torch.ones(64, 64)
        block.wait()
        records = trace.take()
    return {"records": records, "restored": dist._coalescing_manager.__module__}


def test_a_coalesced_block_is_its_collectives_launched_at_its_exit() -> None:
    for result in run_distributed(_coalesced, 2, None):
        records = result["records"]
        assert [(r.kind, r.bytes) for r in records] == [("all_reduce", 400), ("all_reduce", 200)]
        assert all(r.waited for r in records)
        assert records[0].launched_s == records[1].launched_s  # the block's exit
        assert all(r.in_flight_s >= 0.1 > r.blocked_s for r in records)
        assert result["restored"] == "torch.distributed.distributed_c10d"
