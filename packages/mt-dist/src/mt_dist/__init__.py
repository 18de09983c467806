"""mt_dist: 3D-parallel topology maths, process groups and launcher discovery for mt.

Pure pieces (no processes): :class:`Topology`, the SLURM node-list parsers and
:func:`discover`. Process-group pieces: :func:`init_distributed`, :func:`build_groups` and
:func:`finalize_distributed`. The collectives every package uses (along a tensor dimension,
on flat buffers, gloo-aware) live in :mod:`mt_dist.collectives`; the local process
supervisor (N ranks, their reports, the root cause of a failure) in :mod:`mt_dist.supervisor`;
the multi-process test harness built on it in :mod:`mt_dist.testing`; how every command
ends on an error (one line, exit 2 / 1 / 130) in :mod:`mt_dist.exits`. Only the pure pieces
are imported eagerly: the rest (torch) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mt_dist.nodelist import expand_nodelist, expand_tasks_per_node, first_host
from mt_dist.topology import Coord, Topology, TopologyError

if TYPE_CHECKING:  # imported on first use (see __getattr__); named here for tools
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

#: Names whose modules import torch (seconds): loaded on first use, so that what needs only
#: the pure parts (a planner, mt_dist.exits in a command line's error path) never pays for it.
_LAZY = {name: module for module, names in {
    "mt_dist.groups": ("ParallelGroups", "backend_for", "build_groups"),
    "mt_dist.launcher": ("LaunchError", "LaunchInfo", "discover", "finalize_distributed",
                         "free_port", "init_distributed", "local_device"),
}.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mt_dist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
