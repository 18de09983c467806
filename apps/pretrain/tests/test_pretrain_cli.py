"""The root CLI: --version lists every mt distribution."""

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
