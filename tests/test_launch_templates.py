"""The launch templates of infra/launch parse as bash scripts (one did not: an apostrophe in a
`${VAR:?message}`), and the restart settings stay in them: torchrun restarts failed workers,
SLURM requeues a job after a node failure, and mt resumes from --save in both cases."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[1] / "infra" / "launch"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("name", ["torchrun-multinode.sh", "mpirun.sh",
                                  "slurm-mt-nlg-530b.sbatch"])
def test_template_parses(name: str) -> None:
    done = subprocess.run(["bash", "-n", str(LAUNCH / name)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_templates_restart_and_resume() -> None:
    torchrun = (LAUNCH / "torchrun-multinode.sh").read_text()
    assert '--max-restarts "${MAX_RESTARTS:-3}"' in torchrun
    slurm = (LAUNCH / "slurm-mt-nlg-530b.sbatch").read_text()
    assert "#SBATCH --requeue" in slurm and "--save-interval" in slurm
