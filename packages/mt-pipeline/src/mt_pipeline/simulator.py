"""Run the instruction lists of all pipeline stages together, without processes.

``simulate`` checks a schedule (static dataflow on every stage, FIFO matching of every send with
its receive, no deadlock under rendezvous semantics), counts in-flight micro-batches and computes
a timeline with given compute and communication times.

Timing model: a compute instruction starts when its stage is free (its inputs arrived in the
preceding :class:`~mt_pipeline.schedules.Exchange`). An exchange posts all its ops when the stage
reaches it; each op completes ``p2p_time`` after both it and its counterpart are posted (a send
blocks until its receive is posted: rendezvous, the strictest semantics), and the exchange ends
when all its ops complete. ``ReduceTiedGrads`` ends ``reduce_time`` after both the first and the
last stage reach it.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mt_pipeline.checks import (
    SENDS,
    MismatchError,
    channel,
    check_dataflow,
    check_matching,
    ops_of,
    peak_in_flight,
)
from mt_pipeline.schedules import (
    Backward,
    Forward,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    P2POp,
    ReduceTiedGrads,
    ScheduleError,
    get_schedule,
)

__all__ = [
    "CheckedSchedule",
    "DeadlockError",
    "Event",
    "MismatchError",
    "SimulationResult",
    "check_dataflow",
    "check_matching",
    "checked_schedule",
    "peak_in_flight",
    "simulate",
]


class DeadlockError(ScheduleError):
    """No stage can make progress; the message lists each stuck stage and instruction."""


class CheckedSchedule(tuple[tuple[Instruction, ...], ...]):
    """A schedule, immutable, that passed :func:`check_dataflow` and :func:`check_matching`,
    with what they found (``micro_batches``, ``chunks``, each stage's ``peak_in_flight``):
    :func:`simulate` does not check it again."""

    micro_batches: int
    chunks: int
    peak_in_flight: tuple[int, ...]

    def __new__(cls, schedule: Iterable[Iterable[Instruction]]) -> CheckedSchedule:
        stages = tuple(tuple(stage) for stage in schedule)
        m, v = check_dataflow(stages)
        check_matching(stages)
        checked = super().__new__(cls, stages)
        checked.micro_batches, checked.chunks = m, v
        checked.peak_in_flight = tuple(peak_in_flight(stage) for stage in stages)
        return checked


@functools.lru_cache(maxsize=8)  # a schedule of thousands of micro-batches is large
def checked_schedule(name: str, num_stages: int, num_micro_batches: int,
                     virtual_stages: int = 1) -> CheckedSchedule:
    """:func:`~mt_pipeline.schedules.get_schedule`'s schedule, checked; built once per
    process for each set of arguments (a planner simulates one schedule under many
    timings, and building and checking a 35-stage schedule of hundreds of micro-batches
    takes longer than simulating it)."""
    return CheckedSchedule(get_schedule(name, num_stages, num_micro_batches, virtual_stages))


@dataclass(frozen=True)
class Event:
    """One executed instruction of one stage on the simulated clock."""

    stage: int
    start: float
    end: float
    instruction: Instruction

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start


@dataclass(frozen=True)
class SimulationResult:
    """Timeline and statistics of one simulated schedule.

    ``pipeline_time`` is when the last backward of any stage ends (the flush); bubble numbers
    are measured against it. ``bubble_fraction`` is bubble time over ideal compute time, as in
    Narayanan et al. 2021 ((p - 1) / m for 1F1B); ``idle_fraction`` is bubble time over
    ``pipeline_time``. Communication time counts as bubble.
    """

    num_stages: int
    virtual_stages: int
    num_micro_batches: int
    events: tuple[tuple[Event, ...], ...]
    peak_in_flight: tuple[int, ...]
    busy_time: tuple[float, ...]
    pipeline_time: float
    total_time: float

    @property
    def bubble_time(self) -> tuple[float, ...]:
        """Per stage: ``pipeline_time`` minus that stage's forward and backward time."""
        return tuple(self.pipeline_time - busy for busy in self.busy_time)

    @property
    def bubble_fraction(self) -> tuple[float, ...]:
        """Per stage: bubble time / ideal compute time (Narayanan et al.)."""
        return tuple(idle / busy for idle, busy in zip(self.bubble_time, self.busy_time))

    @property
    def idle_fraction(self) -> tuple[float, ...]:
        """Per stage: bubble time / ``pipeline_time``."""
        return tuple(idle / self.pipeline_time for idle in self.bubble_time)


def _per_stage(value: float | Sequence[float], p: int, name: str) -> list[float]:
    values = [float(value)] * p if isinstance(value, (int, float)) else [float(x) for x in value]
    if len(values) != p or any(x < 0 for x in values):
        raise ScheduleError(f"{name} must be >= 0, one value or one per stage ({p}), got {value}")
    return values


class _Clock:
    """Mutable state of one simulation run (kept out of the pure functions)."""

    def __init__(self, schedule: Sequence[Sequence[Instruction]]) -> None:
        self.schedule = schedule
        p = len(schedule)
        self.pc = [0] * p
        self.time = [0.0] * p
        self.posted_at: list[float | None] = [None] * p
        # FIFO position of every op: its index among same-direction ops on its channel.
        self.position: list[list[list[int]]] = []
        counts: dict[tuple[int, int, bool], int] = defaultdict(int)
        for stage, instructions in enumerate(schedule):
            per_instruction = []
            for ins in instructions:
                slots = []
                for op in ops_of(ins):
                    key = (*channel(stage, op), isinstance(op, SENDS))
                    slots.append(counts[key])
                    counts[key] += 1
                per_instruction.append(slots)
            self.position.append(per_instruction)
        self.post_times: dict[tuple[int, int, bool], list[float]] = defaultdict(list)
        self.arrivals: dict[int, list[float | None]] = defaultdict(lambda: [None] * p)
        self.reduce_count = [0] * p
        self.events: list[list[Event]] = [[] for _ in range(p)]

    def post_exchange(self, stage: int, ops: tuple[P2POp, ...]) -> None:
        """Post the ops of the stage's current exchange (once)."""
        if self.posted_at[stage] is not None:
            return
        self.posted_at[stage] = self.time[stage]
        for op, slot in zip(ops, self.position[stage][self.pc[stage]]):
            times = self.post_times[(*channel(stage, op), isinstance(op, SENDS))]
            assert len(times) == slot, "a stage posts its ops on a channel in order"
            times.append(self.time[stage])

    def unmatched(self, stage: int, ops: tuple[P2POp, ...]) -> list[P2POp]:
        """Ops of the current exchange whose counterpart is not posted yet."""
        waiting = []
        for op, slot in zip(ops, self.position[stage][self.pc[stage]]):
            if len(self.post_times[(*channel(stage, op), not isinstance(op, SENDS))]) <= slot:
                waiting.append(op)
        return waiting

    def finish_exchange(self, stage: int, ops: tuple[P2POp, ...], p2p_time: float) -> float:
        posted = self.posted_at[stage]
        assert posted is not None
        end = posted
        for op, slot in zip(ops, self.position[stage][self.pc[stage]]):
            other = self.post_times[(*channel(stage, op), not isinstance(op, SENDS))][slot]
            end = max(end, max(posted, other) + p2p_time)
        self.posted_at[stage] = None
        return end

    def try_reduce(self, stage: int, reduce_time: float) -> float | None:
        """ReduceTiedGrads: a collective of the first and last stage; a no-op elsewhere."""
        p = len(self.schedule)
        members = sorted({0, p - 1})
        if stage not in members:
            return self.time[stage]
        arrivals = self.arrivals[self.reduce_count[stage]]
        if arrivals[stage] is None:
            arrivals[stage] = self.time[stage]
        times = [arrivals[m] for m in members]
        if any(t is None for t in times):
            return None
        self.reduce_count[stage] += 1
        return max(t for t in times if t is not None) + reduce_time


@dataclass(frozen=True)
class _Costs:
    forward: list[float]
    backward: list[float]
    p2p: float
    reduce: float
    optimizer: float
    load: float


def _step(clock: _Clock, stage: int, ins: Instruction, costs: _Costs) -> float | None:
    """End time of ``ins`` if it can complete now, else None (the stage waits)."""
    now = clock.time[stage]
    if isinstance(ins, Forward):
        return now + costs.forward[stage]
    if isinstance(ins, Backward):
        return now + costs.backward[stage]
    if isinstance(ins, LoadMicroBatch):
        return now + costs.load
    if isinstance(ins, OptimizerStep):
        return now + costs.optimizer
    if isinstance(ins, ReduceTiedGrads):
        return clock.try_reduce(stage, costs.reduce)
    ops = ops_of(ins)
    if not ops:
        raise ScheduleError(f"stage {stage}: unknown instruction {ins!r}")
    clock.post_exchange(stage, ops)
    if clock.unmatched(stage, ops):
        return None
    return clock.finish_exchange(stage, ops, costs.p2p)


def _deadlock_message(clock: _Clock) -> str:
    lines = ["pipeline schedule deadlocks; stuck stages:"]
    for stage, instructions in enumerate(clock.schedule):
        if clock.pc[stage] >= len(instructions):
            continue
        ins = instructions[clock.pc[stage]]
        ops = ops_of(ins)
        waiting = clock.unmatched(stage, ops) if ops else []
        detail = "; ".join(f"{op} waits for stage {op.peer}" for op in waiting)
        if isinstance(ins, ReduceTiedGrads):
            detail = "waits for the other stage of the embedding group"
        lines.append(f"  stage {stage} at instruction {clock.pc[stage]} {ins}: {detail}")
    return "\n".join(lines)


def simulate(
    schedule: Sequence[Sequence[Instruction]],
    *,
    forward_time: float | Sequence[float] = 1.0,
    backward_time: float | Sequence[float] = 1.0,
    p2p_time: float = 0.0,
    reduce_time: float = 0.0,
    optimizer_time: float = 0.0,
    load_time: float = 0.0,
) -> SimulationResult:
    """Check ``schedule`` and run all stages together on a simulated clock.

    ``forward_time`` / ``backward_time`` are the time of one Forward / Backward instruction (one
    model chunk), either one number or one per stage. Raises :class:`ScheduleError` on a
    dataflow error, :class:`MismatchError` when sends and receives do not pair up and
    :class:`DeadlockError` when the stages block each other.
    """
    if isinstance(schedule, CheckedSchedule):
        m, v, peaks = schedule.micro_batches, schedule.chunks, schedule.peak_in_flight
    else:
        m, v = check_dataflow(schedule)
        check_matching(schedule)
        peaks = tuple(peak_in_flight(ins) for ins in schedule)
    p = len(schedule)
    costs = _Costs(
        _per_stage(forward_time, p, "forward_time"),
        _per_stage(backward_time, p, "backward_time"),
        float(p2p_time),
        float(reduce_time),
        float(optimizer_time),
        float(load_time),
    )
    clock = _Clock(schedule)
    progress = True
    while progress:
        progress = False
        for stage, instructions in enumerate(schedule):
            while clock.pc[stage] < len(instructions):
                ins = instructions[clock.pc[stage]]
                end = _step(clock, stage, ins, costs)
                if end is None:
                    break
                clock.events[stage].append(Event(stage, clock.time[stage], end, ins))
                clock.time[stage] = end
                clock.pc[stage] += 1
                progress = True
    if any(pc < len(ins) for pc, ins in zip(clock.pc, schedule)):
        raise DeadlockError(_deadlock_message(clock))
    compute = [[e for e in ev if isinstance(e.instruction, (Forward, Backward))]
               for ev in clock.events]
    return SimulationResult(
        num_stages=p,
        virtual_stages=v,
        num_micro_batches=m,
        events=tuple(tuple(ev) for ev in clock.events),
        peak_in_flight=peaks,
        busy_time=tuple(sum(e.duration for e in ev) for ev in compute),
        pipeline_time=max((e.end for ev in compute for e in ev), default=0.0),
        total_time=max((e.end for ev in clock.events for e in ev), default=0.0),
    )
