"""mt's process groups in the shapes DeepSpeed expects: an ``mpu`` and a pipeline topology.

DeepSpeed asks a "model parallel unit" (``mpu``) for its groups: the data-parallel group
(gradient reduction, ZeRO partitioning, batch-size arithmetic) and the model-parallel group
(gradient-norm sums, overflow checks). :class:`GroupsMpu` answers from an
:class:`mt_dist.ParallelGroups`, so DeepSpeed reduces over exactly mt's groups instead of
building its own.

With pipeline parallelism DeepSpeed refuses an external ``mpu`` (``deepspeed.initialize``
takes the ``PipelineModule``'s grid instead) and builds its groups from a topology object.
:func:`pipe_topology` gives the topology whose rank order is mt's
(rank = (pp * dp + dp_idx) * tp + tp_idx): DeepSpeed's ``PipeModelDataParallelTopology``
orders its axes pipe, data, model, the same nesting. :func:`grid_mismatches` checks a
built DeepSpeed grid against mt's groups rank by rank.

``deepspeed`` is imported lazily (inside :func:`pipe_topology`): optional dependency.
"""

from __future__ import annotations

from typing import Any

from torch.distributed import ProcessGroup

from mt_dist import ParallelGroups, Topology

__all__ = ["GroupsMpu", "grid_mismatches", "pipe_topology"]


class GroupsMpu:
    """DeepSpeed's ``mpu`` interface over mt's :class:`~mt_dist.ParallelGroups`.

    DeepSpeed's "model parallel" group means every rank holding a different part of one
    model replica: TP x PP ranks. Its "tensor" / "slice" parallel group is mt's TP group.
    """

    def __init__(self, groups: ParallelGroups) -> None:
        if groups.topology.pp > 1 and groups.model_parallel is None:
            raise ValueError(f"pp {groups.topology.pp} > 1 needs the model_parallel group "
                             "(tp x pp ranks) in ParallelGroups")
        self.groups = groups

    def _model_parallel(self) -> ProcessGroup:
        g = self.groups
        return g.tp if g.topology.pp == 1 or g.model_parallel is None else g.model_parallel

    # -- model parallel (TP x PP): norms and overflow checks count each shard once
    def get_model_parallel_rank(self) -> int:
        """Rank inside this replica's TP x PP ranks (tp fastest, as in mt's order)."""
        return self.groups.pp_rank * self.groups.tp_size + self.groups.tp_rank

    def get_model_parallel_world_size(self) -> int:
        """tp x pp."""
        return self.groups.tp_size * self.groups.pp_size

    def get_model_parallel_group(self) -> ProcessGroup:
        """The TP x PP group of this replica (TP group when pp == 1)."""
        return self._model_parallel()

    # -- tensor (slice) parallel: DeepSpeed counts a replicated parameter on TP rank 0 only
    def get_tensor_model_parallel_rank(self) -> int:
        """Rank in the TP group."""
        return self.groups.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        """TP degree."""
        return self.groups.tp_size

    def get_tensor_model_parallel_group(self) -> ProcessGroup:
        """mt's TP group."""
        return self.groups.tp

    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    # -- data parallel: gradient reduction and ZeRO partitioning
    def get_data_parallel_rank(self) -> int:
        """Rank in the DP group."""
        return self.groups.dp_rank

    def get_data_parallel_world_size(self) -> int:
        """DP degree."""
        return self.groups.dp_size

    def get_data_parallel_group(self) -> ProcessGroup:
        """mt's DP group."""
        return self.groups.dp

    # -- pipeline
    def get_pipe_parallel_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self.groups.pp_rank

    def get_pipe_parallel_world_size(self) -> int:
        """Number of pipeline stages."""
        return self.groups.pp_size

    def get_pipe_parallel_group(self) -> ProcessGroup:
        """All stages of this rank's pipeline."""
        return self.groups.pp

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group


def pipe_topology(topology: Topology) -> Any:
    """DeepSpeed's ``PipeModelDataParallelTopology`` with mt's rank order (pipe, data, model:
    model = TP fastest)."""
    # One line (optional dependency): Pants reads the pragma where an import ends.
    from deepspeed.runtime.pipe import topology as ds_topology  # pants: no-infer-dep

    ds = ds_topology.PipeModelDataParallelTopology(num_pp=topology.pp, num_mp=topology.tp,
                                                   num_dp=topology.dp)
    for rank in range(topology.world_size):
        c, d = topology.coord(rank), ds.get_coord(rank)
        if (c.pp, c.dp, c.tp) != (d.pipe, d.data, d.model):
            raise RuntimeError(f"DeepSpeed's topology puts rank {rank} at pipe {d.pipe} data "
                               f"{d.data} model {d.model}, mt at pp {c.pp} dp {c.dp} tp {c.tp}")
    return ds


def grid_mismatches(grid: Any, groups: ParallelGroups) -> list[str]:
    """Differences between a DeepSpeed ``PipelineParallelGrid`` and mt's groups on this rank
    (empty when DeepSpeed's data, pipe and slice groups hold exactly mt's ranks)."""
    ours = {"data": groups.dp_group_ranks, "pipe": groups.pp_group_ranks,
            "slice": groups.tp_group_ranks}
    theirs = {"data": grid.dp_group, "pipe": grid.pp_group,
              "slice": getattr(grid, "slice_group", groups.tp_group_ranks)}
    problems = [f"{axis} group: DeepSpeed {sorted(theirs[axis])} vs mt {sorted(ranks)}"
                for axis, ranks in ours.items() if sorted(theirs[axis]) != sorted(ranks)]
    if grid.get_stage_id() != groups.pp_rank:
        problems.append(f"stage: DeepSpeed {grid.get_stage_id()} vs mt {groups.pp_rank}")
    return problems
