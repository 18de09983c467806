"""Issue 42 ("trust") in the root CLI, on real files: `mt plot` never writes over its own
metrics, replaces an existing image only with --overwrite and says in one line, before
drawing, that it cannot write its output; `mt pretrain` refuses a config or metrics path it
cannot use before the run; `mt pretrain --overwrite` deletes only what mt pretrain wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mt_pretrain.cli.app import app
from mt_pretrain.config.load import load_config
from mt_pretrain.config.schema import ConfigError

WIDE = {"COLUMNS": "400"}
METRICS = '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'


def _error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


def test_plot_never_writes_over_its_metrics(tmp_path: Path) -> None:
    """`mt plot M -o M`: one line, exit 2."""
    for name in ("metrics", "metrics.png"):  # a suffix matplotlib writes, or none (PNG)
        metrics = tmp_path / name
        metrics.write_text(METRICS)
        result = CliRunner().invoke(app, ["plot", str(metrics), "-o", str(metrics)], env=WIDE)
        assert result.exit_code == 2, result.output
        line = _error(result.output)
        assert f"--output {metrics} is the input {metrics}" in line, line
        assert metrics.read_text() == METRICS


def test_plot_says_before_drawing_that_it_cannot_write(tmp_path: Path) -> None:
    """An output under a regular file, a
    folder, or a format matplotlib does not write: one line, exit 2, checked before the
    metrics are read (a metrics file with a bad value is not what is reported)."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(METRICS)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": "x", "loss": 1.0}\n')
    (tmp_path / "folder").mkdir()
    plain = tmp_path / "plain.txt"
    plain.write_text("a regular file")
    for output, words in ((plain / "x.png", f"{plain} is a file"),
                          (plain / "sub" / "x.png", f"{plain} is a file"),
                          (tmp_path / "folder", "is a folder"),
                          (tmp_path / "loss.jsonl", "'.jsonl' is not a format")):
        for source in (metrics, bad):
            result = CliRunner().invoke(app, ["plot", str(source), "-o", str(output)],
                                        env=WIDE)
            assert result.exit_code == 2, result.output
            line = _error(result.output)
            assert f"--output {output}" in line and words in line, line
    assert metrics.read_text() == METRICS and plain.read_text() == "a regular file"
    # The command line as a user runs it: the same one line on stderr.
    proc = subprocess.run([sys.executable, "-m", "mt_pretrain", "plot", str(metrics), "-o",
                           str(plain / "x.png")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1, proc.stderr


def test_plot_replaces_a_file_only_with_overwrite(tmp_path: Path) -> None:
    """An image already there: one line naming --output and the file, exit 2, its bytes
    kept; with --overwrite it is replaced by the plot."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(METRICS)
    png = tmp_path / "loss.png"
    png.write_bytes(b"mine")
    args = ["plot", str(metrics), "-o", str(png)]
    result = CliRunner().invoke(app, args, env=WIDE)
    assert result.exit_code == 2, result.output
    assert _error(result.output) == (f"error: --output {png} already exists; pass --overwrite "
                                     "to replace it")
    assert png.read_bytes() == b"mine"
    result = CliRunner().invoke(app, [*args, "--overwrite"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert png.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "m.jsonl"]


def test_plot_refuses_a_missing_folder_and_one_it_cannot_write_in(tmp_path: Path) -> None:
    """An output in a folder that does not exist (none is created), where no file can be
    created (/proc), or that is no regular file (/dev/null, even with --overwrite): one line,
    exit 2, before anything is drawn."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(METRICS)
    missing = tmp_path / "missing" / "dir"
    cases = [([str(missing / "x.png")], f"error: --output {missing / 'x.png'}: the folder "
              f"{missing} does not exist; create it first or name a file in an existing "
              "folder"),
             (["/dev/null", "--overwrite"], "error: --output /dev/null is not a regular file; "
              "name a file to write")]
    if Path("/proc/self").is_dir():
        cases.append((["/proc/x.png"], "error: --output /proc/x.png: cannot create a file in "
                      "/proc (No such file or directory)"))
    for args, line in cases:
        result = CliRunner().invoke(app, ["plot", str(metrics), "-o", *args], env=WIDE)
        assert result.exit_code == 2, result.output
        assert _error(result.output) == line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]


def test_pretrain_config_that_is_no_regular_file_is_said_so() -> None:
    """--config /dev/null (no regular file): said so in one line, not "not found"."""
    with pytest.raises(ConfigError) as err:
        load_config("/dev/null")
    assert str(err.value) == "config file /dev/null is not a regular file; name a YAML file"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_pretrain_metrics_where_no_file_can_be_created_is_refused_with_the_config(
        tmp_path: Path) -> None:
    """--metrics where no file can be created (/proc): refused when the config is read,
    before any rank starts (it failed in the ranks, on their first write)."""
    with pytest.raises(ConfigError) as err:
        load_config(None, {"metrics": "/proc/x.jsonl", "out_dir": str(tmp_path / "run")})
    assert str(err.value) == ("--metrics /proc/x.jsonl: cannot create a file in /proc (No such "
                              "file or directory)")
    assert list(tmp_path.iterdir()) == []


def _claim(out: Path, **options: object) -> None:
    """`mt pretrain --overwrite` up to claiming its run folder (then nothing is left to
    refuse; the run itself is not what is tested: a dry run stops there)."""
    config = load_config(None, {"model": "tiny", "seq_len": 32, "train_steps": 1,
                                "global_batch_size": 2, "micro_batch_size": 2,
                                "out_dir": str(out), "overwrite": True, **options})
    from mt_pretrain.run.folder import claim_run_folder, run_folder_lock

    with run_folder_lock(config.checkpoint.save_dir or out):
        claim_run_folder(config.checkpoint, config.metrics_path)


def test_pretrain_overwrite_deletes_only_what_mt_pretrain_wrote(tmp_path: Path) -> None:
    """--overwrite of a run folder holding the user's own things where mt pretrain's go
    (a tensorboard/ of another tool, a folder named step-..., a metrics file that is not
    mt's): refused, naming them, nothing deleted."""
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    (ckpts / "step-00000002").mkdir(parents=True)
    (ckpts / "step-00000002" / "meta.json").write_text("{}")
    (ckpts / "latest").write_text("step-00000002\n")
    board = run / "tensorboard"
    (board / "my-experiments").mkdir(parents=True)
    (board / "my-experiments" / "events.out.tfevents.1.host").write_bytes(b"mine")
    with pytest.raises(ConfigError) as err:
        _claim(run)
    line = str(err.value)
    assert "\n" not in line and f"{board} holds my-experiments/" in line, line
    assert "mt pretrain did not write" in line and "--overwrite" in line, line
    assert (board / "my-experiments" / "events.out.tfevents.1.host").is_file()
    assert (ckpts / "step-00000002" / "meta.json").is_file()  # refused before any deletion

    (board / "my-experiments" / "events.out.tfevents.1.host").unlink()
    (board / "my-experiments").rmdir()
    (board / "events.out.tfevents.1.host.1.0").write_bytes(b"mt's")  # what mt writes
    (ckpts / "step-by-step").mkdir()
    (ckpts / "step-by-step" / "notes.txt").write_text("mine")
    for overwrite in (True, False):  # saving prunes step-* folders: refused either way
        with pytest.raises(ConfigError, match=rf"{ckpts} holds step-by-step/, which mt "
                           "pretrain did not write"):
            _claim(run, overwrite=overwrite)
    assert (ckpts / "step-by-step" / "notes.txt").is_file()

    (ckpts / "step-by-step" / "notes.txt").unlink()
    (ckpts / "step-by-step").rmdir()
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(ConfigError, match=rf"--metrics {notes} holds lines mt pretrain did "
                       "not write"):
        _claim(run, metrics=str(notes))
    assert notes.read_text() == "my notes\n"
    # What mt pretrain wrote is deleted; what it did not is never touched.
    (run / "metrics.jsonl").write_text(METRICS)
    (ckpts / "keep.txt").write_text("mine")
    _claim(run)
    assert sorted(p.name for p in ckpts.iterdir()) == [".mt-run.lock", "keep.txt"]
    assert not board.exists() and not (run / "metrics.jsonl").exists()


def test_pretrain_overwrite_refusal_is_one_line_exit_2(tmp_path: Path) -> None:
    """Through the command line: one `error:` line, exit 2, the user's files intact."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "thesis.txt").write_text("mine")
    proc = subprocess.run(
        [sys.executable, "-m", "mt_pretrain", "pretrain", "--overwrite", "--train-steps", "1",
         "--seq-len", "32", "--global-batch-size", "4", "--out-dir", str(run), "--cache-dir",
         str(tmp_path / "cache"), "--no-progress"], capture_output=True, text=True, timeout=300,
        env={**os.environ, **WIDE})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "thesis.txt" in _error(proc.stderr), proc.stderr
    assert (run / "tensorboard" / "thesis.txt").read_text() == "mine"
    assert (run / "checkpoints" / "step-00000001").is_dir()
