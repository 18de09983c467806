"""Split transformer layers into pipeline stages (pure; no torch).

Layers are numbered 0..n-1 and cut into ``num_stages * virtual_stages`` contiguous pieces, one
per virtual stage; virtual stage ``u`` lives on stage ``u % p`` as its model chunk ``u // p``
(Megatron's interleaving). The embedding belongs to the first virtual stage (stage 0, chunk 0);
the final norm, the head and the loss to the last (stage p - 1, last chunk). With tied
embeddings both ends hold the embedding weight and sum its gradient over the embedding group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PartitionError",
    "PipelinePlan",
    "StagePlan",
    "balanced_partition",
    "explicit_partition",
    "partition_layers",
    "uniform_partition",
]


class PartitionError(ValueError):
    """Layers cannot be split as asked; the message names every number involved."""


@dataclass(frozen=True)
class StagePlan:
    """What one pipeline stage builds.

    ``chunks[c]`` is the half-open layer range ``(start, stop)`` of local model chunk ``c``
    (virtual stage ``c * num_stages + stage``).
    """

    stage: int
    chunks: tuple[tuple[int, int], ...]
    has_embedding: bool
    has_head: bool

    @property
    def layers(self) -> tuple[int, ...]:
        """All layer indices of this stage, chunk by chunk."""
        return tuple(i for start, stop in self.chunks for i in range(start, stop))

    @property
    def num_layers(self) -> int:
        """Number of transformer layers on this stage (all chunks)."""
        return sum(stop - start for start, stop in self.chunks)


@dataclass(frozen=True)
class PipelinePlan:
    """Layer placement for all stages; validated to cover every layer exactly once in order."""

    num_layers: int
    num_stages: int
    virtual_stages: int
    stages: tuple[StagePlan, ...]

    def __post_init__(self) -> None:
        p, v, n = self.num_stages, self.virtual_stages, self.num_layers
        if len(self.stages) != p or any(len(s.chunks) != v for s in self.stages):
            raise PartitionError(f"plan needs {p} stages with {v} chunks each")
        expected_start = 0
        for u in range(p * v):
            start, stop = self.stages[u % p].chunks[u // p]
            if start != expected_start or stop < start:
                raise PartitionError(
                    f"virtual stage {u} covers layers [{start}, {stop}), expected to start at "
                    f"{expected_start}"
                )
            expected_start = stop
        if expected_start != n:
            raise PartitionError(f"plan covers {expected_start} layers, model has {n}")
        for stage in self.stages:
            if stage.has_embedding != (stage.stage == 0):
                raise PartitionError(f"embedding must be on stage 0 only (stage {stage.stage})")
            if stage.has_head != (stage.stage == p - 1):
                raise PartitionError(f"head must be on stage {p - 1} only (stage {stage.stage})")

    @property
    def layer_counts(self) -> tuple[int, ...]:
        """Layers per virtual stage, in virtual-stage order."""
        p = self.num_stages
        ranges = [self.stages[u % p].chunks[u // p] for u in range(p * self.virtual_stages)]
        return tuple(stop - start for start, stop in ranges)

    def locate(self, layer: int) -> tuple[int, int]:
        """``(stage, chunk)`` that holds ``layer``."""
        for stage in self.stages:
            for chunk, (start, stop) in enumerate(stage.chunks):
                if start <= layer < stop:
                    return stage.stage, chunk
        raise PartitionError(f"layer {layer} is outside 0..{self.num_layers - 1}")


def _check_sizes(num_stages: int, virtual_stages: int) -> int:
    for name, value in (("num_stages", num_stages), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PartitionError(f"{name} must be a positive int, got {value!r}")
    return num_stages * virtual_stages


def _plan_from_counts(counts: Sequence[int], num_stages: int, virtual_stages: int) -> PipelinePlan:
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    p, v = num_stages, virtual_stages
    stages = tuple(
        StagePlan(
            stage=s,
            chunks=tuple((bounds[c * p + s], bounds[c * p + s + 1]) for c in range(v)),
            has_embedding=s == 0,
            has_head=s == p - 1,
        )
        for s in range(p)
    )
    return PipelinePlan(bounds[-1], p, v, stages)


def uniform_partition(num_layers: int, num_stages: int, virtual_stages: int = 1) -> PipelinePlan:
    """The same number of layers on every virtual stage; raises unless it divides evenly."""
    parts = _check_sizes(num_stages, virtual_stages)
    if num_layers < 1 or num_layers % parts != 0:
        raise PartitionError(
            f"uniform partitioning needs num_layers ({num_layers}) divisible by num_stages "
            f"({num_stages}) x virtual_stages ({virtual_stages}) = {parts}"
        )
    return _plan_from_counts([num_layers // parts] * parts, num_stages, virtual_stages)


def explicit_partition(
    layer_counts: Sequence[int], num_stages: int, virtual_stages: int = 1
) -> PipelinePlan:
    """Layers per virtual stage given explicitly (in virtual-stage order; 0 is allowed)."""
    parts = _check_sizes(num_stages, virtual_stages)
    counts = list(layer_counts)
    if len(counts) != parts:
        raise PartitionError(
            f"explicit partitioning needs {parts} layer counts (num_stages {num_stages} x "
            f"virtual_stages {virtual_stages}), got {len(counts)}: {counts}"
        )
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in counts):
        raise PartitionError(f"layer counts must be ints >= 0, got {counts}")
    if sum(counts) < 1:
        raise PartitionError(f"layer counts {counts} place no layer at all")
    return _plan_from_counts(counts, num_stages, virtual_stages)


def _part_weight(prefix: list[float], extra: list[float], part: int, i: int, j: int) -> float:
    return prefix[j] - prefix[i] + extra[part]


def _balanced_counts(weights: list[float], parts: int, extra: list[float]) -> list[int]:
    """Contiguous split of ``weights`` into ``parts`` non-empty pieces minimising the heaviest
    piece (``extra[k]`` is added to piece k), ties broken by the smallest sum of squared piece
    weights so that the pieces are as even as possible."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][j]: minimal max weight of the first k pieces covering layers [0, j).
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            best[k][j] = min(
                max(best[k - 1][i], _part_weight(prefix, extra, k - 1, i, j))
                for i in range(k - 1, j)
            )
    cap = best[parts][n]
    # Second pass: among splits whose pieces all stay <= cap, minimise the sum of squares.
    cost = [[inf] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    cost[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                weight = _part_weight(prefix, extra, k - 1, i, j)
                if weight <= cap and cost[k - 1][i] + weight * weight < cost[k][j]:
                    cost[k][j], choice[k][j] = cost[k - 1][i] + weight * weight, i
    counts, j = [], n
    for k in range(parts, 0, -1):
        counts.append(j - choice[k][j])
        j = choice[k][j]
    return counts[::-1]


def balanced_partition(
    layer_weights: Sequence[float],
    num_stages: int,
    virtual_stages: int = 1,
    embedding_weight: float = 0.0,
    head_weight: float = 0.0,
) -> PipelinePlan:
    """Contiguous split minimising the largest stage weight (e.g. parameter counts).

    ``embedding_weight`` counts towards the first virtual stage and ``head_weight`` (final norm,
    untied head) towards the last. Every virtual stage gets at least one layer.
    """
    parts = _check_sizes(num_stages, virtual_stages)
    weights = [float(w) for w in layer_weights]
    if len(weights) < parts:
        raise PartitionError(
            f"balanced partitioning needs at least one layer per virtual stage: "
            f"{len(weights)} layers < num_stages ({num_stages}) x virtual_stages "
            f"({virtual_stages}) = {parts}"
        )
    if any(w < 0 for w in weights) or embedding_weight < 0 or head_weight < 0:
        raise PartitionError(
            f"weights must be >= 0, got layers {weights}, embedding {embedding_weight}, "
            f"head {head_weight}"
        )
    extra = [0.0] * parts
    extra[0] += float(embedding_weight)
    extra[-1] += float(head_weight)
    return _plan_from_counts(_balanced_counts(weights, parts, extra), num_stages, virtual_stages)


def partition_layers(
    num_layers: int,
    num_stages: int,
    method: str = "uniform",
    *,
    virtual_stages: int = 1,
    layer_weights: Sequence[float] | None = None,
    layer_counts: Sequence[int] | None = None,
    embedding_weight: float = 0.0,
    head_weight: float = 0.0,
) -> PipelinePlan:
    """Dispatch on ``method``: "uniform", "balanced" (needs ``layer_weights``, one per layer)
    or "explicit" (needs ``layer_counts``, one per virtual stage)."""
    if method == "uniform":
        return uniform_partition(num_layers, num_stages, virtual_stages)
    if method == "balanced":
        if layer_weights is None or len(layer_weights) != num_layers:
            got = None if layer_weights is None else len(layer_weights)
            raise PartitionError(
                f"balanced partitioning needs {num_layers} layer weights, got {got}"
            )
        return balanced_partition(
            layer_weights, num_stages, virtual_stages, embedding_weight, head_weight
        )
    if method == "explicit":
        if layer_counts is None:
            raise PartitionError("explicit partitioning needs layer_counts")
        plan = explicit_partition(layer_counts, num_stages, virtual_stages)
        if plan.num_layers != num_layers:
            raise PartitionError(
                f"explicit layer counts {list(layer_counts)} sum to {plan.num_layers}, "
                f"model has {num_layers} layers"
            )
        return plan
    raise PartitionError(f"unknown partition method {method!r}; use uniform, balanced, explicit")
