"""Atomic output directories: a conversion either produces the whole destination or nothing.

Everything is written into a hidden temporary directory next to the destination (same
filesystem, so the final ``rename`` is atomic) and renamed into place only when the body
of the ``with`` block finishes without an exception. On any failure, including Ctrl-C,
the temporary directory is removed and an existing destination is left untouched.

An existing destination is replaced (``--force``) only when it is a folder mt convert wrote:
one holding nothing but the names its writers use (:data:`CONVERT_OUTPUT`; a dcp, mcore or
gguf folder only with mt's ``mt.json`` beside its files, :data:`MARKED_OUTPUT`); a file, or a
folder holding anything else (a user's own files), is refused with or without ``--force``,
naming what is there (``mt_data.paths``' rule of mt's own output).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mt_checkpoint import fsync_dir
from mt_data.paths import blocking_file, foreign_entries, foreign_message, foreign_output
from mt_formats.errors import ConvertError

__all__ = ["CONVERT_OUTPUT", "MARKED_OUTPUT", "atomic_directory", "check_destination"]

CONVERT_OUTPUT = (
    "config.json", "model.safetensors",  # consolidated, Hugging Face (and tp's config)
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",  # hf --tokenizer
    "tp_rank_[0-9][0-9]/model.safetensors",  # tp, one stage
    "pp_rank_[0-9][0-9]_tp_rank_[0-9][0-9]/model.safetensors",  # tp, stages
    "latest_checkpointed_iteration.txt",  # megatron
    *(f"{iteration}/mp_rank_[0-9][0-9]{stage}/model_optim_rng.pt"
      for iteration in ("iter_[0-9][0-9][0-9][0-9][0-9][0-9][0-9]*", "release")
      for stage in ("", "_[0-9][0-9][0-9]")),
    "meta.json", "rank-[0-9][0-9][0-9][0-9][0-9].pt",  # pretrain (a step folder)
    ".metadata", "__[0-9]*_[0-9]*.distcp", "mt.json",  # dcp (and mcore's, gguf's mt.json)
    "metadata.json", "common.pt",  # mcore
    "model.gguf",  # gguf
)
"""The names mt convert's writers put in a destination folder, and in its folders (a user's
folder named like one of them holds other files: ``mt_data.paths.foreign_entries``)."""

MARKED_OUTPUT = (".metadata", "__[0-9]*_[0-9]*.distcp", "metadata.json", "common.pt",
                 "model.gguf")
"""The names of the formats mt convert writes with its ``mt.json`` beside them (dcp, mcore,
gguf): without it, such files are another program's (torchtitan, Megatron-core, llama.cpp's
converter)."""


def _dangling_link(destination: Path) -> Path | None:
    """The link at or on the way to ``destination`` whose target does not exist, or None
    (no folder can be created there, nor renamed onto it)."""
    for path in (destination, *destination.parents):
        if path.is_symlink() and not path.exists():
            return path
    return None


def check_destination(destination: Path, overwrite: bool) -> None:
    """Raise :class:`ConvertError` (one line) unless ``destination`` is absent, or an empty
    folder or one mt convert wrote and ``overwrite`` (``--force``) is given."""
    if (link := _dangling_link(Path(destination))) is not None:
        where = "" if link == Path(destination) else f"{destination}: "
        raise ConvertError(f"{where}{link} is a link to {os.readlink(link)}, which does not "
                           "exist; choose a destination that does not go through it")
    if (blocker := blocking_file(destination)) is not None:
        raise ConvertError(f"{destination}: {blocker} is a file, not a folder; choose a "
                           "destination in a folder")
    refusal = foreign_output("", destination, CONVERT_OUTPUT, "mt convert", option="--force")
    if refusal is None and not (Path(destination) / "mt.json").is_file() and (
            theirs := foreign_entries(destination, (), among=MARKED_OUTPUT)):
        refusal = foreign_message("", destination, theirs, "mt convert", option="--force")
    if refusal is not None:
        raise ConvertError(refusal)
    if destination.exists() and not overwrite:
        raise ConvertError(f"{destination}: destination already exists (use --force to "
                           "replace it)")


def _chmod_by_umask(path: Path) -> None:
    """Give a folder the mode ``mkdir`` would have given it under this process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)


@contextmanager
def atomic_directory(destination: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes ``destination`` on success.

    Raises :class:`ConvertError` up front if ``destination`` exists and ``overwrite`` is
    false, or if it is not a folder mt convert wrote (:func:`check_destination`). With
    ``overwrite``, the old destination is moved aside and deleted only after the new one is
    in place.
    """
    destination = Path(destination)
    check_destination(destination, overwrite)
    parent = destination.parent if str(destination.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.partial-", dir=parent))
    _chmod_by_umask(staging)  # mkdtemp's 0700 would hide the result from a shared group
    try:
        yield staging
        fsync_dir(staging)
        if destination.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-", dir=parent))
            try:
                os.replace(destination, old / "previous")
                os.replace(staging, destination)
            except BaseException:  # an interrupt between the two: the previous one goes back
                if (old / "previous").exists() and not destination.exists():
                    os.replace(old / "previous", destination)
                shutil.rmtree(old, ignore_errors=True)  # empty, or the replaced one
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, destination)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
