"""The options that place a model on processes, shared by `mt eval`, `mt generate` and
`mt serve` (one wording, one place)."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["Device", "Nproc", "Pp", "Precision", "Tp", "placement_problems",
           "process_problems"]

Tp = Annotated[int, typer.Option(help="Tensor-parallel degree.")]
Pp = Annotated[int, typer.Option(help="Pipeline-parallel degree.")]
Nproc = Annotated[int, typer.Option(
    help="Local processes (without a launcher); dp = nproc / (tp x pp).")]
Device = Annotated[str, typer.Option(help="auto, cpu or cuda.")]
Precision = Annotated[str, typer.Option(help="fp32, bf16 or fp16 weights.")]


def placement_problems(device: str, precision: str) -> list[str]:
    """What is wrong with --device and --precision (one line each; empty: nothing). Asks
    torch whether CUDA is there only for --device cuda (the command loads torch anyway)."""
    from mt_zero.precision import PRECISIONS

    problems = []
    if device not in ("auto", "cpu", "cuda"):
        problems.append(f"--device must be auto, cpu or cuda, got {device!r}")
    elif device == "cuda":
        import torch

        if not torch.cuda.is_available():
            why = (f"torch {torch.__version__} is built without CUDA"
                   if torch.version.cuda is None else "torch sees no GPU on this machine")
            problems.append(f"--device cuda: {why}; use --device cpu (or auto)")
    if precision not in PRECISIONS:
        problems.append(f"--precision must be one of {', '.join(PRECISIONS)}, got "
                        f"{precision!r}")
    return problems


def process_problems(tp: int, pp: int, nproc: int) -> list[str]:
    """What is wrong with --nproc for --tp x --pp, found before any process is started (was:
    --nproc 2**70 forked ranks without end, and a --nproc that --tp x --pp does not divide
    started every rank first). Values below 1 are each command's to word."""
    import os

    from mt_dist import LaunchError, discover
    from mt_plan.layout import MAX_WORLD_SIZE

    if min(tp, pp, nproc) < 1:
        return []
    try:
        local = discover(os.environ, use_mpi4py=False).launcher == "single"
    except LaunchError:
        local = True  # the command reports the launcher's variables itself
    if tp * pp > MAX_WORLD_SIZE:
        return [f"--tp x --pp must be at most {MAX_WORLD_SIZE:,} processes, got {tp * pp:,}"]
    if not local:  # a launcher's ranks: --nproc is not used
        return []
    if nproc > MAX_WORLD_SIZE:
        return [f"--nproc must be at most {MAX_WORLD_SIZE:,} processes, got {nproc:,}"]
    if nproc % (tp * pp):
        return [f"--nproc {nproc} is not divisible by --tp {tp} x --pp {pp} = {tp * pp}"]
    return []
