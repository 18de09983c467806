"""Chrome trace JSON and PNG export of simulated timelines."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from mt_pipeline import (
    Backward,
    Exchange,
    Forward,
    event_name,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    to_chrome_trace,
    write_chrome_trace,
    write_png,
)

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_event_names() -> None:
    assert event_name(Forward(3)) == "F3"
    assert event_name(Backward(3, 1), virtual_stages=2) == "B3c1"
    assert event_name(Forward(0, 0), virtual_stages=2) == "F0c0"


def test_chrome_trace_structure(tmp_path: Path) -> None:
    p, m = 4, 8
    result = simulate(one_f_one_b(p, m), backward_time=2.0, p2p_time=0.1)
    path = write_chrome_trace(result, tmp_path / "1f1b.json", us_per_unit=1000.0)
    trace = json.loads(path.read_text())
    assert trace == to_chrome_trace(result)
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {s: f"stage {s}" for s in range(p)}
    compute = [e for e in events if e["ph"] == "X" and e["cat"] == "compute"]
    assert len(compute) == 2 * p * m
    for stage in range(p):
        labels = [e["name"] for e in compute if e["pid"] == stage]
        assert sorted(labels) == sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
    for e in compute:
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid"}
        assert e["dur"] == pytest.approx(1000.0 if e["name"].startswith("F") else 2000.0)
    # Communication lands on its own thread and only where it takes time.
    comm = [e for e in events if e["ph"] == "X" and e["cat"] == "communication"]
    assert comm and all(e["tid"] == 1 and e["dur"] > 0 for e in comm)
    last_end = max(e["ts"] + e["dur"] for e in compute)
    assert last_end == pytest.approx(result.pipeline_time * 1000.0)
    assert trace["otherData"]["bubble_fraction"] == list(result.bubble_fraction)


def test_chrome_trace_interleaved_names_chunks() -> None:
    trace = to_chrome_trace(simulate(interleaved_1f1b(2, 4, 2)))
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0}
    assert {"F0c0", "F0c1", "B3c0", "B3c1"} <= names
    args = [e["args"] for e in trace["traceEvents"] if e.get("name") == "F2c1"]
    assert args and all(a == {"micro_batch": 2, "chunk": 1} for a in args)


def test_exchange_args_list_ops() -> None:
    result = simulate(one_f_one_b(2, 2), p2p_time=0.5)
    comm = [e for e in to_chrome_trace(result)["traceEvents"] if e.get("name") == "p2p"]
    assert comm and all(e["args"]["ops"] for e in comm)
    assert any(isinstance(e.instruction, Exchange) for e in result.events[0])


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib not installed (extra mt-pipeline[plot])")
def test_png_is_written(tmp_path: Path) -> None:
    result = simulate(interleaved_1f1b(4, 8, 2), backward_time=2.0)
    path = write_png(result, tmp_path / "interleaved.png", title="interleaved 1F1B")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
