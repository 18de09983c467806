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
