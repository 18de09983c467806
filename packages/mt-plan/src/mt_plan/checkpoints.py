"""What checkpoints cost a run at any scale: bytes, the time a save stops training
(synchronous, or asynchronous: a copy to host memory), the host memory that copy takes, and
the work failures are expected to cost for a given failure rate and save interval.

An mt checkpoint (mt pretrain's engine) holds, per rank: the fp32 weights of its tensor- and
pipeline-parallel slice on the ranks of data-parallel replica 0 (context rank 0), and its
optimizer shard on every rank (fp32 master weights, Adam's two moments: 12 bytes per
parameter, divided over the data- and context-parallel ranks with ZeRO 1-3, whole on each of
them with ZeRO 0). The ranks of a node
write through the node's storage link; a save's time is its fullest node's bytes over that
link. Expected losses follow the first-order model of Young (1974) and Daly (2006): a
failure loses on average half a save interval, the restart, and, with asynchronous saves,
the write still in flight (the newest published checkpoint lags by it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from mt_plan.gpus import GPUSpec
from mt_plan.layout import ParallelLayout

__all__ = ["FailureCosts", "SaveCosts", "failure_costs", "save_costs"]

#: Bytes per parameter of an optimizer shard (fp32 master, Adam's first and second moments).
OPTIMIZER_BYTES = 12
#: Bytes per parameter of the saved weights (fp32).
WEIGHT_BYTES = 4
GB = 1e9


@dataclass(frozen=True)
class SaveCosts:
    """One save of a layout: sizes (bytes) and the seconds it stops training."""

    checkpoint_bytes: float
    """The whole checkpoint: the weights once, the optimizer state once per replica that
    keeps a whole one."""
    rank_bytes: float
    """What the fullest rank writes (a replica-0 rank: weights and optimizer shard)."""
    node_bytes: float
    """What the fullest node writes (its ranks' files)."""
    sync_s: float
    """A synchronous save: training waits until the fullest node has written its bytes."""
    async_s: float
    """An asynchronous save: training waits for the copy of a rank's state to host memory."""
    write_s: float
    """How long an asynchronous save's write runs behind training."""
    host_bytes_per_node: float
    """Host memory (pinned on CUDA) an asynchronous save's copy takes on the fullest node."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def save_costs(params: int, params_per_gpu: int, layout: ParallelLayout, gpu: GPUSpec,
               write_bytes_per_s: float, host_bytes_per_s: float) -> SaveCosts:
    """The costs of one save of a model of ``params`` parameters (``params_per_gpu`` on the
    fullest GPU) in ``layout`` on ``gpu``'s nodes, each node writing at ``write_bytes_per_s``
    and each GPU copying to host memory at ``host_bytes_per_s``."""
    if not (write_bytes_per_s > 0 and host_bytes_per_s > 0):
        raise ValueError(f"bandwidths must be > 0, got {write_bytes_per_s} and "
                         f"{host_bytes_per_s}")
    replicas = layout.dp * layout.cp  # the ranks ZeRO shards over (one model slice each)
    shards = replicas if layout.zero_stage >= 1 else 1
    weights, shard = params_per_gpu * WEIGHT_BYTES, params_per_gpu * OPTIMIZER_BYTES / shards
    whole = params * (WEIGHT_BYTES + OPTIMIZER_BYTES * replicas / shards)
    # A node holds consecutive ranks, tensor-parallel ones innermost: of the first node's,
    # its first tensor-parallel group (replica 0, context rank 0) writes the weights too.
    ranks = min(gpu.gpus_per_node, layout.world_size)
    node = min(ranks, layout.tp) * weights + ranks * shard
    rank = weights + shard
    write = node / write_bytes_per_s
    return SaveCosts(whole, rank, node, write, rank / host_bytes_per_s, write, node)


@dataclass(frozen=True)
class FailureCosts:
    """What saves and failures cost a run, as fractions of its time, for one save
    interval; and the interval that costs least (Young / Daly)."""

    interval_s: float
    """Seconds of training between saves."""
    saving_fraction: float
    """The time saves stop training, over the time between them."""
    failure_fraction: float
    """The expected work lost to failures (half an interval, the write in flight, the
    restart), per unit of time."""
    lost_per_failure_s: float
    best_interval_steps: int
    """The save interval (steps) that minimises the two fractions' sum."""

    @property
    def total_fraction(self) -> float:
        return self.saving_fraction + self.failure_fraction

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_fraction": self.total_fraction}


def failure_costs(blocking_s: float, write_s: float, iteration_s: float, interval_steps: int,
                  failures_per_day: float, restart_s: float) -> FailureCosts:
    """Saves that stop training ``blocking_s`` each (with a write of ``write_s`` still
    running behind: asynchronous saves; 0 for synchronous ones) every ``interval_steps``
    steps of ``iteration_s``, with ``failures_per_day`` failures of the job, each costing
    ``restart_s`` to restart."""
    if interval_steps < 1 or not iteration_s > 0 or failures_per_day < 0 or restart_s < 0:
        raise ValueError(f"need interval_steps >= 1, iteration_s > 0, failures_per_day >= 0 "
                         f"and restart_s >= 0; got {interval_steps}, {iteration_s}, "
                         f"{failures_per_day}, {restart_s}")
    rate = failures_per_day / 86400.0
    interval = interval_steps * iteration_s

    def fractions(seconds: float) -> tuple[float, float]:
        # A save waits for the previous write: an interval shorter than the write costs
        # the difference too.
        blocking = blocking_s + max(0.0, write_s - seconds)
        lost = seconds / 2 + write_s + restart_s
        return blocking / (seconds + blocking), rate * lost

    saving, failing = fractions(interval)
    # Young / Daly's optimum sqrt(2 c / rate), then its neighbours in whole steps (the
    # waiting term makes the cost non-smooth at the write's length).
    guess = math.sqrt(2 * max(blocking_s, 1e-9) / rate) if rate else math.inf
    guesses = {max(1, round(write_s / iteration_s))}
    if math.isfinite(guess):
        guesses |= {max(1, int(guess / iteration_s)), max(1, math.ceil(guess / iteration_s))}
    best = min(guesses, key=lambda n: sum(fractions(n * iteration_s))) if rate else 0
    return FailureCosts(interval, saving, failing, interval / 2 + write_s + restart_s, best)
