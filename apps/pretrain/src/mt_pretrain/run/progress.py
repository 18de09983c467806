"""What rank 0 shows while training: a rich progress bar on a terminal, log lines otherwise."""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["Reporter"]


def _mfu(stats: Any) -> str:
    """``MFU 12.3%`` (model FLOPs utilization of this step; ``MFU n/a`` without a peak)."""
    mfu = getattr(stats, "mfu", float("nan"))
    return "MFU n/a" if math.isnan(mfu) else f"MFU {100 * mfu:.1f}%"


def _memory(stats: Any) -> str:
    """`` mem 1.23 GiB`` (peak memory so far, max over ranks; empty when not measured)."""
    peak = getattr(stats, "peak_mem_gib", None)
    return "" if peak is None else f" mem {peak:.2f} GiB"


#: Columns of the live line besides the numbers: "step", the bar, elapsed time, "eta", the
#: remaining time and the gaps (the step counts come on top).
BAR_COLUMNS = 40


def _fit(parts: list[str], room: int) -> str:
    """As many of ``parts`` (in order, empty ones skipped) as fit in ``room`` characters."""
    out = ""
    for part in filter(None, parts):
        joined = f"{out} {part}" if out else part
        if len(joined) > room:
            break
        out = joined
    return out


class Reporter:
    """Progress display of rank 0 (every other rank passes ``enabled=False``).

    Args:
        total: the run's last step.
        start: the step training resumes after (0 for a fresh run).
        enabled: False on ranks other than 0.
        bar: show a live bar (only effective when the console is a terminal).
        log_interval: steps between log lines when no bar is shown.
    """

    def __init__(self, total: int, start: int, enabled: bool, bar: bool,
                 log_interval: int, console: Console | None = None) -> None:
        self.enabled, self.total, self.log_interval = enabled, total, log_interval
        self.console = console or Console(soft_wrap=True)
        self._progress: Progress | None = None
        self._task: Any = None
        self._tokens_per_s: float | None = None
        self._start = time.perf_counter()
        if enabled and bar and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(bar_width=16),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("eta"),
                TimeRemainingColumn(), console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=total, completed=start,
                                                 info="")
            self._progress.start()

    def print(self, text: str) -> None:
        """A line of text above the bar (rank 0 only)."""
        if self.enabled:
            self.console.print(text, highlight=False, markup=False)

    def step(self, stats: Any) -> None:
        """Show one step's numbers."""
        if not self.enabled:
            return
        # Smooth tokens/s: the first steps include warm-up costs.
        rate = stats.tokens_per_s
        self._tokens_per_s = rate if self._tokens_per_s is None else (
            0.8 * self._tokens_per_s + 0.2 * rate)
        parts = [f"loss {stats.loss:.4f}", f"{self._tokens_per_s:,.0f} tok/s", _mfu(stats),
                 _memory(stats).strip(), f"lr {stats.lr:.1e}",
                 f"{stats.tflops_per_rank * 1e3:.2f} GFLOP/s/rank"]
        if self._progress is not None:
            # The step, bar, times and ETA take BAR_COLUMNS; the numbers get what is left, the
            # most telling first, so a narrow terminal keeps the whole line on one row.
            room = max(self.console.width - BAR_COLUMNS - len(str(self.total)) * 2, 12)
            self._progress.update(self._task, completed=stats.step, info=_fit(parts, room))
            return
        info = " ".join([parts[0], parts[4], parts[1], parts[2], parts[5]]) + _memory(stats)
        if stats.step % self.log_interval == 0 or stats.step == self.total:
            self.console.print(f"step {stats.step:>6}/{self.total}  {info}  grad norm "
                               f"{stats.grad_norm:.3f}", highlight=False)

    def close(self) -> None:
        """Stop the live display."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
