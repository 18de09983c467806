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
import os
import warnings
from pathlib import Path
from typing import Any

__all__ = ["DATA_ORDER", "FORMAT", "LATEST", "META", "RANK_FORMAT", "CheckpointError",
           "find_checkpoint", "fresh_start", "fsync_dir", "has_checkpoints", "rank_file",
           "read_meta",
           "step_dir", "write_synced"]

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


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably (temporary file, fsync,
    rename, fsync of the folder): a crash leaves the old content or the new, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _problem(folder: Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or None."""
    if not folder.is_dir():
        return "missing"
    try:
        meta = read_meta(folder)
    except CheckpointError as err:
        return str(err)
    world = int(meta.get("layout", {}).get("world_size", 0))
    files = [folder / rank_file(r) for r in range(world)]
    absent = [f.name for f in files if not f.is_file() or not f.stat().st_size]
    if absent:
        return f"missing or empty: {', '.join(absent[:3])}" + (" ..." if len(absent) > 3 else "")
    return None


def _newest_complete(root: Path) -> tuple[Path | None, list[str]]:
    """The newest complete ``step-*`` folder under ``root`` and what was skipped on the way."""
    skipped = []
    for folder in sorted(root.glob("step-*"), reverse=True):
        problem = _problem(folder)
        if problem is None:
            return folder, skipped
        skipped.append(f"{folder.name} ({problem})")
    return None, skipped


def find_checkpoint(path: str | Path) -> Path:
    """The step folder ``path`` designates: itself, or the one its ``latest`` names. When
    ``latest`` is missing or names an incomplete folder (a crash while saving), the newest
    complete step folder, with a warning naming what was skipped."""
    path = Path(path)
    if (path / META).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: no such folder")
    pointer = path / LATEST
    named = None
    if pointer.is_file():
        named = path / pointer.read_text(encoding="utf-8").strip()
        if _problem(named) is None:
            return named
    fallback, skipped = _newest_complete(path)
    if fallback is None:
        what = f"{pointer} names {named.name}, which is {_problem(named)}" if named else (
            f"neither {META} nor {LATEST} found")
        raise CheckpointError(f"no complete checkpoint at {path}: {what}"
                              + (f"; skipped {', '.join(skipped)}" if skipped else ""))
    why = (f"{pointer} names {named.name}, which is {_problem(named)}" if named is not None
           else f"{path} has no {LATEST}")
    warnings.warn(f"{why}: loading {fallback.name}, the newest complete checkpoint"
                  + (f" (skipped {', '.join(skipped)})" if skipped else ""), stacklevel=2)
    return fallback


def has_checkpoints(root: Path) -> bool:
    """Whether ``root`` holds any checkpoint, complete or not (a pointer or a step folder)."""
    return (root / LATEST).is_file() or any(p.is_dir() for p in root.glob("step-*"))


def fresh_start(load: str | None, save_dir: Path | None) -> bool:
    """Whether ``--load`` names the run's own checkpoint folder while it holds no checkpoint
    yet (or does not exist): then the run starts at step 0, so that the first job of a chain
    runs the same command as the next ones (as Megatron-LM's --load)."""
    if load is None or save_dir is None:
        return False
    path = Path(load)
    return (path.resolve() == save_dir.resolve() and not (path / META).is_file()
            and not has_checkpoints(path))


def read_meta(folder: Path) -> dict[str, Any]:
    """The parsed ``meta.json`` of a step folder (one-line errors for a damaged one)."""
    path = folder / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: damaged ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path}: format {found!r}, expected {FORMAT!r}")
    missing = [k for k in ("step", "data", "layout", "model", "styles", "stage_params")
               if k not in meta]
    if missing:
        raise CheckpointError(f"{path}: damaged (no {', '.join(missing)})")
    return meta
