"""A run folder is never silently overwritten.

A new run (no ``--load`` of its own checkpoints) whose checkpoint folder already holds
checkpoints, or whose metrics file already holds lines, is refused with a message offering
``--load`` (continue that run) or ``--overwrite`` (delete them and start over), as the HF
Trainer refuses a non-empty output folder without ``--overwrite_output_dir``. ``--overwrite``
deletes only what mt pretrain wrote (:data:`OWN_STEPS` in the checkpoint folder, a metrics
file of metrics lines, a ``tensorboard/`` of event files): a run folder holding anything
else where those go is refused, naming it (``mt_data.paths``' rule of mt's own output), and
nothing is deleted. Resuming
(``--load`` of a checkpoint inside the run's own checkpoint folder) keeps everything: the
metrics file keeps its lines up to the resume step.

One run at a time: rank 0 holds an exclusive lock (``flock``) on ``.mt-run.lock`` in the run's
checkpoint folder (``--out-dir`` when it saves none) for the whole run, so the same job started
twice (a requeue while the old job still runs) is refused in one line naming the holder. The
kernel releases the lock when its holder exits or is killed, so a killed job never leaves a
lock that blocks the next one.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mt_checkpoint import has_checkpoints, remove_checkpoints
from mt_data.paths import foreign_entries, foreign_message
from mt_pretrain.config.schema import CheckpointArgs, ConfigError

__all__ = ["LOCK_FILE", "claim_run_folder", "run_folder_lock"]

#: The lock file rank 0 holds in the run folder while it trains.
LOCK_FILE = ".mt-run.lock"

_STEP = "step-" + "[0-9]" * 8  # mt_checkpoint.step_dir
#: What --overwrite deletes in the checkpoint folder (``remove_checkpoints``: every
#: ``step-*`` and ``.step-*`` folder) must be named as mt pretrain names its step folders.
OWN_STEPS = (f"{_STEP}/", f".{_STEP}.tmp/", f".{_STEP}.replaced/")
#: What mt pretrain writes in OUT_DIR/tensorboard (TensorBoard's SummaryWriter).
OWN_EVENTS = ("events.out.tfevents.*",)


@contextmanager
def run_folder_lock(folder: str | Path) -> Iterator[None]:
    """Hold the lock of ``folder`` (a run's checkpoint folder) for the ``with`` body;
    :class:`ConfigError` at once if another process holds it (its host, pid and start time in
    the message) or the folder cannot be written."""
    path = Path(folder) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as err:
        raise ConfigError(f"{folder}: cannot write there ({err.strerror}); choose another "
                          "--out-dir or --save") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown"
            raise ConfigError(f"{folder} is in use by another run ({holder}): wait for it "
                              "to end, or choose another --out-dir or --save") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race a new holder)


def _resumes_own(ckpt: CheckpointArgs) -> bool:
    """``--load`` names the run's own checkpoint folder or a step folder inside it."""
    if ckpt.load is None or ckpt.save_dir is None:
        return False
    load, save = Path(ckpt.load).resolve(), ckpt.save_dir.resolve()
    return load == save or save in load.parents


def _previous(ckpt: CheckpointArgs, metrics: Path | None) -> list[str]:
    found = []
    if ckpt.save_dir is not None and has_checkpoints(ckpt.save_dir):
        found.append(f"checkpoints in {ckpt.save_dir}")
    if metrics is not None and metrics.is_file() and metrics.stat().st_size > 0:
        found.append(f"metrics in {metrics}")
    return found


def claim_run_folder(ckpt: CheckpointArgs, metrics: Path | None) -> None:
    """Refuse to write over a previous run's outputs, or with ``--overwrite`` delete them
    (only what mt pretrain wrote). A checkpoint folder holding a ``step-*`` folder mt pretrain
    did not name is refused in any case: saving prunes old ``step-*`` folders. ``metrics``:
    the run's metrics file (``PretrainConfig.metrics_path``)."""
    _refuse_foreign_steps(ckpt)
    _refuse_foreign_metrics(metrics)  # a resumed run rewrites the file too
    if _resumes_own(ckpt):
        return
    found = _previous(ckpt, metrics)
    if not found:
        return
    if not ckpt.overwrite:
        resume = f"--load {ckpt.save_dir}" if ckpt.save_dir is not None and \
            has_checkpoints(ckpt.save_dir) else "--load CHECKPOINT"
        raise ConfigError(f"{ckpt.out_dir} holds a previous run ({'; '.join(found)}): "
                          f"continue it with {resume}, start over with --overwrite (deletes "
                          "them), or choose another --out-dir")
    _refuse_foreign(ckpt)  # before anything is deleted
    if ckpt.save_dir is not None and ckpt.save_dir.is_dir():
        remove_checkpoints(ckpt.save_dir)
    if metrics is not None:
        metrics.unlink(missing_ok=True)
    shutil.rmtree(Path(ckpt.out_dir) / "tensorboard", ignore_errors=True)


def _metrics_file(path: Path) -> bool:
    """Whether ``path`` is a metrics file mt pretrain wrote: its first line one of its JSON
    objects with a ``step`` (or that line, torn by a kill, begins like one)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 20)
    except OSError:
        return False
    try:
        record = json.loads(first)
    except (ValueError, RecursionError):
        return first.startswith(b'{"step": ') and not first.endswith(b"\n")
    return isinstance(record, dict) and "step" in record


_CHOOSE = "--out-dir, --save or --metrics"


def _refuse_foreign_steps(ckpt: CheckpointArgs) -> None:
    """A ConfigError naming the ``step-*`` / ``.step-*`` folders of the checkpoint folder
    that mt pretrain did not name (``--overwrite`` and pruning delete such folders)."""
    if ckpt.save_dir is None:
        return
    steps = foreign_entries(ckpt.save_dir, OWN_STEPS, among=("step-*/", ".step-*/"))
    if steps:
        raise ConfigError(foreign_message("", ckpt.save_dir, steps, "mt pretrain",
                                          choose=_CHOOSE))


def _refuse_foreign_metrics(metrics: Path | None) -> None:
    """A ConfigError when the metrics file holds lines mt pretrain did not write: a new run
    (--overwrite) deletes the file, a resumed one keeps only its lines up to the step."""
    if metrics is not None and metrics.is_file() and metrics.stat().st_size > 0 and \
            not _metrics_file(metrics):
        raise ConfigError(f"--metrics {metrics} holds lines mt pretrain did not write (its "
                          "first line is no metrics record): --overwrite deletes, and a "
                          "resumed run rewrites, only a metrics file mt pretrain wrote; move "
                          "it away or choose another --metrics")


def _refuse_foreign(ckpt: CheckpointArgs) -> None:
    """A ConfigError naming what --overwrite would delete that mt pretrain did not write."""
    board = Path(ckpt.out_dir) / "tensorboard"
    events = [] if board.is_symlink() else foreign_entries(board, OWN_EVENTS)  # (a link:
    # rmtree deletes nothing through it)
    if events:
        raise ConfigError(foreign_message("", board, events, "mt pretrain", choose=_CHOOSE))
