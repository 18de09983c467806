"""Measured timelines: the executor's recorded events as a :class:`SimulationResult`.

The executor can time-stamp every instruction (``PipelineExecutor.run(record=True)``). Once
the stages' event lists are gathered in one place, :func:`measured_timeline` shifts them to a
common zero (the earliest event) and packs them like a simulation, so the same bubble
statistics, Chrome trace and PNG apply to a real run as to a simulated one.
"""

from __future__ import annotations

from collections.abc import Sequence

from mt_pipeline.checks import peak_in_flight
from mt_pipeline.schedules import Backward, Forward
from mt_pipeline.simulator import Event, SimulationResult

__all__ = ["measured_timeline"]


def measured_timeline(
    events: Sequence[Sequence[Event]], virtual_stages: int, num_micro_batches: int
) -> SimulationResult:
    """Pack per-stage measured ``events`` (index = stage; timestamps in seconds from one
    clock, e.g. ``time.perf_counter`` on one machine) into a :class:`SimulationResult`.

    ``bubble_fraction`` is then the measured (idle until the flush) / (forward + backward
    time) of every stage, directly comparable with the simulator's and the theory's.
    """
    if not events or any(not stage_events for stage_events in events):
        raise ValueError("measured_timeline needs at least one event for every stage")
    zero = min(e.start for stage_events in events for e in stage_events)
    shifted = tuple(
        tuple(Event(stage, e.start - zero, e.end - zero, e.instruction) for e in stage_events)
        for stage, stage_events in enumerate(events)
    )
    compute = [[e for e in ev if isinstance(e.instruction, (Forward, Backward))] for ev in shifted]
    if any(not c for c in compute):
        raise ValueError("every stage needs forward / backward events")
    return SimulationResult(
        num_stages=len(events),
        virtual_stages=virtual_stages,
        num_micro_batches=num_micro_batches,
        events=shifted,
        peak_in_flight=tuple(peak_in_flight([e.instruction for e in ev]) for ev in shifted),
        busy_time=tuple(sum(e.duration for e in c) for c in compute),
        pipeline_time=max(e.end for c in compute for e in c),
        total_time=max(e.end for ev in shifted for e in ev),
    )
