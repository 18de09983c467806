"""Per-step metrics: a JSONL file (one object per step) and, optionally, TensorBoard.

Only rank 0 writes. Every line has at least ``step``, ``loss``, ``lr``,
``global_batch_size``, ``tokens`` (consumed so far) and ``tokens_per_s``; lines of
validation steps also carry ``val_loss`` and ``val_ppl``.

Peak memory so far (:mod:`mt_pretrain.run.memory`, gathered from every rank once per step):
``peak_mem_gib``, the largest over the ranks, and ``peak_mem_gib_per_rank``, a list in rank
order (GiB; on CUDA the caching allocator's peak allocated bytes, on CPU the process's peak
RSS, which includes the Python interpreter and torch); on CUDA also ``peak_reserved_gib`` and
``peak_reserved_gib_per_rank`` (the allocator's peak reserved bytes); and ``mem_source``,
``"cuda-allocator"`` or ``"rss"``. TensorBoard gets the numbers only (``train/peak_mem_gib``,
``train/peak_reserved_gib``): lists and strings are not scalars.

A resumed run appends to the same file, dropping lines of steps at or after the resume point
first, so the file always holds one line per step.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "read_metrics"]


class MetricsWriter:
    """Appends metric dicts to ``path`` (JSONL) and TensorBoard ``tensorboard_dir``.

    Args:
        path: the JSONL file (None: no file).
        tensorboard_dir: event folder (None: no TensorBoard). If ``torch.utils.tensorboard``
            cannot be imported (the tensorboard package is missing) a warning is given once.
        resume_step: drop lines with ``step > resume_step`` already in the file.
    """

    def __init__(self, path: Path | None, tensorboard_dir: Path | None = None,
                 resume_step: int = 0) -> None:
        self.path = path
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = [line for line in _lines(path) if _step(line) <= resume_step]
            path.write_text("".join(kept), encoding="utf-8")
            self._file = open(path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                warnings.warn(f"TensorBoard disabled: {err} (pip install tensorboard)",
                              stacklevel=2)
            else:
                self._tb = SummaryWriter(str(tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        """One line; non-finite floats are written as null (JSON has no NaN)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        if self._file is not None:
            self._file.write(json.dumps(clean) + "\n")
            self._file.flush()
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(
                        value, bool):
                    self._tb.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        """Flush and close the outputs."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _lines(path: Path) -> list[str]:
    if not path.is_file():
        return []
    return [line if line.endswith("\n") else line + "\n"
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _step(line: str) -> float:
    try:
        return float(json.loads(line).get("step", math.inf))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return math.inf


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file."""
    return [json.loads(line) for line in _lines(Path(path))]
