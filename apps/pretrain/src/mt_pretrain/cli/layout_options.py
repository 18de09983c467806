"""The options that place a model on processes, shared by `mt eval`, `mt generate` and
`mt serve` (one wording, one place)."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["Device", "Nproc", "Pp", "Precision", "Tp"]

Tp = Annotated[int, typer.Option(help="Tensor-parallel degree.")]
Pp = Annotated[int, typer.Option(help="Pipeline-parallel degree.")]
Nproc = Annotated[int, typer.Option(
    help="Local processes (without a launcher); dp = nproc / (tp x pp).")]
Device = Annotated[str, typer.Option(help="auto, cpu or cuda.")]
Precision = Annotated[str, typer.Option(help="fp32, bf16 or fp16 weights.")]
