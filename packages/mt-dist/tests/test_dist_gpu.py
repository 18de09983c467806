"""NCCL path on real GPUs: skipped where CUDA is absent (e.g. the CPU dev machines)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mt_dist import free_port

SRC = str(Path(__file__).resolve().parents[1] / "src")

# Each rank is a fresh interpreter so the pytest process never initializes CUDA.
CHILD = """
import sys, torch, torch.distributed as dist
from mt_dist import LaunchInfo, Topology, build_groups, init_distributed, local_device
rank, world, port = (int(x) for x in sys.argv[1:4])
info = LaunchInfo(rank, world, rank, world, "127.0.0.1", port, "torchrun")
device = local_device(info, use_cuda=True)
init_distributed(info, device, timeout=120)
groups = build_groups(Topology(dp=world), device)
value = torch.tensor([float(rank + 1)], device=device)
dist.all_reduce(value, group=groups.dp)
print("RESULT", groups.backend, value.item(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL backend)")
def test_nccl_init_and_groups_on_gpus() -> None:
    world = min(2, torch.cuda.device_count())
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (SRC, os.environ.get(
        "PYTHONPATH"))))}
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(world), port], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    expected = float(sum(range(1, world + 1)))
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
        assert f"RESULT nccl {expected}" in out, out
