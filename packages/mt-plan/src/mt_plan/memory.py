"""Peak device memory of this rank, and of every rank (one small all-gather).

On CUDA the figures come from torch's caching allocator (``source`` ``"cuda-allocator"``):
the peak bytes allocated to tensors, which is what ``mt plan``'s estimate (model states,
activations, temporaries) predicts, and the peak bytes the allocator reserved from the driver
(allocated plus its cache). On CPU they are the process's resident set size (``source``
``"rss"``): the peak from ``getrusage`` and the current one from ``/proc/self/statm``. RSS
holds everything the process has touched, the Python interpreter and torch's libraries
included (a few hundred MB before the first tensor), so it is an upper bound of what the
planner counts, not the same quantity.

Both peaks only grow during a process (nothing here resets them).

On CPU a training rank first maps every block of 64 KiB or more on its own
(:func:`map_large_blocks`), so that memory freed by the backward pass leaves the RSS and the
peak follows the live bytes the planner counts.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import resource
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["GIB", "MMAP_THRESHOLD", "MemoryPeaks", "MemoryReading", "device_memory",
           "gather_memory", "map_large_blocks", "read_memory", "summary_line"]

GIB = float(2**30)
_MAX_LISTED = 16  # ranks listed one by one in the summary line
# (pid, the highest RSS read in it): a forked child does not inherit its parent's.
_HIGH_WATER: tuple[int, float] = (0, 0.0)


#: Bytes from which a CPU training rank gives each block a mapping of its own.
MMAP_THRESHOLD = 64 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_blocks(environ: Mapping[str, str], threshold: int = MMAP_THRESHOLD) -> bool:
    """Have glibc serve every allocation of ``threshold`` bytes or more with a mapping of its
    own, returned to the system when freed (``mallopt(M_MMAP_THRESHOLD)``).

    glibc's default raises its threshold as mapped blocks are freed (up to 32 MB), after which
    a rank's activations come from its heap and, once freed, stay there: the peak RSS then
    sits well above the planner's live bytes (figures: benchmarks/cp.py). The price is some
    tokens/s (the pages of a new mapping are faulted in afresh). Returns whether it
    was set: not where the C library is not glibc, nor where the user chose a threshold
    (``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...``), which
    wins."""
    if "MALLOC_MMAP_THRESHOLD_" in environ or \
            "glibc.malloc.mmap_threshold" in environ.get("GLIBC_TUNABLES", ""):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


@dataclass(frozen=True)
class MemoryReading:
    """One rank's memory, in bytes.

    Attributes:
        source: ``"cuda-allocator"`` (torch's CUDA caching allocator) or ``"rss"`` (the
            process's resident set size, on CPU).
        peak: peak allocated (CUDA) or peak RSS (CPU).
        current: allocated now (CUDA) or RSS now (CPU); NaN where the OS does not say.
        reserved: peak reserved by the caching allocator (CUDA); None on CPU.
    """

    source: str
    peak: float
    current: float
    reserved: float | None = None


def _current_rss() -> float:
    """Resident set size now: pages in ``/proc/self/statm`` x page size (NaN without /proc)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return math.nan
    return float(pages * os.sysconf("SC_PAGE_SIZE"))


def _peak_rss() -> float:
    """Peak resident set size of this process (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)


def read_memory(device: torch.device | str) -> MemoryReading:
    """This process's memory on ``device`` (cuda: the allocator's peaks on that device; cpu:
    the process's RSS). Cheap: no synchronization, no collective."""
    device = torch.device(device)
    if device.type == "cuda":
        return MemoryReading("cuda-allocator", float(torch.cuda.max_memory_allocated(device)),
                             float(torch.cuda.memory_allocated(device)),
                             float(torch.cuda.max_memory_reserved(device)))
    if device.type != "cpu":
        raise ValueError(f"no memory reading for device type {device.type!r} (cpu or cuda)")
    current = _current_rss()
    # The kernel's RSS counters are approximate (per-CPU batches): ru_maxrss can trail the
    # current RSS by a few hundred KiB. The peak is at least every RSS this process has read,
    # so it is never below the current one and never falls.
    global _HIGH_WATER
    pid, high = _HIGH_WATER
    high = max(high if pid == os.getpid() else 0.0, _peak_rss(),
               0.0 if math.isnan(current) else current)
    _HIGH_WATER = (os.getpid(), high)
    return MemoryReading("rss", high, current)


def device_memory(device: torch.device | str) -> tuple[float, str] | None:
    """The bytes of ``device`` on this machine, and the same in words (``the 23.5 GiB of RAM
    here``): on CUDA the GPU's total memory, on CPU the host's physical memory (which the
    ranks on it share). None where it cannot be told (no such GPU here, no figure from the
    system)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"the {props.total_memory / GIB:.1f} GiB of the " \
            f"{props.name}"
    try:
        total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return None
    return total, f"the {total / GIB:.1f} GiB of RAM here"


@dataclass(frozen=True)
class MemoryPeaks:
    """Every rank's :class:`MemoryReading`, in rank order (bytes)."""

    source: str
    peak: list[float]
    current: list[float]
    reserved: list[float] | None = None

    @property
    def max_peak(self) -> float:
        """The largest peak over the ranks (bytes)."""
        return max(self.peak)

    def metrics(self) -> dict[str, Any]:
        """The metrics-line keys (GiB, rounded to ~1 KiB): ``peak_mem_gib`` (max over ranks)
        and ``peak_mem_gib_per_rank``, on CUDA ``peak_reserved_gib`` and
        ``peak_reserved_gib_per_rank`` too, and ``mem_source``."""
        peak = [_gib(b) for b in self.peak]
        line: dict[str, Any] = {"peak_mem_gib": max(peak), "peak_mem_gib_per_rank": peak}
        if self.reserved is not None:
            reserved = [_gib(b) for b in self.reserved]
            line.update(peak_reserved_gib=max(reserved), peak_reserved_gib_per_rank=reserved)
        line["mem_source"] = self.source
        return line


def _gib(n: float) -> float:
    return round(n / GIB, 6)


def gather_memory(device: torch.device | str, group: ProcessGroup | None = None
                  ) -> MemoryPeaks:
    """Every rank's memory on every rank of ``group`` (None: the default, world group): one
    all-gather of three float64 per rank, on ``device`` (NCCL needs CUDA tensors). A
    collective: every rank of the group must call it. Without an initialized process group,
    just this process."""
    device = torch.device(device)
    mine = read_memory(device)
    reserved = math.nan if mine.reserved is None else mine.reserved
    local = torch.tensor([mine.peak, mine.current, reserved], dtype=torch.float64,
                         device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, local, group=group)
        table = torch.stack(rows).tolist()
    else:
        table = [local.tolist()]
    return MemoryPeaks(mine.source, [r[0] for r in table], [r[1] for r in table],
                       None if mine.reserved is None else [r[2] for r in table])


def summary_line(peaks: MemoryPeaks, planned: float | None = None,
                 planned_stage: int | None = None) -> str:
    """The end-of-run memory line: the measured peak (max and per rank) beside the planner's
    estimate ``planned`` (bytes per rank of the fullest pipeline stage ``planned_stage``)."""
    n = len(peaks.peak)
    per_rank = ", ".join(f"{b / GIB:.2f}" for b in peaks.peak[:_MAX_LISTED])
    if n > _MAX_LISTED:
        per_rank += f", ... ({n - _MAX_LISTED} more)"
    ranks = f"max over {n} rank{'s' if n > 1 else ''}; per rank {per_rank}"
    if peaks.source == "rss":
        text = f"memory     peak RSS {peaks.max_peak / GIB:.3f} GiB ({ranks})"
    else:
        text = (f"memory     peak allocated {peaks.max_peak / GIB:.3f} GiB ({ranks}), peak "
                f"reserved {max(peaks.reserved or [0.0]) / GIB:.3f} GiB")
    if planned is None:
        return text
    stage = "the fullest stage" if planned_stage is None else (
        f"stage {planned_stage}, the fullest")
    text += f"; planned {planned / GIB:.3f} GiB per rank ({stage})"
    if peaks.source == "rss":
        text += (": the planner counts model states, activations and temporaries; RSS also "
                 "holds the Python interpreter and torch (a few hundred MB)")
    else:
        text += (": the planner counts model states, activations and temporaries, as the "
                 "allocator figure does (not the CUDA context)")
    return text
