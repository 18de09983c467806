"""The root CLI: --version lists every mt distribution; --quiet."""

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from mt_pretrain.cli.app import DISTRIBUTIONS, app, package_versions


def test_version_lists_every_package() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    for dist in DISTRIBUTIONS:
        assert dist in result.output
    assert "0.1.0" in package_versions()["mt-pretrain"]


def test_help_explains() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "tensor, pipeline and data parallelism" in result.output


def test_help_keeps_the_extras_to_install() -> None:
    """Square brackets are Rich markup: the help must still say 'mt-pretrain[wandb]'."""
    for command, extra in (("pretrain", "wandb"),):
        result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0 and f"'mt-pretrain[{extra}]'" in result.output, command


def test_quiet_prints_only_the_summary(tmp_path: Path) -> None:
    """--quiet: no banner, progress, log or checkpoint lines; the summary and the metrics
    file stay."""
    result = subprocess.run(
        [sys.executable, "-m", "mt_pretrain", "pretrain", "--quiet", "--train-steps", "2",
         "--seq-len", "32", "--global-batch-size", "4", "--log-interval", "1",
         "--eval-interval", "2", "--sample-tokens", "0", "--out-dir", str(tmp_path / "run"),
         "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines and lines[0].startswith("trained steps 1-2: loss "), lines
    assert not any(word in result.stdout for word in ("not the 3D demo", "ranks from", "step ",
                                                      "saved checkpoint"))
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_help_on_80_columns_keeps_every_flag_whole() -> None:
    """On a terminal narrower than 100 columns `mt pretrain --help` and `mt data prepare
    --help` use click's plain layout: no line past the width, no flag name cut."""
    for command, flags in ((["pretrain"], ["--sequence-parallel / --no-sequence-parallel",
                                           "--activation-checkpointing", "--micro-batch-size"]),
                           (["data", "prepare"], ["--quality-filters / --no-quality-filters",
                                                  "--max-repeated-lines <float>"])):
        result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        assert max(len(line) for line in result.output.splitlines()) <= 80, result.output
        assert "…" not in result.output
        for flag in flags:
            assert flag in result.output, (command, flag)
    wide = CliRunner().invoke(app, ["pretrain", "--help"], env={"COLUMNS": "200"})
    assert "╭─ Parallelism" in wide.output  # rich panels where there is room


def test_plot_names_the_line_of_a_bad_value(tmp_path: Path) -> None:
    """A metrics line whose step or loss is not a number, a loss that --log-y cannot draw, a
    file that is not text: one line naming the file (and line), exit 2."""
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"step": 1, "loss": 2.0}\n{"step": "x", "loss": 1.5}\n')
    negative = tmp_path / "neg.jsonl"
    negative.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": -1.0}\n')
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(bytes(range(160, 256)))
    for args, words in (([str(odd)], f"{odd}:2: step is 'x', not a number"),
                        ([str(negative), "--log-y"], f"{negative}:2: loss -1.0 cannot be drawn "
                                                     "on --log-y"),
                        ([str(garbage)], f"{garbage}: not a metrics file (not UTF-8 text")):
        result = CliRunner().invoke(app, ["plot", *args, "-o", str(tmp_path / "p.png")])
        assert result.exit_code == 2, result.output
        assert words in " ".join(result.output.split()), result.output
    assert not (tmp_path / "p.png").exists()


def test_warnings_are_one_line_once_and_a_finished_run_says_so(tmp_path: Path) -> None:
    """A `latest` naming a folder that is not there: the fallback warning once, as one
    `warning:` line; resuming a run already
    at its last step says there is nothing to train."""
    run = [sys.executable, "-m", "mt_pretrain", "pretrain", "--train-steps", "2", "--seq-len",
           "32", "--global-batch-size", "4", "--eval-interval", "0", "--sample-tokens", "0",
           "--no-progress", "--out-dir", str(tmp_path / "run"), "--cache-dir",
           str(tmp_path / "cache")]
    first = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "latest").write_text("step-00000009\n")
    again = subprocess.run([*run, "--load", str(checkpoints)], capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    warned = [line for line in again.stderr.splitlines() if "loading step-00000002" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: "), again.stderr
    assert "UserWarning" not in again.stderr
    assert "nothing to train: " in again.stdout and "is at step 2, the run ends at step 2" in \
        again.stdout, again.stdout
