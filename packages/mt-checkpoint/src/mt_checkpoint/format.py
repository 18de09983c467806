"""The on-disk format of mt training checkpoints: names, pointers, ``meta.json``, rank files,
and the protocol that publishes a step atomically.

No model and no process group here: a checkpoint can be inspected, resolved and resharded
from one process (mt pretrain's ``--load``, mt convert). Layout of a checkpoint folder::

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
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["DATA_ORDER", "FORMAT", "LATEST", "META", "RANK_FORMAT", "CheckpointError",
           "clean_stale", "find_checkpoint", "fresh_start", "fsync_dir", "has_checkpoints",
           "load_rank", "publish_step", "rank_file", "read_meta", "step_dir", "write_synced"]

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


def load_rank(folder: Path, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s file of a step folder, read weights-only (tensors and plain containers,
    never arbitrary objects); one-line errors for a missing, empty or damaged file."""
    path = folder / rank_file(rank)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {folder} lacks {path.name}: incomplete checkpoint")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises many kinds for a damaged file
        size = path.stat().st_size
        reason = "empty" if size == 0 else f"damaged or truncated ({size:,} bytes: " + \
            f"{str(err).splitlines()[0] if str(err) else type(err).__name__})"
        raise CheckpointError(f"{path}: {reason}; load an earlier step folder of "
                              f"{folder.parent} instead") from None
    if not isinstance(data, dict) or data.get("format") != RANK_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"{path}: format {found!r}, expected {RANK_FORMAT}")
    return data


def clean_stale(root: Path) -> None:
    """Remove what a killed save left behind (never loaded: names start with a dot)."""
    for stale in [*root.glob(".step-*.tmp"), *root.glob(".step-*.replaced")]:
        shutil.rmtree(stale, ignore_errors=True)


def publish_step(root: Path, tmp: Path, meta: dict[str, Any], keep_last: int,
                 phase: Callable[[str], None] | None = None) -> Path:
    """Publish the step written into ``tmp`` (every rank file complete) as
    ``root/step-XXXXXXXX`` and make ``latest`` name it; returns the folder.

    Order: meta.json written and synced; a step folder of the same number (saved before by a
    run that was rolled back) moved aside, not deleted; the new folder renamed into place;
    ``latest`` replaced atomically and synced; then the old copy removed and all but the
    ``keep_last`` newest step folders pruned. At no point does ``latest`` name a folder that is
    incomplete, and where it names none for an instant, :func:`find_checkpoint` falls back
    to the newest complete step. ``phase(name)`` is called after each step of the protocol
    (``meta``, ``replace``, ``rename``, ``pointer``, ``prune``): fault injection in tests.
    """
    def passed(name: str) -> None:
        if phase is not None:
            phase(name)

    final = root / step_dir(int(meta["step"]))
    meta = {"format": FORMAT, **meta}
    write_synced(tmp / META, json.dumps(meta, indent=1))
    fsync_dir(tmp)
    passed("meta")
    replaced = root / f".{final.name}.replaced"
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
        passed("replace")
    os.rename(tmp, final)
    fsync_dir(root)
    passed("rename")
    write_synced(root / LATEST, final.name + "\n")
    passed("pointer")
    shutil.rmtree(replaced, ignore_errors=True)
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[: max(len(steps) - keep_last, 0)]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    passed("prune")
    return final
