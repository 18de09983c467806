"""The on-disk format of mt training checkpoints: names, pointers, ``meta.json``, rank files,
and the protocol that publishes a step atomically.

No model and no process group here: a checkpoint can be inspected, resolved and resharded
from one process (mt pretrain's ``--load``, mt convert). Layout of a checkpoint folder::

    DIR/latest                 name of the newest complete step folder (written last)
    DIR/step-00000020/
        meta.json              step, data position, layout, model + run config, the
                               parameter names of every pipeline stage, every rank file's
                               size and CRC-32C, and its own CRC-32C
        rank-00000.pt ...      per rank: model weights (DP rank 0 only), ZeRO optimizer
                               shard (fp32 master + Adam moments), RNG states

Every file is checked against its checksum when read (:mod:`mt_checkpoint.checksums`).
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mt_checkpoint.checksums import ChecksumWriter, collect_sums, not_recorded, verify_file
from mt_checkpoint.direct_io import DirectFile
from mt_checkpoint.meta import CheckpointMeta, read_meta
from mt_checkpoint.names import (
    LATEST,
    META,
    RANK_FORMAT,
    CheckpointError,
    rank_file,
    rank_seed,
    step_dir,
)

__all__ = ["clean_stale", "find_checkpoint", "fresh_rng", "fresh_start", "fsync_dir",
           "has_checkpoints", "load_rank", "publish_step", "rank_payload", "save_payload",
           "save_rank", "verify_rank_file", "write_meta", "write_synced"]


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (renames, new files) durable: the training stack's one helper
    for it (the training checkpoint and every format of mt-formats; the torch-free mt-data,
    which shares no package with this stack, applies the same rule in its ``shards``). A
    filesystem that cannot sync a folder (EINVAL / ENOTSUP: some network filesystems) is
    left to its own guarantees."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
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
    files = [folder / rank_file(r) for r in range(meta.layout.world_size)]
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
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: a file, not a checkpoint folder (a "
                              f"run's checkpoint folder, or one of its step folders)")
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: no such folder")
    pointer = path / LATEST
    named, why = None, f"{path} has no {LATEST}"
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8", errors="replace").strip()
        if not name or Path(name).name != name or name in (".", ".."):
            why = (f"{pointer} is empty" if not name else
                   f"{pointer} is damaged (it names {name!r}, not a step folder of {path})")
        else:
            named = path / name
            if (problem := _problem(named)) is None:
                return named
            why = f"{pointer} names {name}" + (  # a state, or a message naming its file
                f", which is {problem}" if problem.startswith("missing") else f": {problem}")
    fallback, skipped = _newest_complete(path)
    if named is not None:  # said once, in ``why``
        skipped = [entry for entry in skipped if not entry.startswith(f"{named.name} (")]
    if fallback is None:
        what = why if pointer.is_file() else f"neither {META} nor {LATEST} found"
        raise CheckpointError(f"no complete checkpoint at {path}: {what}"
                              + (f"; skipped {', '.join(skipped)}" if skipped else ""))
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


def verify_rank_file(folder: Path, rank: int, meta: CheckpointMeta | None = None) -> Path:
    """The path of rank ``rank``'s file of a step folder, checked against the size and
    CRC-32C ``meta.json`` records for it (``meta``: the folder's, read if not given)."""
    path = folder / rank_file(rank)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {folder} lacks {path.name}: incomplete checkpoint")
    verify_file(path, dict((meta or read_meta(folder)).files))
    return path


def load_rank(folder: Path, rank: int, meta: CheckpointMeta | None = None) -> dict[str, Any]:
    """Rank ``rank``'s file of a step folder, checked against its checksum
    (:func:`verify_rank_file`), then read weights-only (tensors and plain containers, never
    arbitrary objects); one-line errors for a missing, empty, damaged or altered file."""
    path = verify_rank_file(folder, rank, meta)
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


def save_rank(folder: Path, rank: int, coord: tuple[int, ...], model: dict[str, Any],
              optimizer: dict[str, Any], rng: dict[str, Any]) -> int:
    """Write rank ``rank``'s file into ``folder`` durably; returns its size in bytes.

    ``coord``: its (pp, dp, tp) place (and cp index with context parallelism); ``model``: its
    weights (empty but on DP replica 0's first context slice);
    ``optimizer``: its ZeRO shard (``mt_zero.optimizer_shard_state``); ``rng``: ``torch``,
    ``cuda`` (or None) and ``tracker`` (tensor-parallel streams, or empty) states.
    """
    return save_payload(folder, rank, rank_payload(rank, coord, model, optimizer, rng))


def rank_payload(rank: int, coord: tuple[int, ...], model: dict[str, Any],
                 optimizer: dict[str, Any], rng: dict[str, Any]) -> dict[str, Any]:
    """What :func:`save_rank` pickles into rank ``rank``'s file."""
    return {"format": RANK_FORMAT, "rank": rank, "coord": list(coord), "model": model,
            "optimizer": optimizer, "rng": rng}


def save_payload(folder: Path, rank: int, payload: dict[str, Any]) -> int:
    """Write :func:`rank_payload`'s ``payload`` as rank ``rank``'s file of ``folder``
    durably; returns its size in bytes. Built in one process and written in another (an
    asynchronous save's writer), the file has the same bytes: the payload crosses as one
    object, so its strings and tensors keep the sharing that the pickle records."""
    path = folder / rank_file(rank)
    with DirectFile(path) as f:  # past the page cache: nothing reads it back soon
        checked = ChecksumWriter(f)
        try:
            torch.save(payload, checked)
        except RuntimeError:
            if checked.error is not None:  # disk full, quota...: the cause, naming the file
                raise OSError(checked.error.errno, checked.error.strerror, str(path)) from None
            raise
    checked.record(path)
    return checked.size


def write_meta(folder: Path, meta: CheckpointMeta) -> CheckpointMeta:
    """Write ``folder``'s ``meta.json`` durably, with the checksum of every rank file of
    ``meta``'s layout (each written by :func:`save_rank` into ``folder``); returns the meta
    written."""
    names = [rank_file(r) for r in range(meta.layout.world_size)]
    meta = replace(meta, files=collect_sums(folder, names))
    write_synced(folder / META, meta.as_json())
    return meta


def unfinished_step(root: Path) -> int | None:
    """The newest step whose save into ``root`` did not finish (its ``.step-*.tmp`` folder
    left by a crash or a kill during the write), or None."""
    steps = [tmp.name[len(".step-"):-len(".tmp")] for tmp in root.glob(".step-*.tmp")]
    return max((int(step) for step in steps if step.isdigit()), default=None)


def wait_for_ranks(folder: Path, world_size: int, timeout: float,
                   poll: float = 0.05) -> None:
    """Block until every rank's file of ``folder`` is written (its checksum recorded): how an
    asynchronous save's publisher learns that the others are done without a collective (their
    writers run beside training, whose collectives they must not interleave with). A
    :class:`CheckpointError` naming the missing ranks after ``timeout`` seconds."""
    names = [rank_file(r) for r in range(world_size)]
    deadline = time.monotonic() + timeout
    while missing := not_recorded(folder, names):
        if time.monotonic() > deadline:
            raise CheckpointError(f"{folder}: {len(missing)} rank files not written within "
                                  f"{timeout:g} s ({', '.join(missing[:4])}...); this step is "
                                  "not published, the previous one stays the newest")
        time.sleep(poll)


def fresh_rng(seed: int, pp_rank: int, dp_rank: int) -> dict[str, Any]:
    """The RNG entry of a rank file for a rank that starts its streams anew (a checkpoint
    written at another layout, or converted from weights): the default generator seeded by
    :func:`rank_seed`, no CUDA state, no tensor-parallel tracker state."""
    state = torch.Generator().manual_seed(rank_seed(seed, pp_rank, dp_rank)).get_state()
    return {"torch": state, "cuda": None, "tracker": {}}


def clean_stale(root: Path) -> None:
    """Remove what a killed save left behind (never loaded: names start with a dot)."""
    for stale in [*root.glob(".step-*.tmp"), *root.glob(".step-*.replaced")]:
        shutil.rmtree(stale, ignore_errors=True)


def remove_checkpoints(root: Path) -> None:
    """Delete every checkpoint under ``root``: its step folders (complete, or left by a killed
    save) and ``latest``, whichever engine wrote them; other files stay."""
    for entry in [*root.glob("step-*"), *root.glob(".step-*")]:
        shutil.rmtree(entry, ignore_errors=True)
    (root / LATEST).unlink(missing_ok=True)


def publish_step(root: Path, tmp: Path, meta: CheckpointMeta, keep_last: int,
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

    final = root / step_dir(meta.step)
    write_meta(tmp, meta)
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
