"""The multi-process test harness: results, failures, crashes and hangs."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mt_dist.testing import (
    DistributedTestError,
    DistributedTimeoutError,
    launch_local,
    run_distributed,
)


def _describe(offset: int, *, scale: float = 1.0) -> tuple[int, int, str, int, float]:
    value = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(value)
    return (dist.get_rank(), dist.get_world_size(), dist.get_backend(),
            torch.get_num_threads(), value.item() * scale)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_returns_values_by_rank(world_size: int) -> None:
    results = run_distributed(_describe, world_size, 10, scale=0.5, timeout=60)
    total = sum(range(world_size)) + 10 * world_size
    assert results == [(r, world_size, "gloo", 1, total * 0.5) for r in range(world_size)]


def _tensor_result() -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) * (dist.get_rank() + 1)


def test_tensor_results_round_trip() -> None:
    a, b = run_distributed(_tensor_result, 2, timeout=60)
    assert a.shape == (2, 3) and a.dtype == torch.float32
    assert torch.equal(b, 2 * a) and torch.equal(a.flatten(), torch.arange(6.0))


def _fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    return dist.get_rank()


def test_propagates_a_rank_exception_with_traceback() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank_one, 3, timeout=60)
    err = info.value
    assert err.rank == 1
    assert "rank 1 of 3 failed" in str(err)
    assert "ValueError: boom from rank one" in str(err)
    assert "_fail_on_rank_one" in str(err)  # the traceback names the failing function
    assert not isinstance(err, DistributedTimeoutError)


def _fail_while_others_wait() -> None:
    if dist.get_rank() == 0:
        raise KeyError("root cause on rank 0")
    dist.all_reduce(torch.ones(1))  # never completes: rank 0 is gone


def test_root_cause_is_reported_first_and_waiting_ranks_are_killed() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_while_others_wait, 4, timeout=60)
    assert info.value.rank == 0
    assert "KeyError: 'root cause on rank 0'" in str(info.value)
    assert time.monotonic() - start < 20  # did not wait for the 60 s timeout


def _hang_on_rank_one() -> int:
    if dist.get_rank() == 1:
        time.sleep(3600)
    return dist.get_rank()


def test_times_out_on_a_hang_and_shows_the_stuck_stack() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_hang_on_rank_one, 2, timeout=2.0)
    elapsed = time.monotonic() - start
    assert 2.0 <= elapsed < 10.0
    message = str(info.value)
    assert "timed out after 2 s" in message and "ranks [1] of 2 had not finished" in message
    assert "_hang_on_rank_one" in message  # faulthandler dump of the stuck rank


def _answers_late(rank: int, ready: str) -> None:
    """A stuck rank whose stack dump comes 1.5 s after it is asked for, as a rank continued
    on a loaded machine may wait for a core (SIGUSR1 held back meanwhile: this process runs
    no other thread that could take it)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    open(ready, "w").close()
    time.sleep(1.5)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    time.sleep(3600)


def test_a_stuck_rank_s_stack_is_waited_for_when_it_answers_late(tmp_path: Path) -> None:
    from mt_dist.supervisor import LocalRanks

    ready = tmp_path / "ready"
    with LocalRanks(_answers_late, 1, args=(str(ready),)) as ranks:
        while not ready.exists():
            time.sleep(0.01)
        start = time.monotonic()
        stack = ranks.stacks([0])[0]
    assert "_answers_late" in stack, stack
    assert 1.5 <= time.monotonic() - start < 10.0


def _crash_on_rank_one() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    return 0


def test_a_crashed_rank_is_reported_with_its_exit_code() -> None:
    with pytest.raises(DistributedTestError, match="rank 1 died with exit code 3"):
        run_distributed(_crash_on_rank_one, 2, timeout=60)


def _unpicklable() -> object:
    return lambda: None


def test_unpicklable_result_is_an_error() -> None:
    with pytest.raises(DistributedTestError, match="rank 0 of 1 failed"):
        run_distributed(_unpicklable, 1, timeout=60)


def _noisy_matmul(n: int) -> float:
    print("stdout noise " * 1000)
    print("stderr noise " * 1000, file=sys.stderr)
    x = torch.ones(n, n)
    return float((x @ x)[0, 0])


def test_after_parent_used_threads_and_with_noisy_children() -> None:
    x = torch.randn(300, 300)
    (x @ x).sum()  # the parent's intra-op thread pool is now live before forking
    assert run_distributed(_noisy_matmul, 2, 64, timeout=60) == [64.0, 64.0]


def test_spawn_start_method_also_works() -> None:
    # One rank only: every spawned child re-imports torch (seconds each on 2 cores).
    results = launch_local(_describe, 1, args=(1,), kwargs={"scale": 2.0}, timeout=120,
                           start_method="spawn")
    assert results == [(0, 1, "gloo", 1, 2.0)]


_KEPT: list[object] = []


def _leave_a_manager_running() -> int:
    import multiprocessing

    # As megatron-core's checkpoint writer does: a queue of a Manager process kept in a
    # global (the rank ends with os._exit: no finalizer shuts the Manager down).
    manager = multiprocessing.get_context("spawn").Manager()
    _KEPT.append(manager.Queue())
    return manager._process.pid


def test_a_rank_leaves_no_process_behind() -> None:
    """What a rank started through multiprocessing and left running (here a Manager kept
    through a global queue) dies with the rank instead of outliving it as an orphan."""
    pids = run_distributed(_leave_a_manager_running, 2, timeout=60)
    time.sleep(0.5)
    alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")
             and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert alive == []


def _lazy_imports() -> tuple[bool, list[str]]:
    """Whether the rank began with torch._dynamo, and the modules that building an optimizer
    and materializing a meta module imported."""
    inherited = "torch._dynamo" in sys.modules
    before = set(sys.modules)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    torch.nn.Linear(2, 3, device="meta").to_empty(device="cpu")  # sympy, by torch._refs
    return inherited, sorted(set(sys.modules) - before)


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="not preloaded on CUDA builds")
def test_forked_ranks_inherit_the_imports_torch_makes_lazily() -> None:
    """An optimizer's constructor imports torch._dynamo (seconds per process): the harness
    imports it once, before forking, and no rank imports it again."""
    assert run_distributed(_lazy_imports, 2, timeout=60) == [(True, [])] * 2


def test_argument_validation() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        run_distributed(_describe, 0, 1)
    with pytest.raises(ValueError, match="timeout must be > 0 seconds, got 0"):
        run_distributed(_describe, 1, 1, timeout=0)
