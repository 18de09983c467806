"""mt_dist.restarts: a failed attempt of real local ranks is started again, with its every
rank's last words kept; the launcher's restart count is read from its variable."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from mt_dist.exits import LaunchFailed
from mt_dist.restarts import Restart, launcher_restart, supervise_restarting


def _dies_once(rank: int, marker: str, restart: Restart | None) -> Any:
    """Rank 1 SIGKILLs itself on the first attempt (the marker file says it did)."""
    if rank == 1 and not Path(marker).exists():
        Path(marker).write_text("died")
        os.kill(os.getpid(), signal.SIGKILL)
    return None if restart is None else (restart.count, restart.cause)


def test_a_killed_rank_is_restarted_and_its_last_words_kept(tmp_path: Path) -> None:
    marker = str(tmp_path / "died")
    value = supervise_restarting(_dies_once, 2, lambda r: (marker, r), 1, tmp_path, 60)
    assert value == (1, "rank 1 of 2 killed by SIGKILL")
    kept = sorted(p.name for p in (tmp_path / "failure-0").iterdir())
    assert "rank-1.txt" in kept
    assert "died with exit code -9" in (tmp_path / "failure-0" / "rank-1.txt").read_text()


def test_restarts_run_out(tmp_path: Path) -> None:
    with pytest.raises(LaunchFailed, match="every rank's stack: .*failure-0"):
        supervise_restarting(_dies_once, 2, lambda r: (str(tmp_path / "died"), r), 0,
                             tmp_path, 60)


@pytest.mark.parametrize("value", ["abc", "-1", "", "\u00b3", "1.5"])
def test_a_bad_launcher_restart_count_is_refused(value: str) -> None:
    """A restart count that is no non-negative ASCII integer is refused, naming the
    variable: read as 0, a requeued job would not know it continues a run ("\u00b3" passes
    str.isdigit, and int() then raises its own error)."""
    with pytest.raises(ValueError) as caught:
        launcher_restart({"SLURM_RESTART_COUNT": value})
    assert str(caught.value) == (f"SLURM_RESTART_COUNT={value!r} is not a restart count (a "
                                 "whole number >= 0, as the launcher sets it)")


def test_launcher_restart_counts() -> None:
    assert launcher_restart({}) is None
    assert launcher_restart({"TORCHELASTIC_RESTART_COUNT": "0"}) is None
    assert launcher_restart({"TORCHELASTIC_RESTART_COUNT": "2"}) == Restart(
        2, 0, "torchrun restarted the job")
    assert launcher_restart({"SLURM_RESTART_COUNT": "1"}).cause == "SLURM restarted the job"
    assert Restart(1, 2, "rank 0 of 2 hung", "run/failure-0").line("resumed at step 4") == (
        "restart 1 of 2 after rank 0 of 2 hung (every rank's stack: run/failure-0): resumed "
        "at step 4")


def _slot_dies(rank: int, marker: str, victim: int, restart: Restart | None) -> Any:
    """The rank on slot ``victim`` SIGKILLs itself whenever it runs; the others report the
    slot they run on and the world size."""
    slots = restart.slots if restart is not None and restart.slots else None
    slot = slots[rank] if slots else rank
    if slot == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return slots


def test_elastic_restarts_leave_the_failed_slots_out(tmp_path: Path) -> None:
    """4 ranks, slot 1 always fails: the next attempt runs on slots (0, 2, 3) with 3 ranks;
    an ``elastic`` that takes only even sizes continues on 2 of them; too few left: raised."""
    seen: list[int] = []

    def any_size(left: int) -> int | None:
        seen.append(left)
        return left

    assert supervise_restarting(_slot_dies, 4, lambda r: ("", 1, r), 1, tmp_path, 60,
                                elastic=any_size) == (0, 2, 3)
    assert seen == [3]

    def even(left: int) -> int | None:
        return left - left % 2 or None

    assert supervise_restarting(_slot_dies, 4, lambda r: ("", 2, r), 1, tmp_path, 60,
                                elastic=even) == (0, 1)
    with pytest.raises(LaunchFailed, match=r"1 ranks left: too few to continue"):
        supervise_restarting(_slot_dies, 2, lambda r: ("", 0, r), 2, tmp_path, 60,
                             elastic=lambda left: None if left < 2 else left)
    line = Restart(1, 2, "rank 1 of 4 killed by SIGKILL", "", (0, 2, 3), 4).line(
        "resumed from ck at step 6")
    assert line == ("restart 1 of 2 after rank 1 of 4 killed by SIGKILL: continuing on 3 of 4 "
                    "ranks, resumed from ck at step 6")
