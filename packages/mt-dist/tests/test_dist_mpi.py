"""mpiexec -> discover (via mpi4py) -> init_distributed (gloo) -> all_reduce.

Skipped when mpiexec or mpi4py is absent (mt-dist itself does not need mpi4py).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mt_dist

# The children import mt_dist from wherever this process does (source tree or Pants sandbox).
SRC = str(Path(mt_dist.__file__).resolve().parents[1])

CHILD = """
import os, torch, torch.distributed as dist
from mt_dist import discover, init_distributed
info = discover(os.environ)
assert info.launcher == "mpi", info
init_distributed(info, "cpu", timeout=60)
value = torch.tensor([float(info.rank + 1)])
dist.all_reduce(value)
print(f"RESULT {info.rank} {info.world_size} {info.local_rank} {info.local_world_size} "
      f"{info.master_addr} {info.master_port > 0} {value.item()}", flush=True)
dist.destroy_process_group()
"""


def _mpiexec_command(n: int) -> list[str]:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not found (pip install mpi4py mpich to run this test)")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py not installed (pip install mpi4py mpich to run this test)")
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    extra = []
    if "Open MPI" in version.stdout + version.stderr:
        extra = ["--allow-run-as-root", "--oversubscribe"]  # root in containers, 2 cores
    return [mpiexec, *extra, "-n", str(n), sys.executable, "-c", CHILD]


def test_mpiexec_discover_and_all_reduce() -> None:
    command = _mpiexec_command(2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(name, None)  # make sure MPI, not an outer launcher, is what gets discovered
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line.split()[1:] for line in proc.stdout.splitlines()
                   if line.startswith("RESULT"))
    assert lines == [
        ["0", "2", "0", "2", "127.0.0.1", "True", "3.0"],
        ["1", "2", "1", "2", "127.0.0.1", "True", "3.0"],
    ], proc.stdout + proc.stderr
