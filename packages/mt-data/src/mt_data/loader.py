"""The data loader of one data-parallel rank, with an exact, DP-size independent resume state.

A global batch is defined only by the number of samples consumed before it and its size:
samples ``[consumed, consumed + global_batch)`` of the (already shuffled) dataset. It is split
into micro-steps of ``micro_batch * dp_size`` samples, and rank r takes the r-th slice of
``micro_batch`` samples of each micro-step (Megatron's pretraining sampler). Because the split
happens after the global batch is fixed, a run resumed at another DP size sees the same global
batches as an uninterrupted one. Batch-size ramp-up (MT-NLG: 32 -> 1920) is supported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np


class SampleSource(Protocol):
    """Anything indexable returning ``seq_len + 1`` token arrays (GPTDataset, BlendedDataset)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


@dataclass(frozen=True)
class DataLoaderState:
    """What a checkpoint must store to resume the data stream exactly."""

    consumed_samples: int = 0
    step: int = 0

    def __post_init__(self) -> None:
        if self.consumed_samples < 0 or self.step < 0:
            raise ValueError(
                f"consumed_samples ({self.consumed_samples}) and step ({self.step}) must be >= 0"
            )

    def to_dict(self) -> dict[str, int]:
        """Plain dict for checkpoints."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> DataLoaderState:
        """Inverse of :meth:`to_dict`."""
        return cls(int(data["consumed_samples"]), int(data["step"]))


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch size per step, with optional linear ramp-up over consumed samples.

    With ``rampup = (start, increment, ramp_samples)`` the batch grows from ``start`` by
    ``increment`` in equal sample intervals until ``global_batch_size`` after ``ramp_samples``.
    """

    global_batch_size: int
    rampup: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.rampup is not None:
            start, inc, samples = self.rampup
            if start < 1 or inc < 1 or samples < 0 or (self.global_batch_size - start) % inc:
                raise ValueError(
                    f"rampup (start={start}, increment={inc}, samples={samples}) must step from "
                    f"start to global_batch_size={self.global_batch_size} by whole increments"
                )

    def batch_size(self, consumed: int) -> int:
        """Global batch size of the batch starting after ``consumed`` samples."""
        if self.rampup is None:
            return self.global_batch_size
        start, inc, samples = self.rampup
        steps = (self.global_batch_size - start) // inc
        if steps == 0 or consumed >= samples:
            return self.global_batch_size
        per_increment = samples / steps
        return min(start + int(consumed // per_increment) * inc, self.global_batch_size)

    def consumed_at(self, step: int) -> int:
        """Samples consumed before ``step``."""
        return self.consumed_after(0, step)

    def consumed_after(self, consumed: int, steps: int) -> int:
        """Samples consumed after ``steps`` more steps from ``consumed`` (a run resumed from
        a checkpoint counts on from the samples it consumed, at whatever batch sizes)."""
        for s in range(steps):
            size = self.batch_size(consumed)
            if size == self.global_batch_size:  # ramp over: closed form for the rest
                return consumed + (steps - s) * size
            consumed += size
        return consumed

    def steps_to(self, consumed: int, target: int) -> tuple[int, int]:
        """(steps, samples consumed after them) from ``consumed`` until at least ``target``
        samples are consumed (none when ``consumed`` is there already)."""
        steps = 0
        while consumed < target:
            size = self.batch_size(consumed)
            if size == self.global_batch_size:  # ramp over: closed form for the rest
                extra = -(-(target - consumed) // size)
                return steps + extra, consumed + extra * size
            consumed += size
            steps += 1
        return steps, consumed


class DPDataLoader:
    """Micro-batches of one DP rank.

    Args:
        dataset: the sample source (shared by all ranks; only indices differ).
        schedule: global batch sizes (or an int for a constant size).
        micro_batch_size: samples per micro-batch on one rank.
        dp_rank, dp_size: this rank's coordinate in its data-parallel group.
        state: resume state (consumed samples, step) from a checkpoint.
    """

    def __init__(self, dataset: SampleSource, schedule: BatchSchedule | int,
                 micro_batch_size: int, dp_rank: int, dp_size: int,
                 state: DataLoaderState = DataLoaderState()) -> None:
        self.schedule = BatchSchedule(schedule) if isinstance(schedule, int) else schedule
        if not 0 <= dp_rank < dp_size or micro_batch_size < 1:
            raise ValueError(f"need 0 <= dp_rank ({dp_rank}) < dp_size ({dp_size}) and "
                             f"micro_batch_size ({micro_batch_size}) >= 1")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.state = state

    def micro_batches_per_step(self, global_batch_size: int) -> int:
        """Micro-batches each rank runs for a global batch of this size."""
        per_step = self.micro_batch_size * self.dp_size
        if global_batch_size % per_step:
            raise ValueError(
                f"global batch {global_batch_size} is not divisible by micro_batch_size "
                f"{self.micro_batch_size} x dp_size {self.dp_size} = {per_step}"
            )
        return global_batch_size // per_step

    def rank_indices(self, consumed: int, global_batch_size: int) -> np.ndarray:
        """``[micro_batches, micro_batch_size]`` sample indices of this rank's share."""
        n_micro = self.micro_batches_per_step(global_batch_size)
        end = consumed + global_batch_size
        if end > len(self.dataset):
            raise IndexError(
                f"global batch [{consumed}, {end}) runs past the dataset's {len(self.dataset)} "
                f"samples: build it with more num_samples"
            )
        grid = np.arange(consumed, end, dtype=np.int64).reshape(
            n_micro, self.dp_size, self.micro_batch_size)
        return grid[:, self.dp_rank, :]

    def batch_at(self, consumed: int, global_batch_size: int) -> list[np.ndarray]:
        """This rank's micro-batches (int64 ``[micro_batch_size, seq_len + 1]``)."""
        return [np.stack([np.asarray(self.dataset[int(i)], dtype=np.int64) for i in row])
                for row in self.rank_indices(consumed, global_batch_size)]

    def global_batch(self, step: int) -> list[np.ndarray]:
        """This rank's micro-batches of the global batch of ``step`` (state unchanged)."""
        consumed = self.schedule.consumed_at(step)
        return self.batch_at(consumed, self.schedule.batch_size(consumed))

    def next(self) -> list[np.ndarray]:
        """Micro-batches of the next step, advancing :attr:`state`."""
        consumed = self.state.consumed_samples
        size = self.schedule.batch_size(consumed)
        batches = self.batch_at(consumed, size)
        self.state = DataLoaderState(consumed + size, self.state.step + 1)
        return batches
