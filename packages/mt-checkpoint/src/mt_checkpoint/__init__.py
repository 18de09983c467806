"""mt-checkpoint: the on-disk format of mt training checkpoints and resharding between layouts.

- :mod:`mt_checkpoint.names`: versions and names (``latest``, ``step-XXXXXXXX``,
  ``rank-XXXXX.pt``, ``meta.json``), the rank seed.
- :class:`CheckpointMeta`: ``meta.json`` as a typed, frozen dataclass (read, written,
  moved to another layout).
- :mod:`mt_checkpoint.format`: finding the step to load (falling back to the newest complete
  one), writing and weights-only reading of rank files, the atomic publish protocol.
- :mod:`mt_checkpoint.background`: asynchronous saves: the state snapshotted into host memory
  kept from save to save, written by a writer process while training goes on
  (``wait_for_ranks``: publishing without a collective).
- :class:`DirectFile` (:mod:`mt_checkpoint.direct_io`): large files written past the page
  cache (``O_DIRECT`` for whole blocks, buffered elsewhere or where the file system refuses
  it): every rank file, and the safetensors files of mt-formats; :func:`direct_buffer`,
  its buffers (huge pages, so that a direct request leaves whole).
- :mod:`mt_checkpoint.checksums`: every rank file's size and CRC-32C in ``meta.json`` (and
  ``meta.json``'s own), checked whenever a file is read.
- :mod:`mt_checkpoint.manifest`: the same checksums for a folder another library wrote
  (DeepSpeed's engine), in ``mt-checksums.json``, computed and verified by all ranks in parts.
- :class:`SavedLayout`: the layout a checkpoint was written at; which rank file holds which
  (stage, replica, TP slice), in mt-dist's rank order.
- :mod:`mt_checkpoint.materialize`: this rank's pipeline stage of a GPT at a TP x PP layout,
  each parameter its exact slice of a full value (the unsharded init, or a checkpoint's
  weights).
- :mod:`mt_checkpoint.reshard`: optimizer state and weights merged to full shape and cut
  again for another (TP, PP, DP) layout, through mt-zero's and mt-tensor-parallel's
  public functions.

``mt pretrain`` writes and loads its checkpoints with it; ``mt convert`` reads and writes
them with it. Neither knows a file name or the rank formula.
"""

from mt_checkpoint.background import BackgroundWrite, HostBuffers, Snapshot, snapshot, to_host
from mt_checkpoint.direct_io import DirectFile, direct_buffer
from mt_checkpoint.format import (
    clean_stale,
    find_checkpoint,
    fresh_rng,
    fresh_start,
    fsync_dir,
    has_checkpoints,
    load_rank,
    publish_step,
    rank_payload,
    remove_checkpoints,
    save_payload,
    save_rank,
    unfinished_step,
    verify_rank_file,
    wait_for_ranks,
    write_meta,
    write_synced,
)
from mt_checkpoint.layout import SavedLayout
from mt_checkpoint.manifest import (
    folder_files,
    read_manifest,
    sum_files,
    verify_files,
    write_manifest,
)
from mt_checkpoint.materialize import Built, materialize_stage, sharding_styles
from mt_checkpoint.meta import CheckpointMeta, read_meta
from mt_checkpoint.names import (
    DATA_ORDER,
    FORMAT,
    LATEST,
    MANIFEST,
    META,
    RANK_FORMAT,
    CheckpointError,
    rank_file,
    rank_seed,
    sidecar_rank_file,
    step_dir,
)
from mt_checkpoint.reshard import canonical_optimizer, cut, local_optimizer, merge_model

__version__ = "0.1.0"

__all__ = [
    "DATA_ORDER",
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "META",
    "RANK_FORMAT",
    "BackgroundWrite",
    "Built",
    "CheckpointError",
    "CheckpointMeta",
    "DirectFile",
    "direct_buffer",
    "HostBuffers",
    "SavedLayout",
    "Snapshot",
    "__version__",
    "canonical_optimizer",
    "clean_stale",
    "cut",
    "find_checkpoint",
    "folder_files",
    "fresh_rng",
    "fresh_start",
    "fsync_dir",
    "has_checkpoints",
    "load_rank",
    "local_optimizer",
    "materialize_stage",
    "merge_model",
    "publish_step",
    "rank_file",
    "rank_payload",
    "rank_seed",
    "read_manifest",
    "read_meta",
    "remove_checkpoints",
    "save_payload",
    "save_rank",
    "sharding_styles",
    "sidecar_rank_file",
    "snapshot",
    "step_dir",
    "to_host",
    "unfinished_step",
    "sum_files",
    "verify_files",
    "verify_rank_file",
    "wait_for_ranks",
    "write_manifest",
    "write_meta",
    "write_synced",
]
