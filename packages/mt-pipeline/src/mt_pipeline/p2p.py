"""Point-to-point and collective communication of one pipeline stage.

:class:`StageComm` knows which global rank runs every stage of this rank's pipeline and
which process groups to use; it posts one :class:`~mt_pipeline.schedules.Exchange` as one
``torch.distributed.batch_isend_irecv`` and waits for all of it. Tensor parallelism inside
a stage needs nothing special here: each TP rank belongs to its own pipeline (same TP index
on every stage, :meth:`mt_dist.Topology.pp_group_ranks`), so it sends to and receives from
the rank with its own TP index on the neighbouring stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mt_dist import ParallelGroups

__all__ = ["StageComm"]


@dataclass(frozen=True)
class StageComm:
    """Communication context of one pipeline stage.

    Attributes:
        stage: this rank's stage index.
        stage_ranks: global rank running each stage of this rank's pipeline (first first).
        group: the pipeline process group (``None``: the default group); P2P ops name global
            ranks and run in this group.
        embedding_group: first + last stage group for the tied weight's gradient; ``None``
            on middle stages (and ignored with a single stage).
    """

    stage: int
    stage_ranks: tuple[int, ...]
    group: ProcessGroup | None = None
    embedding_group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        p = len(self.stage_ranks)
        if p < 1 or not 0 <= self.stage < p:
            raise ValueError(f"stage {self.stage} outside 0..{p - 1} ({p} stage ranks)")
        if len(set(self.stage_ranks)) != p:
            raise ValueError(f"stage ranks must be distinct, got {self.stage_ranks}")

    @classmethod
    def from_groups(cls, groups: ParallelGroups) -> StageComm:
        """This rank's pipeline context from mt_dist's process groups."""
        return cls(
            stage=groups.pp_rank,
            stage_ranks=tuple(groups.pp_group_ranks),
            group=groups.pp,
            embedding_group=groups.embedding,
        )

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.stage_ranks)

    @property
    def is_first(self) -> bool:
        """True on stage 0."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """True on the last stage."""
        return self.stage == self.num_stages - 1

    def exchange(self, ops: Sequence[tuple[bool, int, torch.Tensor]]) -> None:
        """Post ``(is_send, peer_stage, tensor)`` ops together, in order, and wait for all.

        Receives write into the given tensors. Messages between two ranks match in posting
        order, so both sides must post their ops in the schedule's order.
        """
        p2p = [
            dist.P2POp(
                dist.isend if is_send else dist.irecv,
                tensor,
                peer=self.stage_ranks[peer],
                group=self.group,
            )
            for is_send, peer, tensor in ops
        ]
        for work in dist.batch_isend_irecv(p2p):
            work.wait()

    def reduce_tied(self, grads: Sequence[torch.Tensor]) -> None:
        """Sum ``grads`` in place over the embedding group (no-op with one stage or off it)."""
        if self.num_stages == 1 or self.embedding_group is None or not grads:
            return
        if len(grads) == 1:
            dist.all_reduce(grads[0], group=self.embedding_group)
            return
        # One message for several tensors: flatten, reduce, copy back.
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.embedding_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def broadcast_from_last(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` in place from the last stage to every stage of the pipeline."""
        if self.num_stages > 1:
            dist.broadcast(tensor, src=self.stage_ranks[-1], group=self.group)
