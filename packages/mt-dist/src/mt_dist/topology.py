"""Pure rank <-> coordinate arithmetic for 4D (tensor x context x data x pipeline) parallelism.

Nothing here touches torch.distributed: the maths is checked without processes, and
`mt_dist.groups` turns the rank lists into process groups in a separate step.

Rank layout (fastest-varying first): tensor-parallel index, then context-parallel index, then
data-parallel index, then pipeline stage::

    rank = ((pp_idx * dp + dp_idx) * cp + cp_idx) * tp + tp_idx

Tensor-parallel ranks are adjacent so that a TP group fits inside one node, where the
all-reduces of every layer use the fastest links; context-parallel ranks come next (they
exchange keys and values in every layer); pipeline stages are outermost because their
point-to-point traffic is the lightest and tolerates the slowest (inter-node) links.

Context-parallel ranks hold slices of the same sequences, so gradients are reduced (and ZeRO
shards) over the ``dp x cp`` ranks of one model shard: :meth:`Topology.dp_cp_groups`. Their
rank order is that of a ``(tp, pp, dp * cp)`` grid, which is why a checkpoint written at CP
reads like one written with ``dp * cp`` replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Coord", "Topology", "TopologyError"]


class TopologyError(ValueError):
    """An impossible parallel layout (non-positive degree, indivisible world, bad rank...)."""


class Coord(NamedTuple):
    """Position of a rank in the (pipeline, data, tensor, context) grid."""

    pp: int
    dp: int
    tp: int
    cp: int = 0


def _check_degree(name: str, value: object) -> None:
    # bool is an int subclass; Topology(tp=True) is almost certainly a bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise TopologyError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class Topology:
    """A (tp, cp, pp, dp) grid of ``tp * cp * pp * dp`` ranks.

    Attributes:
        tp: tensor-parallel degree (ranks that slice every layer's weights).
        pp: pipeline-parallel degree (number of pipeline stages).
        dp: data-parallel degree (number of model replicas that read different samples).
        cp: context-parallel degree (ranks that hold slices of the same sequences).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        _check_degree("tp", self.tp)
        _check_degree("pp", self.pp)
        _check_degree("dp", self.dp)
        _check_degree("cp", self.cp)

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> Topology:
        """Build the topology whose data-parallel degree fills ``world_size`` ranks."""
        _check_degree("world size", world_size)
        _check_degree("tp", tp)
        _check_degree("pp", pp)
        _check_degree("cp", cp)
        model_parallel = tp * pp * cp
        if world_size % model_parallel != 0:
            raise TopologyError(
                f"world size {world_size} is not divisible by tp {tp} x pp {pp}"
                + (f" x cp {cp}" if cp > 1 else "") + f" = {model_parallel}"
            )
        return cls(tp=tp, pp=pp, dp=world_size // model_parallel, cp=cp)

    @property
    def world_size(self) -> int:
        """Total number of ranks, ``tp * cp * pp * dp``."""
        return self.tp * self.pp * self.dp * self.cp

    def describe(self) -> str:
        """``tp T x pp P x dp D`` (and ``x cp C`` with context parallelism), for messages."""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        return f"tp {self.tp} x pp {self.pp} x dp {self.dp}{cp}"

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
                f"rank {rank} is outside [0, {self.world_size}) for {self.describe()}"
            )

    def coord(self, rank: int) -> Coord:
        """The (pp, dp, tp, cp) coordinate of global ``rank``."""
        self._check_rank(rank)
        rest, tp_idx = divmod(rank, self.tp)
        rest, cp_idx = divmod(rest, self.cp)
        pp_idx, dp_idx = divmod(rest, self.dp)
        return Coord(pp=pp_idx, dp=dp_idx, tp=tp_idx, cp=cp_idx)

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        """The global rank at coordinate (pp, dp, tp, cp); inverse of :meth:`coord`."""
        for name, idx, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp),
                                ("cp", cp, self.cp)):
            if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < size:
                raise TopologyError(
                    f"{name} index {idx!r} is outside [0, {size}) for {self.describe()}"
                )
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    # -- all groups of one kind ----------------------------------------------------------

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Tensor-parallel groups: ranks sharing (pp, dp, cp); each is a contiguous rank range."""
        return [
            tuple(self.rank_of(p, d, t, c) for t in range(self.tp))
            for p in range(self.pp)
            for d in range(self.dp)
            for c in range(self.cp)
        ]

    def cp_groups(self) -> list[tuple[int, ...]]:
        """Context-parallel groups: ranks sharing (pp, dp, tp), i.e. slices of the same
        sequences through the same model shard."""
        return [
            tuple(self.rank_of(p, d, t, c) for c in range(self.cp))
            for p in range(self.pp)
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def dp_groups(self) -> list[tuple[int, ...]]:
        """Data-parallel groups: ranks sharing (pp, tp, cp), i.e. the same shard of the model
        and the same slice of different samples."""
        return [
            tuple(self.rank_of(p, d, t, c) for d in range(self.dp))
            for p in range(self.pp)
            for c in range(self.cp)
            for t in range(self.tp)
        ]

    def dp_cp_groups(self) -> list[tuple[int, ...]]:
        """Gradient groups: ranks sharing (pp, tp), the same shard of the model, over data and
        context parallelism (in rank order: index ``dp_idx * cp + cp_idx``). Gradients are
        reduced and ZeRO shards over them; equal to :meth:`dp_groups` when cp == 1."""
        return [
            tuple(self.rank_of(p, d, t, c) for d in range(self.dp) for c in range(self.cp))
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def pp_groups(self) -> list[tuple[int, ...]]:
        """Pipeline groups: ranks sharing (dp, tp, cp), ordered from the first to the last
        stage."""
        return [
            tuple(self.rank_of(p, d, t, c) for p in range(self.pp))
            for d in range(self.dp)
            for c in range(self.cp)
            for t in range(self.tp)
        ]

    def embedding_groups(self) -> list[tuple[int, ...]]:
        """Groups tying the input embedding (first stage) to the output head (last stage).

        One group per pipeline: ``(first, last)``, or ``(rank,)`` when pp == 1. Ranks of
        middle stages belong to no embedding group.
        """
        return [(g[0],) if len(g) == 1 else (g[0], g[-1]) for g in self.pp_groups()]

    def model_parallel_groups(self) -> list[tuple[int, ...]]:
        """Model-parallel groups: the ``tp * pp`` ranks of one replica (same dp and cp index).

        Used for quantities summed over a whole replica, e.g. the global gradient norm.
        """
        return [
            tuple(self.rank_of(p, d, t, c) for p in range(self.pp) for t in range(self.tp))
            for d in range(self.dp)
            for c in range(self.cp)
        ]

    # -- the groups of one rank ----------------------------------------------------------

    def tp_group_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the tensor-parallel group containing ``rank``."""
        c = self.coord(rank)
        return tuple(self.rank_of(c.pp, c.dp, t, c.cp) for t in range(self.tp))

    def cp_group_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the context-parallel group containing ``rank``."""
        c = self.coord(rank)
        return tuple(self.rank_of(c.pp, c.dp, c.tp, i) for i in range(self.cp))

    def dp_group_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the data-parallel group containing ``rank``."""
        c = self.coord(rank)
        return tuple(self.rank_of(c.pp, d, c.tp, c.cp) for d in range(self.dp))

    def dp_cp_group_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the gradient (dp x cp) group containing ``rank``."""
        c = self.coord(rank)
        return tuple(self.rank_of(c.pp, d, c.tp, i) for d in range(self.dp)
                     for i in range(self.cp))

    def pp_group_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the pipeline containing ``rank``, first stage first."""
        c = self.coord(rank)
        return tuple(self.rank_of(p, c.dp, c.tp, c.cp) for p in range(self.pp))

    def embedding_group_ranks(self, rank: int) -> tuple[int, ...] | None:
        """Global ranks of ``rank``'s embedding group, or None for a middle stage."""
        stages = self.pp_group_ranks(rank)
        group = stages[:1] if len(stages) == 1 else (stages[0], stages[-1])
        return group if rank in group else None

    def model_parallel_group_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the replica (all tp x pp ranks with the same dp and cp index) of
        ``rank``."""
        c = self.coord(rank)
        return tuple(self.rank_of(p, c.dp, t, c.cp) for p in range(self.pp)
                     for t in range(self.tp))

    def prev_stage_rank(self, rank: int) -> int | None:
        """Global rank of the previous pipeline stage of ``rank`` (None on the first stage)."""
        c = self.coord(rank)
        return None if c.pp == 0 else self.rank_of(c.pp - 1, c.dp, c.tp, c.cp)

    def next_stage_rank(self, rank: int) -> int | None:
        """Global rank of the next pipeline stage of ``rank`` (None on the last stage)."""
        c = self.coord(rank)
        return None if c.pp == self.pp - 1 else self.rank_of(c.pp + 1, c.dp, c.tp, c.cp)
