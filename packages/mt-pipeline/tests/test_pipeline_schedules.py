"""Structure of the generated schedules (pure, no processes)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from mt_pipeline import (
    DEFAULT_SCHEDULE,
    SCHEDULES,
    Backward,
    Exchange,
    Forward,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceTiedGrads,
    ScheduleError,
    SendActivation,
    SendGrad,
    __version__,
    chunked_schedules,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
)


def compute_order(instructions: list) -> list[tuple[str, int, int]]:
    return [
        ("F" if isinstance(i, Forward) else "B", i.micro_batch, i.chunk)
        for i in instructions
        if isinstance(i, (Forward, Backward))
    ]


def test_version() -> None:
    assert __version__ == "0.1.0"


def test_instructions_are_frozen_and_hashable() -> None:
    op = SendActivation(micro_batch=3, peer=1, chunk=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.micro_batch = 4  # type: ignore[misc]
    assert {op, SendActivation(3, 1, 0)} == {op}
    assert Forward(2) == Forward(2, 0)
    with pytest.raises(ScheduleError, match="at least one op"):
        Exchange(())


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_every_stage_ends_with_reduce_then_step(name: str, v: int) -> None:
    for stage in get_schedule(name, 4, 8, v):
        assert stage[-2:] == [ReduceTiedGrads(), OptimizerStep()]
        assert sum(isinstance(i, OptimizerStep) for i in stage) == 1


def test_gpipe_order_all_forwards_then_all_backwards() -> None:
    schedule = gpipe(3, 4)
    for stage in schedule:
        order = compute_order(stage)
        assert order == [("F", i, 0) for i in range(4)] + [("B", i, 0) for i in range(4)]


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (8, 16), (2, 1)])
def test_one_f_one_b_warmup_steady_cooldown(p: int, m: int) -> None:
    for s, stage in enumerate(one_f_one_b(p, m)):
        order = compute_order(stage)
        warmup = min(p - s - 1, m)
        assert order[:warmup] == [("F", i, 0) for i in range(warmup)]
        steady = order[warmup: warmup + 2 * (m - warmup)]
        expected = [x for k in range(m - warmup) for x in (("F", warmup + k, 0), ("B", k, 0))]
        assert steady == expected
        assert order[warmup + 2 * (m - warmup):] == [("B", k, 0) for k in range(m - warmup, m)]


def test_one_f_one_b_steady_state_combines_send_and_recv() -> None:
    # Stage 1 of 4, after F(w+k): send its activation and receive the gradient for B(k) in one
    # batch (Megatron's send_forward_recv_backward).
    stage = one_f_one_b(4, 8)[1]
    index = stage.index(Forward(4))
    assert stage[index + 1] == Exchange((SendActivation(4, peer=2), RecvGrad(2, peer=2)))
    assert stage[index + 2] == Backward(2)
    assert stage[index + 3] == Exchange((SendGrad(2, peer=0), RecvActivation(5, peer=0)))


def test_all_p2p_ops_are_inside_exchanges_and_loads_on_end_stages() -> None:
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 3)):
        schedule = get_schedule(name, 4, 8, v)
        for s, stage in enumerate(schedule):
            bare = [i for i in stage if isinstance(i, (SendActivation, RecvActivation,
                                                        SendGrad, RecvGrad))]
            assert bare == []
            loads = [i.micro_batch for i in stage if isinstance(i, LoadMicroBatch)]
            assert loads == (list(range(8)) if s in (0, 3) else [])


def test_single_stage_has_no_communication() -> None:
    for name in ("gpipe", "1f1b"):
        (stage,) = get_schedule(name, 1, 3)
        assert not any(isinstance(i, Exchange) for i in stage)
        assert [i for i in stage if isinstance(i, LoadMicroBatch)] == [LoadMicroBatch(i)
                                                                       for i in range(3)]


def test_interleaved_chunk_order_and_peers() -> None:
    p, m, v = 2, 4, 2
    schedule = interleaved_1f1b(p, m, v)
    forwards = [(i.micro_batch, i.chunk) for i in schedule[0] if isinstance(i, Forward)]
    # Groups of p micro-batches visit chunk 0 then chunk 1.
    assert forwards == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    backwards = [(i.micro_batch, i.chunk) for i in schedule[0] if isinstance(i, Backward)]
    assert backwards == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    ops = [op for i in schedule[1] if isinstance(i, Exchange) for op in i.ops]
    # Stage 1 chunk 0 (virtual stage 1) feeds stage 0 chunk 1 (virtual stage 2): wrap-around.
    assert SendActivation(0, peer=0, chunk=0) in ops
    assert RecvGrad(0, peer=0, chunk=0) in ops
    # The last virtual stage (stage 1, chunk 1) neither sends activations nor receives grads.
    assert not any(isinstance(op, SendActivation) and op.chunk == 1 for op in ops)
    assert not any(isinstance(op, RecvGrad) and op.chunk == 1 for op in ops)


def test_interleaved_needs_micro_batches_multiple_of_stages() -> None:
    with pytest.raises(ScheduleError, match=r"num_micro_batches \(6\).*num_stages \(4\)"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ScheduleError, match=r"num_micro_batches \(2\).*num_stages \(4\)"):
        get_schedule("interleaved", 4, 2, 2)
    with pytest.raises(ScheduleError, match="virtual_stages=1"):
        interleaved_1f1b(4, 8, 1)
    with pytest.raises(ScheduleError, match="num_stages=1"):
        interleaved_1f1b(1, 8, 2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_sizes_are_rejected(bad: object) -> None:
    with pytest.raises(ScheduleError, match="num_micro_batches"):
        one_f_one_b(2, bad)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="num_stages"):
        gpipe(bad, 2)  # type: ignore[arg-type]


def test_dispatcher() -> None:
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved"}
    assert get_schedule("1f1b", 4, 8) == one_f_one_b(4, 8)
    assert get_schedule("gpipe", 2, 3) == gpipe(2, 3)
    assert get_schedule("interleaved", 2, 4, 3) == interleaved_1f1b(2, 4, 3)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
        get_schedule("zb", 2, 2)
    with pytest.raises(ScheduleError, match="one chunk per stage, got virtual_stages 2"):
        get_schedule("1f1b", 2, 4, virtual_stages=2)
    with pytest.raises(TypeError):
        SCHEDULES["mine"] = gpipe  # type: ignore[index]


def test_traits_agree_with_the_builders_and_the_simulator() -> None:
    """Every schedule's traits are what its builder does: ``problems`` is empty exactly when
    the builder accepts (p, m, v), and ``peak`` is the simulator's count of chunk forwards
    alive, for every small (p, m, v)."""
    for spec in SCHEDULES.values():
        for p, m, v in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 6, 8), (1, 2, 3)):
            try:
                schedule = get_schedule(spec.name, p, m, v)
            except ScheduleError:
                assert spec.problems(p, m, v), (spec.name, p, m, v)
                continue
            assert spec.problems(p, m, v) == [], (spec.name, p, m, v)
            assert spec.peak(p, m, v) == list(simulate(schedule).peak_in_flight), \
                (spec.name, p, m, v)
    assert DEFAULT_SCHEDULE in SCHEDULES and chunked_schedules() == ["interleaved"]
