"""Write a simulated pipeline timeline as a Chrome trace (JSON) or a PNG picture.

The JSON opens in chrome://tracing and https://ui.perfetto.dev: one process per stage, one
thread for compute and one for communication. The PNG needs matplotlib (the optional extra
``mt-pipeline[plot]``), imported only when a PNG is requested.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mt_pipeline.schedules import Backward, Exchange, Forward, Instruction
from mt_pipeline.simulator import Event, SimulationResult

__all__ = ["event_name", "to_chrome_trace", "write_chrome_trace", "write_png"]

_COMPUTE_TID = 0
_COMM_TID = 1


def event_name(instruction: Instruction, virtual_stages: int = 1) -> str:
    """Short label: ``F3`` / ``B3`` (micro-batch 3), ``F3c1`` with chunk 1 when interleaved."""
    if isinstance(instruction, (Forward, Backward)):
        kind = "F" if isinstance(instruction, Forward) else "B"
        chunk = f"c{instruction.chunk}" if virtual_stages > 1 else ""
        return f"{kind}{instruction.micro_batch}{chunk}"
    if isinstance(instruction, Exchange):
        return "p2p"
    return type(instruction).__name__


def _args(instruction: Instruction) -> dict[str, Any]:
    if isinstance(instruction, Exchange):
        return {"ops": [repr(op) for op in instruction.ops]}
    return {k: v for k, v in vars(instruction).items()}


def _trace_event(event: Event, virtual_stages: int, us_per_unit: float) -> dict[str, Any]:
    compute = isinstance(event.instruction, (Forward, Backward))
    return {
        "name": event_name(event.instruction, virtual_stages),
        "cat": "compute" if compute else "communication",
        "ph": "X",
        "ts": event.start * us_per_unit,
        "dur": event.duration * us_per_unit,
        "pid": event.stage,
        "tid": _COMPUTE_TID if compute else _COMM_TID,
        "args": _args(event.instruction),
    }


def to_chrome_trace(result: SimulationResult, us_per_unit: float = 1000.0) -> dict[str, Any]:
    """The timeline as a Chrome trace dict (``{"traceEvents": [...]}``).

    Every forward and backward becomes a complete ("X") event; other instructions only when they
    take time. ``us_per_unit`` converts simulated time units to trace microseconds.
    """
    events: list[dict[str, Any]] = []
    for stage in range(result.num_stages):
        events.append(
            {"name": "process_name", "ph": "M", "pid": stage, "args": {"name": f"stage {stage}"}}
        )
        events.append({"name": "process_sort_index", "ph": "M", "pid": stage,
                       "args": {"sort_index": stage}})
        for tid, label in ((_COMPUTE_TID, "compute"), (_COMM_TID, "p2p / collectives")):
            events.append({"name": "thread_name", "ph": "M", "pid": stage, "tid": tid,
                           "args": {"name": label}})
    for stage_events in result.events:
        for event in stage_events:
            compute = isinstance(event.instruction, (Forward, Backward))
            if compute or event.duration > 0:
                events.append(_trace_event(event, result.virtual_stages, us_per_unit))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "num_stages": result.num_stages,
            "num_micro_batches": result.num_micro_batches,
            "virtual_stages": result.virtual_stages,
            "bubble_fraction": list(result.bubble_fraction),
        },
    }


def write_chrome_trace(
    result: SimulationResult, path: str | Path, us_per_unit: float = 1000.0
) -> Path:
    """Write :func:`to_chrome_trace` as JSON to ``path``; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(result, us_per_unit), indent=1))
    return path


def _colour(instruction: Forward | Backward, virtual_stages: int) -> tuple[float, float, float]:
    # Forwards blue, backwards orange; later chunks darker so interleaving stays readable.
    shade = instruction.chunk / max(virtual_stages - 1, 1)
    if isinstance(instruction, Forward):
        light, dark = (0.62, 0.79, 0.95), (0.13, 0.35, 0.65)
    else:
        light, dark = (0.99, 0.75, 0.47), (0.80, 0.38, 0.05)
    return tuple(a + (b - a) * shade for a, b in zip(light, dark))  # type: ignore[return-value]


def write_png(
    result: SimulationResult,
    path: str | Path,
    title: str | None = None,
    width: float | None = None,
) -> Path:
    """Draw the compute timeline (one row per stage, stage 0 on top) as a PNG at ``path``.

    Bars are labelled with the micro-batch number; forwards are blue, backwards orange, darker
    for later model chunks. Requires matplotlib (``pip install mt-pipeline[plot]``).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # pants: no-infer-dep
        from matplotlib.figure import Figure  # pants: no-infer-dep
        from matplotlib.patches import Patch  # pants: no-infer-dep
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("write_png needs matplotlib: pip install 'mt-pipeline[plot]'") from error
    p, end = result.num_stages, max(result.total_time, 1e-9)
    # Figure objects directly (not pyplot): no global backend or figure state is touched.
    fig = Figure(figsize=(width or min(max(8.0, end * 0.25), 40.0), 1.0 + 0.55 * p), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for stage_events in result.events:
        for event in stage_events:
            ins = event.instruction
            if not isinstance(ins, (Forward, Backward)):
                continue
            y = p - 1 - event.stage
            ax.barh(y, event.duration, left=event.start, height=0.8, edgecolor="black",
                    linewidth=0.5, color=_colour(ins, result.virtual_stages))
            dark = ins.chunk > 0 and ins.chunk >= (result.virtual_stages - 1) / 2
            ax.text(event.start + event.duration / 2, y, str(ins.micro_batch), ha="center",
                    va="center", fontsize=7, color="white" if dark else "black")
    ax.set_yticks(range(p), [f"stage {s}" for s in reversed(range(p))])
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    bubble = max(result.bubble_fraction) if result.bubble_fraction else 0.0
    heading = title or "pipeline schedule"
    ax.set_title(f"{heading}: p={p}, m={result.num_micro_batches}, "
                 f"v={result.virtual_stages}, bubble={bubble:.3f}")
    v = result.virtual_stages
    handles = [
        Patch(color=_colour(kind(0, c), v), label=f"{name} chunk {c}" if v > 1 else name)
        for kind, name in ((Forward, "forward"), (Backward, "backward"))
        for c in range(v)
    ]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.005, 0.5), fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
