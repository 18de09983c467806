"""The (TP, PP, DP) layout a checkpoint was written at, and which rank file holds what.

Ranks follow mt-dist's order (:meth:`mt_dist.Topology.rank_of`), so the file of a
(stage, replica, TP slice) is computed in one place, never by a formula of its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mt_checkpoint.names import CheckpointError, rank_file
from mt_dist import Topology

__all__ = ["SavedLayout"]


@dataclass(frozen=True)
class SavedLayout:
    """The layout of a checkpoint (``meta.json``'s ``"layout"``)."""

    tp: int
    pp: int
    dp: int
    virtual_stages: int = 1
    zero_stage: int = 0
    precision: str = "fp32"
    cp: int = 1
    """Context-parallel degree: the ``dp x cp`` ranks of a model shard hold its ZeRO shards
    in rank order, as ``dp x cp`` replicas would; weights and names do not depend on it."""

    def __post_init__(self) -> None:
        Topology(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp)  # validates the degrees

    @classmethod
    def of(cls, layout: Any) -> SavedLayout:
        """The saved part of a run's layout: anything with ``tp``, ``pp``, ``dp``,
        ``virtual_stages``, ``zero_stage`` and ``precision`` (mt-plan's ``ParallelLayout``),
        and ``cp`` if it has one."""
        return cls(layout.tp, layout.pp, layout.dp, layout.virtual_stages, layout.zero_stage,
                   layout.precision, getattr(layout, "cp", 1))

    @property
    def world_size(self) -> int:
        """Ranks (and rank files) of the checkpoint."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def topology(self) -> Topology:
        """mt-dist's topology of this layout (its rank order is the files')."""
        return Topology(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp)

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        """The rank (file number) of pipeline stage ``pp``, replica ``dp``, TP slice ``tp``
        (and context slice ``cp``)."""
        return self.topology.rank_of(pp=pp, dp=dp, tp=tp, cp=cp)

    def file(self, pp: int, dp: int, tp: int) -> str:
        """File name of that rank's shard (context slice 0: the one holding weights)."""
        return rank_file(self.rank(pp, dp, tp))

    def replicas(self, pp: int, tp: int) -> list[int]:
        """The ranks holding stage ``pp``'s TP slice ``tp``, in the order of their ZeRO
        shards (DP order, and CP order within a replica)."""
        return [self.rank(pp, d, tp, c) for d in range(self.dp) for c in range(self.cp)]

    def to_dict(self) -> dict[str, Any]:
        """``meta.json``'s ``"layout"`` (with the world size, for readers; ``cp`` only with
        context parallelism, so that other checkpoints read as before)."""
        data = {**asdict(self), "world_size": self.world_size}
        if self.cp == 1:
            del data["cp"]
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str) -> SavedLayout:
        """Parse ``meta.json``'s ``"layout"``; ``where`` names the file in errors."""
        try:
            layout = cls(int(data["tp"]), int(data["pp"]), int(data["dp"]),
                         int(data.get("virtual_stages", 1)), int(data.get("zero_stage", 0)),
                         str(data.get("precision", "fp32")), int(data.get("cp", 1)))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{where}: bad layout {data!r} ({err})") from None
        if "world_size" in data and int(data["world_size"]) != layout.world_size:
            raise CheckpointError(f"{where}: layout world_size {data['world_size']} is not "
                                  f"{layout.topology.describe()}")
        return layout
