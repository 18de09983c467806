"""torch.distributed process groups for a :class:`~mt_dist.topology.Topology`.

Every rank creates every group in the same order (``new_group`` is collective over the
default group's store) and keeps only the groups it belongs to. The result is a frozen
:class:`ParallelGroups` that callers pass around explicitly: there is no global parallel state.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mt_dist.topology import Coord, Topology, TopologyError

__all__ = ["ParallelGroups", "backend_for", "build_groups"]


def backend_for(device: torch.device | str) -> str:
    """The collective backend for ``device``: ``"gloo"`` on CPU, ``"nccl"`` on CUDA."""
    kind = torch.device(device).type
    if kind == "cpu":
        return "gloo"
    if kind == "cuda":
        return "nccl"
    raise ValueError(f"no collective backend known for device type {kind!r} (use cpu or cuda)")


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups in a (tp, cp, pp, dp) topology.

    Attributes:
        topology: the grid the groups were built from.
        rank: this process's global rank.
        device: the device collectives run on (cpu for gloo, cuda:N for nccl).
        backend: ``"gloo"`` or ``"nccl"``.
        tp: this rank's tensor-parallel group.
        dp: this rank's data-parallel group.
        pp: this rank's pipeline group (all stages of its pipeline).
        embedding: first + last stage group for tied embeddings; None on middle stages.
        model_parallel: all tp x pp ranks of this rank's replica (for global norms).
        cp: this rank's context-parallel group (ranks holding slices of the same sequences).
        dp_cp: the ranks of this rank's model shard over data and context parallelism, which
            reduce gradients (and ZeRO-shard) together; ``dp``'s ranks when cp == 1.
    """

    topology: Topology
    rank: int
    device: torch.device
    backend: str
    tp: ProcessGroup
    dp: ProcessGroup
    pp: ProcessGroup
    embedding: ProcessGroup | None
    model_parallel: ProcessGroup | None = None
    cp: ProcessGroup | None = None
    dp_cp: ProcessGroup | None = None

    @property
    def coord(self) -> Coord:
        """This rank's (pp, dp, tp) coordinate."""
        return self.topology.coord(self.rank)

    @property
    def tp_rank(self) -> int:
        """Index of this rank inside its tensor-parallel group."""
        return self.coord.tp

    @property
    def tp_size(self) -> int:
        """Tensor-parallel degree."""
        return self.topology.tp

    @property
    def dp_rank(self) -> int:
        """Index of this rank inside its data-parallel group."""
        return self.coord.dp

    @property
    def dp_size(self) -> int:
        """Data-parallel degree."""
        return self.topology.dp

    @property
    def cp_rank(self) -> int:
        """Index of this rank inside its context-parallel group (its slice of a sequence)."""
        return self.coord.cp

    @property
    def cp_size(self) -> int:
        """Context-parallel degree."""
        return self.topology.cp

    @property
    def grad_group(self) -> ProcessGroup:
        """The group gradients are averaged (and ZeRO states sharded) over: dp x cp."""
        return self.dp if self.dp_cp is None else self.dp_cp

    @property
    def grad_rank(self) -> int:
        """Index of this rank in :attr:`grad_group` (``dp_rank * cp + cp_rank``)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def grad_size(self) -> int:
        """Ranks of :attr:`grad_group`: dp x cp."""
        return self.dp_size * self.cp_size

    @property
    def pp_rank(self) -> int:
        """Pipeline stage of this rank (0 = first)."""
        return self.coord.pp

    @property
    def pp_size(self) -> int:
        """Number of pipeline stages."""
        return self.topology.pp

    @property
    def is_first_stage(self) -> bool:
        """True on the first pipeline stage (holds the input embedding)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (holds the output head and the loss)."""
        return self.pp_rank == self.topology.pp - 1

    @property
    def tp_group_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's tensor-parallel group."""
        return self.topology.tp_group_ranks(self.rank)

    @property
    def dp_group_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's data-parallel group."""
        return self.topology.dp_group_ranks(self.rank)

    @property
    def pp_group_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's pipeline, first stage first."""
        return self.topology.pp_group_ranks(self.rank)

    @property
    def embedding_group_ranks(self) -> tuple[int, ...] | None:
        """Global ranks of this rank's embedding group, None on middle stages."""
        return self.topology.embedding_group_ranks(self.rank)

    @property
    def model_parallel_group_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's model replica (tp x pp ranks)."""
        return self.topology.model_parallel_group_ranks(self.rank)

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank to receive activations from (None on the first stage)."""
        return self.topology.prev_stage_rank(self.rank)

    @property
    def next_stage_rank(self) -> int | None:
        """Global rank to send activations to (None on the last stage)."""
        return self.topology.next_stage_rank(self.rank)


def build_groups(
    topology: Topology, device: torch.device | str = "cpu",
    timeout: timedelta | float | None = None,
) -> ParallelGroups:
    """Create all tp / dp / pp / embedding / model-parallel (and, with cp > 1, cp and dp x cp)
    groups; return this rank's.

    Collective: every rank of the default process group must call it with the same
    ``topology``. Requires an initialized default group of ``topology.world_size`` ranks.
    ``timeout`` (a timedelta or seconds) bounds every collective of these groups: a peer that
    hangs makes the others fail after it instead of waiting forever (None: torch's default,
    30 minutes on gloo).
    """
    if timeout is not None and not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_groups needs an initialized default process group")
    world = dist.get_world_size()
    if world != topology.world_size:
        raise TopologyError(
            f"default process group has {world} ranks but topology {topology.describe()} "
            f"needs {topology.world_size}"
        )
    device = torch.device(device)
    backend = backend_for(device)
    rank = dist.get_rank()

    def mine(all_groups: list[tuple[int, ...]]) -> ProcessGroup | None:
        # new_group must be entered by every rank for every group, in the same order,
        # even by ranks outside the group; they get a non-member placeholder we drop.
        own: ProcessGroup | None = None
        for ranks in all_groups:
            group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
            if rank in ranks:
                own = group
        return own

    tp, dp, pp = mine(topology.tp_groups()), mine(topology.dp_groups()), mine(topology.pp_groups())
    embedding = mine(topology.embedding_groups())
    model_parallel = mine(topology.model_parallel_groups())
    # Only with context parallelism: existing runs create the same groups as before.
    cp = mine(topology.cp_groups()) if topology.cp > 1 else None
    dp_cp = mine(topology.dp_cp_groups()) if topology.cp > 1 else dp
    # Every rank is in exactly one tp/dp/pp group (Topology guarantees it).
    assert tp is not None and dp is not None and pp is not None
    return ParallelGroups(
        topology=topology,
        rank=rank,
        device=device,
        backend=backend,
        tp=tp,
        dp=dp,
        pp=pp,
        embedding=embedding,
        model_parallel=model_parallel,
        cp=cp,
        dp_cp=dp_cp,
    )
