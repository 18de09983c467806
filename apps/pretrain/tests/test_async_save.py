"""--async-save: checkpoints written by a writer process while training goes on (the state
copied by a thread during the next forward and backward) are the same bytes as those written
in the foreground, and a kill during a background write leaves the previous
checkpoint the newest complete one (one line says so at resume), from which the run ends as
the one never interrupted."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_pretrain

from mt_checkpoint import read_meta, snapshot
from mt_dist.exits import LaunchFailed

COMMON: dict[str, Any] = {
    "model": "tiny", "seq_len": 32, "dropout": 0.1, "micro_batch_size": 2,
    "global_batch_size": 8, "eval_interval": 0, "sample_tokens": 0, "progress": False,
    "log_interval": 100, "timeout": 60.0, "nproc": 2, "tp": 1, "pp": 1, "dp": 2,
    "zero_stage": 1, "warmup_tokens": 2 * 8 * 32, "decay_tokens": 8 * 8 * 32,
    "save_interval": 2, "keep_last": 10,
}
_run = partial(run_pretrain, COMMON)


@pytest.fixture(scope="module")
def foreground(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("foreground")
    return out, _run(out, cache, train_steps=8)


def _rank_files(run: Path) -> dict[str, bytes]:
    root = run / "checkpoints"
    return {f"{step.name}/{f.name}": f.read_bytes()
            for step in sorted(root.glob("step-*")) for f in sorted(step.glob("rank-*.pt"))}


def test_background_saves_write_the_same_bytes(foreground: tuple[Path, Any], cache: Path,
                                               tmp_path: Path) -> None:
    """Steps 2, 4 and 6 written in the background (8, the last, in the foreground): every
    rank file byte for byte the foreground run's, every recorded checksum the same, the
    same losses."""
    out, whole = foreground
    summary = _run(tmp_path, cache, train_steps=8, async_save=True)
    assert summary.losses == whole.losses
    mine, theirs = _rank_files(tmp_path), _rank_files(out)
    assert sorted(mine) == sorted(theirs) and len(mine) == 4 * 2
    assert all(mine[name] == theirs[name] for name in mine), [
        name for name in mine if mine[name] != theirs[name]]
    for step in ("step-00000002", "step-00000008"):
        assert read_meta(tmp_path / "checkpoints" / step).files == read_meta(
            out / "checkpoints" / step).files


def test_the_update_waits_for_the_background_copies(cache: Path, tmp_path: Path,
                                                    monkeypatch: Any) -> None:
    """The state is copied into host memory while the next step's forward and backward run;
    with those copies made 3 s late (``checkpoint.snapshot``, longer than the writer takes
    to start), every rank file is still the foreground run's, byte for byte: the writer
    gets the snapshot once its copies are made, before the optimizer step (the control, a
    snapshot handed over unwaited, fails here). At ZeRO 3 in bf16 (fp32 masters, bf16
    weights) and with two pipeline stages (whose schedule runs the step)."""
    layout = {"nproc": 2, "dp": 1, "tp": 1, "pp": 2, "train_steps": 4, "zero_stage": 0}
    for name, options in {"zero3-bf16": {"dp": 2, "pp": 1, "zero_stage": 3,
                                         "precision": "bf16", "train_steps": 4},
                          "pp2": layout}.items():
        options = {**layout, **options}
        fore = _run(tmp_path / f"{name}-fore", cache, **options)
        monkeypatch.setenv("MT_FAILPOINT", "checkpoint.snapshot")
        back = _run(tmp_path / f"{name}-back", cache, async_save=True, **options)
        monkeypatch.delenv("MT_FAILPOINT")
        assert back.losses == fore.losses, name
        mine, theirs = _rank_files(tmp_path / f"{name}-back"), _rank_files(
            tmp_path / f"{name}-fore")
        assert sorted(mine) == sorted(theirs) and len(mine) == 2 * 2, name
        assert [n for n in mine if mine[n] != theirs[n]] == [], name


def test_a_kill_during_a_background_write_resumes_from_the_previous_save(
        foreground: tuple[Path, Any], cache: Path, tmp_path: Path, monkeypatch: Any,
        capfd: Any) -> None:
    """Steps 1-2 saved; the run goes on with --async-save and rank 1 is killed while its
    writer starts on step 4 (training had gone on): step 4 is never published. The same
    command with --load resumes from step 2, says so in one line, and ends as the run never
    interrupted."""
    out, whole = foreground
    _run(tmp_path, cache, train_steps=2)
    monkeypatch.setenv("MT_FAILPOINT", "checkpoint.background@1")
    with pytest.raises(LaunchFailed, match="died with exit code -9"):
        _run(tmp_path, cache, train_steps=8, async_save=True,
             load=str(tmp_path / "checkpoints"))
    monkeypatch.delenv("MT_FAILPOINT")
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000002"
    assert (root / ".step-00000004.tmp").is_dir()
    capfd.readouterr()
    resumed = _run(tmp_path, cache, train_steps=8, async_save=True, load=str(root))
    line = (f"{root}: the save of step 4 did not finish (the run stopped during its write); "
            "resuming from step 2, the newest complete checkpoint")
    said = capfd.readouterr()
    assert (said.out + said.err).count(line) == 1, said
    assert resumed.start_step == 2 and resumed.losses == whole.losses[2:]
    assert not list(root.glob(".step-*"))  # the unfinished write is cleaned at the next save
    for rank in ("rank-00000.pt", "rank-00001.pt"):  # the same state (stored otherwise:
        # a resumed run's tensors are views of other buffers than a whole run's)
        _same(*(torch.load(run / "checkpoints" / "step-00000008" / rank, weights_only=True)
                for run in (tmp_path, out)))


def _same(mine: Any, theirs: Any) -> None:
    if isinstance(mine, dict):
        assert mine.keys() == theirs.keys()
        for key in mine:
            _same(mine[key], theirs[key])
    elif isinstance(mine, (list, tuple)):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            _same(a, b)
    elif isinstance(mine, torch.Tensor):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    else:
        assert mine == theirs


def test_snapshot_keeps_views_of_one_storage() -> None:
    """Two views of one storage (tied weights, a flat ZeRO buffer) stay two views of one
    copy, at their offsets, and the copy no longer follows the live tensor."""
    flat = torch.arange(12.0)
    state = {"a": flat[:6].view(2, 3), "b": flat[6:], "n": 3, "l": [flat[2:4]]}
    copied = snapshot(state)
    assert copied["a"].untyped_storage().data_ptr() == copied["b"].untyped_storage().data_ptr()
    assert copied["l"][0].storage_offset() == 2 and copied["n"] == 3
    flat.zero_()
    assert copied["b"].tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    assert copied["a"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
