"""Per-step metrics: a JSONL file (one object per step) and, optionally, TensorBoard.

Only rank 0 writes. Every line has at least ``step``, ``loss``, ``lr``,
``global_batch_size``, ``tokens`` (consumed so far) and ``tokens_per_s``; lines of
validation steps also carry ``val_loss`` and ``val_ppl``.

Peak memory so far (:mod:`mt_plan.memory`, gathered from every rank once per step):
``peak_mem_gib``, the largest over the ranks, and ``peak_mem_gib_per_rank``, a list in rank
order (GiB; on CUDA the caching allocator's peak allocated bytes, on CPU the process's peak
RSS, which includes the Python interpreter and torch); on CUDA also ``peak_reserved_gib`` and
``peak_reserved_gib_per_rank`` (the allocator's peak reserved bytes); and ``mem_source``,
``"cuda-allocator"`` or ``"rss"``. TensorBoard gets the numbers only (``train/peak_mem_gib``,
``train/peak_reserved_gib``): lists and strings are not scalars.

A resumed run appends to the same file, dropping lines of steps at or after the resume point
first, so the file always holds one line per step.

Weights & Biases (``--wandb-project``) gets the same numbers as TensorBoard, plus the config;
the run's W&B id is kept in OUT_DIR/wandb/mt-run-id so that a resumed run continues the
same W&B run (W&B drops steps it already holds).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mt_pretrain.config.schema import ConfigError

__all__ = ["MetricsWriter", "WandbTarget", "read_metrics"]

WANDB_ID_FILE = "mt-run-id"


@dataclass(frozen=True)
class WandbTarget:
    """Where rank 0 logs to W&B: ``project``, run ``name``, the run folder ``out_dir``
    (W&B writes OUT_DIR/wandb) and the ``config`` to record."""

    project: str
    name: str
    out_dir: Path
    config: dict[str, Any]


class MetricsWriter:
    """Appends metric dicts to ``path`` (JSONL) and TensorBoard ``tensorboard_dir``.

    Args:
        path: the JSONL file (None: no file).
        tensorboard_dir: event folder (None: no TensorBoard). If ``torch.utils.tensorboard``
            cannot be imported (the tensorboard package is missing) a warning is given once.
        resume_step: drop lines with ``step > resume_step`` already in the file.
        wandb: log to Weights & Biases too (None: not).
    """

    def __init__(self, path: Path | None, tensorboard_dir: Path | None = None,
                 resume_step: int = 0, wandb: WandbTarget | None = None) -> None:
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
        self._wandb = _start_wandb(wandb, resume_step) if wandb is not None else None

    @property
    def wandb_line(self) -> str | None:
        """Which W&B run the metrics go to, one line (None: no W&B)."""
        run = self._wandb
        if run is None:
            return None
        mode = "offline, upload with `wandb sync`" if run.offline else "online"
        return f"W&B run {run.id} of project {run.project} ({mode}): {run.dir}"

    def write(self, record: dict[str, Any]) -> None:
        """One line; non-finite floats are written as null (JSON has no NaN)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        if self._file is not None:
            self._file.write(json.dumps(clean) + "\n")
            self._file.flush()
        scalars = {f"train/{key}": value for key, value in record.items()
                   if key != "step" and isinstance(value, (int, float))
                   and not isinstance(value, bool)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, int(record["step"]))
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(record["step"]))

    def close(self) -> None:
        """Flush and close the outputs."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _start_wandb(target: WandbTarget, resume_step: int) -> Any:
    """A W&B run in OUT_DIR/wandb: a new one, or when resuming the one the run folder names."""
    import wandb  # pants: no-infer-dep (optional: mt-pretrain[wandb], checked at config time)

    folder = target.out_dir / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / WANDB_ID_FILE
    run_id = id_file.read_text(encoding="utf-8").strip() if resume_step and \
        id_file.is_file() else None  # None: W&B makes a new id
    try:
        run = wandb.init(project=target.project, name=target.name, dir=str(target.out_dir),
                         id=run_id, resume="allow" if run_id else None, config=target.config,
                         # mt prints its own lines; W&B neither prints nor captures them.
                         settings=wandb.Settings(silent=True, console="off"))
    except wandb.errors.Error as err:
        raise ConfigError(f"--wandb-project {target.project}: W&B did not start: {err} "
                         "(or set WANDB_MODE=offline to log locally)") from None
    tmp = id_file.with_name(id_file.name + ".tmp")
    tmp.write_text(run.id + "\n", encoding="utf-8")
    tmp.replace(id_file)
    return run


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
