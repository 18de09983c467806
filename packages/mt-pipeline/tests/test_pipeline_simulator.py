"""The simulator: bubble and memory theory, matching, deadlock detection, timing model."""

from __future__ import annotations

import pytest

from mt_pipeline import (
    Backward,
    CheckedSchedule,
    DeadlockError,
    Exchange,
    Forward,
    LoadMicroBatch,
    MismatchError,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceTiedGrads,
    ScheduleError,
    SendActivation,
    SendGrad,
    checked_schedule,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
)

GRID = [(p, m) for p in (2, 4, 8) for m in (1, 4, 8, 16)]
END = [ReduceTiedGrads(), OptimizerStep()]


@pytest.mark.parametrize("backward_time", [1.0, 2.0])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", GRID)
def test_bubble_matches_theory(name: str, p: int, m: int, backward_time: float) -> None:
    result = simulate(get_schedule(name, p, m), backward_time=backward_time)
    step = 1.0 + backward_time
    assert result.pipeline_time == (m + p - 1) * step
    assert result.busy_time == (m * step,) * p
    assert result.bubble_time == ((p - 1) * step,) * p
    assert result.bubble_fraction == pytest.approx([(p - 1) / m] * p, abs=1e-12)
    assert result.idle_fraction == pytest.approx([(p - 1) / (m + p - 1)] * p, abs=1e-12)


@pytest.mark.parametrize("backward_time", [1.0, 2.0])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m % p == 0])
def test_interleaved_bubble_matches_theory(p: int, m: int, v: int, backward_time: float) -> None:
    # Forward/backward times are per model chunk, i.e. 1/v of a whole stage's layers.
    result = simulate(interleaved_1f1b(p, m, v), backward_time=backward_time)
    step = 1.0 + backward_time
    assert result.virtual_stages == v and result.num_micro_batches == m
    assert result.bubble_time == ((p - 1) * step,) * p
    assert result.bubble_fraction == pytest.approx([(p - 1) / (v * m)] * p, abs=1e-12)


@pytest.mark.parametrize("p,m", GRID)
def test_in_flight_micro_batches(p: int, m: int) -> None:
    assert simulate(gpipe(p, m)).peak_in_flight == (m,) * p
    peaks = simulate(one_f_one_b(p, m)).peak_in_flight
    assert peaks == tuple(min(p - s, m) for s in range(p))
    assert max(peaks) <= p and peaks[0] == min(p, m)


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m % p == 0])
def test_interleaved_in_flight_chunks(p: int, m: int, v: int) -> None:
    # Counted in chunk forwards: the warm-up depth plus the one in the first steady pair.
    peaks = simulate(interleaved_1f1b(p, m, v)).peak_in_flight
    assert peaks == tuple(min(2 * (p - s - 1) + (v - 1) * p + 1, m * v) for s in range(p))


def test_per_stage_times_gpipe_critical_path() -> None:
    tf, tb, m = [1.0, 3.0, 2.0], [2.0, 5.0, 1.0], 4
    result = simulate(gpipe(3, m), forward_time=tf, backward_time=tb)
    # Longest path through the (stage, micro-batch) grid, forwards then backwards.
    assert result.pipeline_time == sum(tf) + sum(tb) + (m - 1) * (max(tf) + max(tb))
    assert result.busy_time == tuple(m * (f + b) for f, b in zip(tf, tb))


def test_p2p_time_rendezvous_model() -> None:
    # p=2, m=1: F0 | send (c) | F0 B0 | send (c) | B0 -> 4 compute units plus 2 hops.
    result = simulate(gpipe(2, 1), p2p_time=0.5)
    assert result.pipeline_time == 5.0
    slower = simulate(one_f_one_b(4, 8), p2p_time=0.1)
    assert slower.pipeline_time > simulate(one_f_one_b(4, 8)).pipeline_time


def test_reduce_tied_grads_waits_for_both_ends() -> None:
    result = simulate(one_f_one_b(4, 4), reduce_time=0.25, optimizer_time=1.0)
    reduce_ends = {}
    for stage, events in enumerate(result.events):
        (reduce,) = [e for e in events if isinstance(e.instruction, ReduceTiedGrads)]
        reduce_ends[stage] = reduce.end
        if stage in (1, 2):
            assert reduce.duration == 0.0
    # Stage 0 finishes last; the last stage waits for it inside the collective.
    assert reduce_ends[0] == reduce_ends[3] == result.pipeline_time + 0.25
    assert result.total_time == result.pipeline_time + 1.25


def _two_stage(stage0_middle: list, stage1_middle: list) -> list[list]:
    stage0 = [LoadMicroBatch(0), Forward(0), Exchange((SendActivation(0, 1),)),
              LoadMicroBatch(1), Forward(1), *stage0_middle, Backward(0),
              Exchange((RecvGrad(1, 1),)), Backward(1), *END]
    stage1 = [Exchange((RecvActivation(0, 0),)), LoadMicroBatch(0), Forward(0), Backward(0),
              *stage1_middle, LoadMicroBatch(1), Forward(1), Backward(1),
              Exchange((SendGrad(1, 0),)), *END]
    return [stage0, stage1]


def test_blocking_sends_in_separate_slots_deadlock() -> None:
    # Each stage sends first and receives later: with rendezvous sends neither send completes.
    schedule = _two_stage(
        [Exchange((SendActivation(1, 1),)), Exchange((RecvGrad(0, 1),))],
        [Exchange((SendGrad(0, 0),)), Exchange((RecvActivation(1, 0),))],
    )
    with pytest.raises(DeadlockError) as error:
        simulate(schedule)
    message = str(error.value)
    assert "stage 0 at instruction 5" in message and "waits for stage 1" in message
    assert "stage 1 at instruction 4" in message and "waits for stage 0" in message


def test_same_ops_batched_in_one_slot_run() -> None:
    schedule = _two_stage(
        [Exchange((SendActivation(1, 1), RecvGrad(0, 1)))],
        [Exchange((SendGrad(0, 0), RecvActivation(1, 0)))],
    )
    result = simulate(schedule)
    assert result.pipeline_time == 6.0 and result.peak_in_flight == (2, 1)
    # Bare (unwrapped) ops are accepted as exchanges of one op.
    bare = _two_stage([SendActivation(1, 1), RecvGrad(0, 1)],
                      [RecvActivation(1, 0), SendGrad(0, 0)])
    assert simulate(bare).pipeline_time == 6.0


def test_fifo_mismatch_is_reported() -> None:
    stage0 = [LoadMicroBatch(0), Forward(0), LoadMicroBatch(1), Forward(1),
              Exchange((SendActivation(0, 1), SendActivation(1, 1))),
              Exchange((RecvGrad(0, 1), RecvGrad(1, 1))), Backward(0), Backward(1), *END]
    # Stage 1 posts its receives in the other order: message 0 (micro-batch 0) lands in the
    # buffer meant for micro-batch 1.
    stage1 = [Exchange((RecvActivation(1, 0), RecvActivation(0, 0))), LoadMicroBatch(0),
              LoadMicroBatch(1), Forward(0), Forward(1), Backward(0), Backward(1),
              Exchange((SendGrad(0, 0), SendGrad(1, 0))), *END]
    with pytest.raises(MismatchError, match="message 0 from stage 0 to stage 1"):
        simulate([stage0, stage1])
    stage1[0] = Exchange((RecvActivation(0, 0), RecvActivation(1, 0)))
    simulate([stage0, stage1])
    stage0[4] = Exchange((SendActivation(0, 1),))
    with pytest.raises(MismatchError, match="sends 1 messages to stage 1, which receives 2"):
        simulate([stage0, stage1])


def test_dataflow_errors() -> None:
    good = one_f_one_b(2, 2)
    no_recv = [good[0], [i for i in good[1] if not isinstance(i, Exchange)]]
    with pytest.raises(ScheduleError, match="forward before its activation is received"):
        simulate(no_recv)
    no_load = [[i for i in good[0] if not isinstance(i, LoadMicroBatch)], good[1]]
    with pytest.raises(ScheduleError, match="before LoadMicroBatch"):
        simulate(no_load)
    missing = [good[0][:-4] + good[0][-2:], good[1]]
    with pytest.raises(ScheduleError, match="no backward"):
        simulate(missing)
    with pytest.raises(ScheduleError, match="peer"):
        simulate([[Exchange((SendActivation(0, 5),)), *END]])
    with pytest.raises(ScheduleError, match="one per stage"):
        simulate(good, forward_time=[1.0, 2.0, 3.0])


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2)])
def test_a_checked_schedule_simulates_as_the_schedule_and_is_built_once(name: str,
                                                                        v: int) -> None:
    """What the checks found travels with the checked schedule: simulating it gives every
    event, peak and time the unchecked one gives; the same arguments give the same object;
    a schedule that fails a check is no CheckedSchedule."""
    plain = get_schedule(name, 4, 8, v)
    checked = checked_schedule(name, 4, 8, v)
    assert checked is checked_schedule(name, 4, 8, v) and checked == CheckedSchedule(plain)
    times = {"forward_time": [1.0, 1.5, 1.0, 2.0], "backward_time": 2.0, "p2p_time": 0.25}
    assert simulate(checked, **times) == simulate(plain, **times)
    assert (checked.micro_batches, checked.chunks) == (8, v)
    good = one_f_one_b(2, 2)
    with pytest.raises(ScheduleError, match="no backward"):
        CheckedSchedule([good[0][:-4] + good[0][-2:], good[1]])


@pytest.mark.parametrize("p", [1, 3, 5, 6])
def test_odd_shapes_run_and_match_theory(p: int) -> None:
    # Stage counts outside the main grid (odd ones too: the interleaved ring then has odd
    # length, where parity-based send/recv ordering would fail) and uneven per-stage times.
    for m in (1, 2, 3, 5, 6, 12):
        for name in ("gpipe", "1f1b"):
            result = simulate(get_schedule(name, p, m), backward_time=3.0)
            assert result.bubble_fraction == pytest.approx([(p - 1) / m] * p, abs=1e-12)
            simulate(get_schedule(name, p, m), forward_time=list(range(1, p + 1)), p2p_time=0.3)
        for v in (2, 4):
            if p > 1 and m % p == 0:
                result = simulate(interleaved_1f1b(p, m, v))
                assert result.bubble_fraction == pytest.approx([(p - 1) / (v * m)] * p)
                simulate(interleaved_1f1b(p, m, v), backward_time=[2.0] * (p - 1) + [5.0],
                         p2p_time=0.2)
