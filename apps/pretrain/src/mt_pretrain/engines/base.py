"""The training engine interface: what the trainer asks of whatever runs the model.

An engine is chosen once per run (``--engine``; :func:`mt_pretrain.run.rank.make_engine`) and
owns this rank's model stage, its optimizer and everything that depends on how the model is
run: a step's forward and backward passes (pipeline schedule or gradient accumulation), the
optimizer step, the parameters in evaluation, the full weights, checkpoints. The trainer and
the run loop only call these methods; they know no engine by name. What an engine does not
support is refused at config time by the registry, :mod:`mt_pretrain.config.engines`.

Implementations: :class:`mt_pretrain.engines.mt.MTEngine` (mt-pipeline + mt-zero) and
:class:`mt_pretrain.engines.deepspeed_engine.DeepSpeedEngine` (DeepSpeed's engines around
mt's model).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from mt_checkpoint import Built
from mt_data import DataLoaderState
from mt_zero import StepResult

__all__ = ["Engine", "Saver"]


class Saver(Protocol):
    """Writes the checkpoints of a run (every rank calls :meth:`save` together)."""

    last_saved: Path | None
    last_step: int | None
    longest_write: float
    """Seconds the longest background write took (0: none yet, or none in the background)."""

    def save(self, step: int, data_state: DataLoaderState, background: bool = False) -> Path:
        """Write the checkpoint of ``step`` (``background``: its files by a writer process,
        training going on); returns its folder."""

    def settle(self) -> None:
        """Before the optimizer changes the state: a background save's copies of it done."""

    def wait(self) -> None:
        """Until the background write, if any, has ended (its error raised here)."""

    def close(self) -> None:
        """Wait, then release what background writes hold (a writer process)."""


class Engine(ABC):
    """This rank's share of training, whichever engine runs it.

    Attributes:
        built: the model stage (parameter names of the unsharded GPT), the TP RNG tracker,
            full shapes and TP styles of every parameter.
    """

    def __init__(self, built: Built) -> None:
        self.built = built

    @classmethod
    def preload(cls, config: Any) -> None:
        """Import, in the process that forks ``--nproc`` ranks, what every rank of a run of
        ``config`` would import itself: they inherit it (default: nothing)."""
        return None

    @property
    def stage(self) -> Any:
        """This rank's pipeline stage module (the whole model when pp == 1)."""
        return self.built.stage

    @property
    def keyed_dropout(self) -> bool:
        """Dropout masks keyed by (micro-batch, layer): the trainer passes micro-batch keys."""
        return self.built.stage.rng is not None

    @property
    def skips_nonfinite(self) -> bool:
        """A non-finite loss is skipped by a loss scaler (fp16) instead of stopping the run."""
        return False

    @abstractmethod
    def set_lr(self, lr: float) -> None:
        """The learning rate of the next optimizer step."""

    @abstractmethod
    def forward_backward(self, micro: Sequence[np.ndarray], keys: list[int] | None) -> float:
        """Forward and backward over this rank's micro-batches of one global batch
        (``[micro_batch, seq + 1]`` token arrays; ``keys`` for keyed dropout); returns this
        rank's mean loss (unscaled; the trainer averages it over data parallelism)."""

    @abstractmethod
    def step(self) -> StepResult:
        """Reduce, clip and apply the gradients of the global batch (collective)."""

    @abstractmethod
    def gathered(self) -> AbstractContextManager[None]:
        """Context in which every parameter is present for evaluation (collective)."""

    @abstractmethod
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This stage's fp32 master weights by name, full over DP (collective)."""

    @abstractmethod
    def saver(self, root: Path, keep_last: int) -> Saver:
        """The checkpoint writer of this engine's format."""

    @abstractmethod
    def load(self, path: str | Path) -> tuple[int, DataLoaderState]:
        """Resume from a checkpoint of this engine; returns (step, data-loader state)."""
