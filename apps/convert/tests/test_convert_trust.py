"""Issue 42 ("trust") in ``mt convert``, on real checkpoints: a source that is a file is named
as such (not "not found"), and --force replaces only a folder mt convert wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from mt_convert.cli import app
from mt_formats import save_model
from mt_formats.convert import convert_checkpoint
from mt_formats.errors import ConvertError
from mt_model import GPT, preset

runner = CliRunner()
WIDE = {"COLUMNS": "400"}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_model(GPT(preset("tiny"), seed=4), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


def test_convert_names_a_source_file_as_a_file(checkpoint: Path, tmp_path: Path) -> None:
    """`mt convert FILE`: says
    it is a file, not a checkpoint folder, what a folder holds, and the folder to give when the
    file is part of a checkpoint."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not weights")
    weights = checkpoint / "model.safetensors"
    for source, extra in ((notes, []), (notes, ["--from", "hf"]), (weights, [])):
        result = runner.invoke(app, [str(source), str(tmp_path / "out"), *extra], env=WIDE)
        assert result.exit_code == 2, result.output
        line = _error(result.output)
        assert f"{source} is a file, not a checkpoint folder" in line, line
        assert "not found" not in line and "config.json" in line, line
    line = _error(runner.invoke(app, [str(weights), str(tmp_path / "out")], env=WIDE).output)
    assert f"give the folder {checkpoint}" in line, line
    assert not (tmp_path / "out").exists()
    # A path that does not exist is still "not found".
    result = runner.invoke(app, [str(tmp_path / "nowhere"), str(tmp_path / "out")], env=WIDE)
    assert result.exit_code == 2 and "not found" in _error(result.output)


def test_convert_force_replaces_only_its_own_output(checkpoint: Path, tmp_path: Path) -> None:
    """--force onto a folder holding the user's files, or onto a file: refused in one line naming
    them, exit 2, nothing touched.
    A conversion's own output is still replaced."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("four years")
    (mine / "data").mkdir()
    (mine / "config.json").write_text("{}")
    for extra in (["--force"], []):
        result = runner.invoke(app, [str(checkpoint), str(mine), "--to", "hf", *extra],
                               env=WIDE)
        assert result.exit_code == 2, result.output
        line = _error(result.output)
        assert "data/, thesis.txt" in line and "mt convert did not write" in line, line
        assert "--force" in line, line
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "data", "thesis.txt"]
    assert (mine / "thesis.txt").read_text() == "four years"
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    result = runner.invoke(app, [str(checkpoint), str(notes), "--force"], env=WIDE)
    assert result.exit_code == 2, result.output
    assert f"{notes} is a file" in _error(result.output)
    assert notes.read_text() == "mine"
    # Folders named as mt convert's are its own only holding what it writes there.
    looks = tmp_path / "looks"
    for folder, name in (("release", "notes.txt"), ("iter_2024_photos", "a.jpg"),
                         ("tp_rank_00", "draft.md")):
        (looks / folder).mkdir(parents=True)
        (looks / folder / name).write_text("mine")
    (looks / "config.json").write_text("{}")
    result = runner.invoke(app, [str(checkpoint), str(looks), "--force"], env=WIDE)
    assert result.exit_code == 2, result.output
    line = _error(result.output)
    assert "iter_2024_photos/, release/notes.txt, tp_rank_00/draft.md" in line, line
    assert (looks / "release" / "notes.txt").read_text() == "mine"
    # The library refuses the same (--to pretrain from an mt pretrain source goes another way).
    with pytest.raises(ConvertError, match="thesis.txt, which mt convert did not write"):
        convert_checkpoint(checkpoint, mine, to="tp", tp=2, overwrite=True)
    # Its own outputs, of every format it writes, are replaced with --force.
    for to, extra in (("hf", []), ("tp", ["--tp", "2", "--pp", "2"]), ("megatron", []),
                      ("pretrain", []), ("dcp", []), ("mcore", []), ("gguf", []),
                      ("consolidated", [])):
        out = tmp_path / "out"
        result = runner.invoke(app, [str(checkpoint), str(out), "--to", to, *extra, "--force"],
                               env=WIDE)
        assert result.exit_code == 0, (to, result.output)
        result = runner.invoke(app, [str(checkpoint), str(out), "--to", to, *extra, "--force"],
                               env=WIDE)  # onto a folder of its own format
        assert result.exit_code == 0, (to, result.output)
    # A DCP folder torch itself saved (torchtitan's checkpoints; no mt.json) is not one of its.
    theirs = tmp_path / "titan"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(theirs), no_dist=True)
    before = sorted(p.name for p in theirs.iterdir())
    result = runner.invoke(app, [str(checkpoint), str(theirs), "--to", "dcp", "--force"],
                           env=WIDE)
    assert result.exit_code == 2, result.output
    assert ".metadata" in _error(result.output) and "did not write" in _error(result.output)
    assert sorted(p.name for p in theirs.iterdir()) == before
    pretrain = tmp_path / "pretrain"
    assert runner.invoke(app, [str(checkpoint), str(pretrain), "--to", "pretrain"]).exit_code == 0
    result = runner.invoke(app, [str(pretrain), str(tmp_path / "re"), "--to", "pretrain",
                                 "--dp", "2"], env=WIDE)
    assert result.exit_code == 0, result.output
    (tmp_path / "re" / "thesis.txt").write_text("mine")
    result = runner.invoke(app, [str(pretrain), str(tmp_path / "re"), "--to", "pretrain",
                                 "--dp", "2", "--force"], env=WIDE)
    assert result.exit_code == 2 and "thesis.txt" in _error(result.output), result.output
    assert (tmp_path / "re" / "thesis.txt").read_text() == "mine"


@pytest.mark.parametrize("refusal", [MemoryError(), RuntimeError("can't start new thread")])
def test_a_refused_allocation_or_thread_is_one_line(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        refusal: Exception) -> None:
    """Under a memory or address-space limit (``ulimit -v``) a conversion's allocation or
    thread can be refused: one line naming the source and the limits, exit 1, nothing
    written. Other errors are not swallowed."""
    import mt_formats.convert

    def refused(*args: object, **kwargs: object) -> None:
        raise refusal

    monkeypatch.setattr(mt_formats.convert, "convert_checkpoint", refused)
    result = runner.invoke(app, [str(checkpoint), str(tmp_path / "out")], env=WIDE)
    assert result.exit_code == 1, result.output
    line = _error(result.output)
    assert str(checkpoint) in line and "nothing was written" in line, line
    assert type(refusal).__name__ in line, line
    assert not (tmp_path / "out").exists()

    def other(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(mt_formats.convert, "convert_checkpoint", other)
    result = runner.invoke(app, [str(checkpoint), str(tmp_path / "out")], env=WIDE)
    assert isinstance(result.exception, RuntimeError) and str(result.exception) == "a bug"
