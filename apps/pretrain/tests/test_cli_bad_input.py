"""`mt matrix` on bad input: one line naming the flag and the value at fault, exit 2, before
any case is run."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from mt_pretrain.cli.app import app


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})
    return result.exit_code, " ".join(result.output.split())


def test_matrix_refuses_a_filter_that_selects_nothing(tmp_path: Path) -> None:
    """--only matching no case; --steps 0; a --markdown
    file that cannot be written."""
    for extra in ([], ["--list"]):
        code, text = _run("matrix", "--only", "NO-MATCH", *extra)
        assert code == 2, text
        assert "--only 'NO-MATCH' matches none of the 51 cases of --set ci; `mt matrix --set " \
            "ci --list` names them" in text, text
    code, text = _run("matrix", "--steps", "0")
    assert code == 2 and "--steps must be a positive integer, got 0" in text, text
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, text = _run("matrix", "--markdown", str(blocker / "table.md"))
    assert code == 2 and f"{blocker} is a file, not a folder" in text, text
    code, text = _run("matrix", "--only", "tp2.pp2.dp2", "--list")
    assert code == 0 and "cases" in text, text
