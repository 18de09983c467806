"""Where a checkpoint runs for scoring, decoding and serving: the one placement type that
`mt eval`, `mt generate`, `mt serve` and `mt bias` share (and the checks of its numbers)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEVICES", "Placement", "PlacementError"]

DEVICES = ("auto", "cpu", "cuda")


class PlacementError(ValueError):
    """A placement that cannot run: the layout, the device or the tokenizer, named."""


@dataclass(frozen=True)
class Placement:
    """A checkpoint at a TP x PP layout on processes (data parallelism takes the rest)."""

    checkpoint: str
    """An mt pretrain checkpoint, or any folder mt convert reads (converted once)."""
    tp: int = 1
    pp: int = 1
    nproc: int = 1
    """Local processes without a launcher (under torchrun, mpirun or srun: its ranks)."""
    device: str = "auto"
    precision: str = "fp32"
    tokenizer: str | None = None
    """Instead of the checkpoint's own."""
    timeout: float = 600.0
    """Seconds a collective waits for the other ranks."""

    def problems(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """What is wrong with the numbers and names, each naming its flag (empty: none);
        found before any process starts or any weight is read. Asks torch only for
        --device cuda."""
        from mt_zero.precision import PRECISIONS

        problems = [f"--{name} must be positive, got {value}" for name, value in
                    (("tp", self.tp), ("pp", self.pp), ("nproc", self.nproc),
                     ("timeout", self.timeout)) if not 0 < value < float("inf")]
        if self.device not in DEVICES:
            problems.append(f"--device must be auto, cpu or cuda, got {self.device!r}")
        elif self.device == "cuda":
            problems += _cuda_problems()
        if self.precision not in PRECISIONS:
            problems.append(f"--precision must be one of {', '.join(PRECISIONS)}, got "
                            f"{self.precision!r}")
        if not problems:
            problems += self._process_problems(os.environ if environ is None else environ)
        return problems

    def _process_problems(self, environ: Mapping[str, str]) -> list[str]:
        """--nproc against --tp x --pp, before any process is started (a --nproc of 2**70
        would fork ranks without end)."""
        from mt_dist import LaunchError, discover
        from mt_plan.layout import MAX_WORLD_SIZE

        tp, pp, nproc = self.tp, self.pp, self.nproc
        if tp * pp > MAX_WORLD_SIZE:
            return [f"--tp x --pp must be at most {MAX_WORLD_SIZE:,} processes, got "
                    f"{tp * pp:,}"]
        try:
            local = discover(environ, use_mpi4py=False).launcher == "single"
        except LaunchError:
            local = True  # the launch reports the launcher's variables itself
        if not local:  # a launcher's ranks: --nproc is not used
            return []
        if nproc > MAX_WORLD_SIZE:
            return [f"--nproc must be at most {MAX_WORLD_SIZE:,} processes, got {nproc:,}"]
        if nproc % (tp * pp):
            return [f"--nproc {nproc} is not divisible by --tp {tp} x --pp {pp} = {tp * pp}"]
        return []

    def whole_here(self, environ: Mapping[str, str] | None = None) -> bool:
        """The model whole on this one process: no layout and no launcher."""
        from mt_dist import discover

        return (self.tp, self.pp, self.nproc) == (1, 1, 1) and discover(
            os.environ if environ is None else environ).launcher == "single"


def _cuda_problems() -> list[str]:
    import torch

    if torch.cuda.is_available():
        return []
    why = (f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None
           else "torch sees no GPU on this machine")
    return [f"--device cuda: {why}; use --device cpu (or auto)"]
