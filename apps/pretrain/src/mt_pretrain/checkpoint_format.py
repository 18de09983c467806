"""The on-disk format of `mt pretrain` checkpoints: names, pointers and ``meta.json``.

Only plain file handling lives here (no model, no process groups), so that resolving a run
(:mod:`mt_pretrain.plan`) can read what a checkpoint holds before anything is built.
:mod:`mt_pretrain.checkpoint` writes and loads the tensors. Layout of a checkpoint folder::

    DIR/latest                 name of the newest complete step folder (written last)
    DIR/step-00000020/
        meta.json              step, data position, layout, model + run config, the
                               parameter names of every pipeline stage
        rank-00000.pt ...      per rank: model weights (DP rank 0 only), ZeRO optimizer
                               shard (fp32 master + Adam moments), RNG states
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["DATA_ORDER", "FORMAT", "LATEST", "META", "RANK_FORMAT", "CheckpointError",
           "find_checkpoint", "rank_file", "read_meta", "step_dir"]

FORMAT = "mt-pretrain/1"
RANK_FORMAT = "mt-pretrain-rank/1"
LATEST = "latest"
META = "meta.json"
#: The sample order of mt-data's GPTDataset a checkpoint's data position counts in: 2 is the
#: order that does not depend on the run's length. Checkpoints without the key used order 1.
DATA_ORDER = 2


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model."""


def rank_file(rank: int) -> str:
    """File name of ``rank``'s shard."""
    return f"rank-{rank:05d}.pt"


def step_dir(step: int) -> str:
    """Folder name of the checkpoint of ``step``."""
    return f"step-{step:08d}"


def find_checkpoint(path: str | Path) -> Path:
    """The step folder ``path`` designates: itself, or the one its ``latest`` names."""
    path = Path(path)
    if (path / META).is_file():
        return path
    if (path / LATEST).is_file():
        target = path / (path / LATEST).read_text(encoding="utf-8").strip()
        if (target / META).is_file():
            return target
        raise CheckpointError(f"{path / LATEST} names {target.name}, which is incomplete")
    raise CheckpointError(f"no checkpoint at {path} (neither {META} nor {LATEST} found)")


def read_meta(folder: Path) -> dict[str, Any]:
    """The parsed ``meta.json`` of a step folder."""
    meta = json.loads((folder / META).read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder / META}: format {meta.get('format')!r}, expected "
                              f"{FORMAT!r}")
    return meta
