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
    --help` use click's plain layout: no line past the width, no flag name cut (was: rich's
    table squeezed the help column and cut `--quality-filters` to `--quality-filte…`)."""
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
