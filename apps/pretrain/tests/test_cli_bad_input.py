"""`mt matrix` on bad input: one line naming the flag and the value at fault, exit 2, before
any case is run."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mt_pretrain.cli.app import app
from mt_pretrain.contract.matrix import ci_matrix


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})
    return result.exit_code, " ".join(result.output.split())


def test_matrix_refuses_a_filter_that_selects_nothing(tmp_path: Path) -> None:
    """--only matching no case; --steps 0; a --markdown
    file that cannot be written."""
    for extra in ([], ["--list"]):
        code, text = _run("matrix", "--only", "NO-MATCH", *extra)
        assert code == 2, text
        assert f"--only 'NO-MATCH' matches none of the {len(ci_matrix())} cases of --set ci; " \
            "`mt matrix --set ci --list` names them" in text, text
    code, text = _run("matrix", "--steps", "0")
    assert code == 2 and "--steps must be a positive integer, got 0" in text, text
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, text = _run("matrix", "--markdown", str(blocker / "table.md"))
    assert code == 2 and f"{blocker} is a file, not a folder" in text, text
    code, text = _run("matrix", "--only", "tp2.pp2.dp2", "--list")
    assert code == 0 and "cases" in text, text


def test_matrix_replaces_a_markdown_file_only_with_overwrite(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """A --markdown file already there: one line naming it, exit 2, before any case runs, its
    bytes kept; --overwrite without --markdown, or of no regular file, is refused too. With
    --overwrite it is replaced, and a --markdown in folders not there yet is written (the
    cases' runs stubbed: what is tested is the file, not the training)."""
    import mt_pretrain.contract.runner as runner
    from mt_pretrain.cli.matrix import markdown_table

    monkeypatch.setattr(runner, "run_matrix", lambda *args: [])
    monkeypatch.setattr(runner, "cpu_isa", lambda: "stub")
    mine = tmp_path / "mine.md"
    mine.write_text("precious")
    for args, line in ((["--markdown", str(mine)], f"error: --markdown {mine} already exists; "
                        "pass --overwrite to replace it"),
                       (["--overwrite"], "error: --overwrite replaces the --markdown file: "
                        "give --markdown too, or leave --overwrite out"),
                       (["--markdown", "/dev/null", "--overwrite"], "error: --markdown "
                        "/dev/null is not a regular file; name a file to write")):
        code, text = _run("matrix", "--only", "tp2.pp2.dp2", *args)
        assert code == 2 and text == line, text
    assert mine.read_text() == "precious"
    new = tmp_path / "new" / "sub" / "table.md"
    for path in (mine, new):
        code, text = _run("matrix", "--only", "tp2.pp2.dp2", "--markdown", str(path),
                          "--overwrite")
        assert code == 0, text
        assert path.read_text() == markdown_table([])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.md", "new"]


def test_matrix_refuses_a_work_dir_it_cannot_use(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """--work-dir naming a file, a device or a path under a file: one line, exit 2, before any
    case runs (each case failed instead, and the table said "0 of N cases pass", exit 1, as if
    the layouts trained differently)."""
    import mt_pretrain.contract.runner as runner

    monkeypatch.setattr(runner, "run_matrix", lambda *args: [])  # reached: not refused
    monkeypatch.setattr(runner, "cpu_isa", lambda: "stub")
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    for work, line in ((mine, f"error: --work-dir {mine} is not a folder; name a folder for "
                        "the runs"),
                       (Path("/dev/null"), "error: --work-dir /dev/null is not a folder; name "
                        "a folder for the runs"),
                       (mine / "runs", f"error: --work-dir {mine / 'runs'}: {mine} is a file, "
                        "not a folder; name a path in a folder")):
        code, text = _run("matrix", "--only", "tp2.pp2.dp2", "--work-dir", str(work))
        assert code == 2 and text == line, text
    assert mine.read_text() == "mine"
    code, text = _run("matrix", "--only", "tp2.pp2.dp2", "--work-dir", str(tmp_path / "w"))
    assert code == 0, text
