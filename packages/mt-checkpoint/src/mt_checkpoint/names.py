"""The names of mt's training checkpoint format: versions, files, folders, the rank seed."""

from __future__ import annotations

__all__ = ["DATA_ORDER", "FORMAT", "LATEST", "MANIFEST", "META", "RANK_FORMAT",
           "CheckpointError", "rank_file", "rank_seed", "sidecar_rank_file", "step_dir"]

FORMAT = "mt-pretrain/1"
RANK_FORMAT = "mt-pretrain-rank/1"
LATEST = "latest"
META = "meta.json"
#: Checksums of a checkpoint folder written by another library (DeepSpeed's engine).
MANIFEST = "mt-checksums.json"
#: The sample order of mt-data's GPTDataset a checkpoint's data position counts in: 2 is the
#: order that does not depend on the run's length. Checkpoints without the key used order 1.
DATA_ORDER = 2


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model."""


def rank_file(rank: int) -> str:
    """File name of ``rank``'s shard."""
    return f"rank-{rank:05d}.pt"


def sidecar_rank_file(rank: int) -> str:
    """File name of ``rank``'s data position and RNG states in a checkpoint folder another
    library writes (DeepSpeed's engine; mt's own rank files hold them)."""
    return f"mt-rank-{rank:05d}.pt"


def step_dir(step: int) -> str:
    """Folder name of the checkpoint of ``step``."""
    return f"step-{step:08d}"


def rank_seed(seed: int, pp_rank: int, dp_rank: int) -> int:
    """The seed of a rank's default torch generator: equal across TP ranks (replicated
    dropout must match), different across pipeline stages and data-parallel replicas. A
    training run seeds with it; a checkpoint moved to another layout gets states from it."""
    return seed + 100 * pp_rank + 10007 * dp_rank
