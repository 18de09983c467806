"""Pure rank <-> coordinate arithmetic for 3D (tensor x data x pipeline) parallelism.

Nothing here touches torch.distributed: the maths is checked without processes, and
`mt_dist.groups` turns the rank lists into process groups in a separate step.

Rank layout (fastest-varying first): tensor-parallel index, then data-parallel index, then
pipeline stage::

    rank = (pp_idx * dp + dp_idx) * tp + tp_idx

Tensor-parallel ranks are adjacent so that a TP group fits inside one node, where the
all-reduces of every layer use the fastest links; pipeline stages are outermost because their
point-to-point traffic is the lightest and tolerates the slowest (inter-node) links.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Coord", "Topology", "TopologyError"]


class TopologyError(ValueError):
    """An impossible parallel layout (non-positive degree, indivisible world, bad rank...)."""


class Coord(NamedTuple):
    """Position of a rank in the (pipeline, data, tensor) grid."""

    pp: int
    dp: int
    tp: int


def _check_degree(name: str, value: object) -> None:
    # bool is an int subclass; Topology(tp=True) is almost certainly a bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise TopologyError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class Topology:
    """A (tp, pp, dp) grid of ``tp * pp * dp`` ranks.

    Attributes:
        tp: tensor-parallel degree (ranks that slice every layer's weights).
        pp: pipeline-parallel degree (number of pipeline stages).
        dp: data-parallel degree (number of model replicas).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        _check_degree("tp", self.tp)
        _check_degree("pp", self.pp)
        _check_degree("dp", self.dp)

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1) -> Topology:
        """Build the topology whose data-parallel degree fills ``world_size`` ranks."""
        _check_degree("world size", world_size)
        _check_degree("tp", tp)
        _check_degree("pp", pp)
        model_parallel = tp * pp
        if world_size % model_parallel != 0:
            raise TopologyError(
                f"world size {world_size} is not divisible by tp {tp} x pp {pp} = "
                f"{model_parallel}"
            )
        return cls(tp=tp, pp=pp, dp=world_size // model_parallel)

    @property
    def world_size(self) -> int:
        """Total number of ranks, ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica, ``tp * pp``."""
        return self.tp * self.pp

    # -- rank <-> coordinate -------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TopologyError(f"rank must be an int, got {rank!r}")
        if not 0 <= rank < self.world_size:
            raise TopologyError(
                f"rank {rank} is outside [0, {self.world_size}) for tp {self.tp} x "
                f"pp {self.pp} x dp {self.dp}"
            )

    def coord(self, rank: int) -> Coord:
        """The (pp, dp, tp) coordinate of global ``rank``."""
        self._check_rank(rank)
        rest, tp_idx = divmod(rank, self.tp)
        pp_idx, dp_idx = divmod(rest, self.dp)
        return Coord(pp=pp_idx, dp=dp_idx, tp=tp_idx)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """The global rank at coordinate (pp, dp, tp); inverse of :meth:`coord`."""
        for name, idx, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp)):
            if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < size:
                raise TopologyError(
                    f"{name} index {idx!r} is outside [0, {size}) for tp {self.tp} x "
                    f"pp {self.pp} x dp {self.dp}"
                )
        return (pp * self.dp + dp) * self.tp + tp

    # -- all groups of one kind ----------------------------------------------------------

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Tensor-parallel groups: ranks sharing (pp, dp); each is a contiguous rank range."""
        return [
            tuple(self.rank_of(p, d, t) for t in range(self.tp))
            for p in range(self.pp)
            for d in range(self.dp)
        ]

    def dp_groups(self) -> list[tuple[int, ...]]:
        """Data-parallel groups: ranks sharing (pp, tp), i.e. the same shard of the model."""
        return [
            tuple(self.rank_of(p, d, t) for d in range(self.dp))
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def pp_groups(self) -> list[tuple[int, ...]]:
        """Pipeline groups: ranks sharing (dp, tp), ordered from the first to the last stage."""
        return [
            tuple(self.rank_of(p, d, t) for p in range(self.pp))
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def embedding_groups(self) -> list[tuple[int, ...]]:
        """Groups tying the input embedding (first stage) to the output head (last stage).

        One group per pipeline: ``(first, last)``, or ``(rank,)`` when pp == 1. Ranks of
        middle stages belong to no embedding group.
        """
        return [(g[0],) if len(g) == 1 else (g[0], g[-1]) for g in self.pp_groups()]

    def model_parallel_groups(self) -> list[tuple[int, ...]]:
        """Model-parallel groups: the ``tp * pp`` ranks of one replica (same dp index).

        Used for quantities summed over a whole replica, e.g. the global gradient norm.
        """
        return [
            tuple(self.rank_of(p, d, t) for p in range(self.pp) for t in range(self.tp))
            for d in range(self.dp)
        ]

    # -- the groups of one rank ----------------------------------------------------------

    def tp_group_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the tensor-parallel group containing ``rank``."""
        c = self.coord(rank)
        return tuple(self.rank_of(c.pp, c.dp, t) for t in range(self.tp))

    def dp_group_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the data-parallel group containing ``rank``."""
        c = self.coord(rank)
        return tuple(self.rank_of(c.pp, d, c.tp) for d in range(self.dp))

    def pp_group_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the pipeline containing ``rank``, first stage first."""
        c = self.coord(rank)
        return tuple(self.rank_of(p, c.dp, c.tp) for p in range(self.pp))

    def embedding_group_ranks(self, rank: int) -> tuple[int, ...] | None:
        """Global ranks of ``rank``'s embedding group, or None for a middle stage."""
        stages = self.pp_group_ranks(rank)
        group = stages[:1] if len(stages) == 1 else (stages[0], stages[-1])
        return group if rank in group else None

    def model_parallel_group_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the replica (all tp x pp ranks with the same dp index) of ``rank``."""
        d = self.coord(rank).dp
        return tuple(self.rank_of(p, d, t) for p in range(self.pp) for t in range(self.tp))

    def prev_stage_rank(self, rank: int) -> int | None:
        """Global rank of the previous pipeline stage of ``rank`` (None on the first stage)."""
        c = self.coord(rank)
        return None if c.pp == 0 else self.rank_of(c.pp - 1, c.dp, c.tp)

    def next_stage_rank(self, rank: int) -> int | None:
        """Global rank of the next pipeline stage of ``rank`` (None on the last stage)."""
        c = self.coord(rank)
        return None if c.pp == self.pp - 1 else self.rank_of(c.pp + 1, c.dp, c.tp)
