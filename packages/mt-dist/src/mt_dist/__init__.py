"""mt_dist: 3D-parallel topology maths, process groups and launcher discovery for mt.

Pure pieces (no processes): :class:`Topology`, the SLURM node-list parsers and
:func:`discover`. Process-group pieces: :func:`init_distributed`, :func:`build_groups` and
:func:`finalize_distributed`. The collectives every package uses (along a tensor dimension,
on flat buffers, gloo-aware) live in :mod:`mt_dist.collectives`; the local process
supervisor (N ranks, their reports, the root cause of a failure) in :mod:`mt_dist.supervisor`;
the multi-process test harness built on it in :mod:`mt_dist.testing`.
"""

from mt_dist.groups import ParallelGroups, backend_for, build_groups
from mt_dist.launcher import (
    LaunchError,
    LaunchInfo,
    discover,
    finalize_distributed,
    free_port,
    init_distributed,
    local_device,
)
from mt_dist.nodelist import expand_nodelist, expand_tasks_per_node, first_host
from mt_dist.topology import Coord, Topology, TopologyError

__version__ = "0.1.0"

__all__ = [
    "Coord",
    "LaunchError",
    "LaunchInfo",
    "ParallelGroups",
    "Topology",
    "TopologyError",
    "__version__",
    "backend_for",
    "build_groups",
    "discover",
    "expand_nodelist",
    "expand_tasks_per_node",
    "finalize_distributed",
    "first_host",
    "free_port",
    "init_distributed",
    "local_device",
]
