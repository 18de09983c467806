"""`mt generate`, `mt bias` and `mt matrix` on bad input: one line naming the flag and the
value at fault, exit 2, before any model is read or any case is run (no checkpoint needed:
the options are checked first)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from mt_pretrain.cli.app import app


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})
    return result.exit_code, " ".join(result.output.split())


def test_generate_refuses_an_empty_stop_string_and_names_the_seed_flag(tmp_path: Path) -> None:
    """--stop '' and --in-flight without a pipeline (was: accepted, and each did nothing)
    and a --seed out of mt-model's range (its Sampling check, in the flag's name)."""
    missing = str(tmp_path / "no-checkpoint")
    code, text = _run("generate", missing, "--prompt", "The", "--stop", "\n", "--stop", "")
    assert code == 2 and "--stop is empty: give the text to stop before" in text, text
    code, text = _run("generate", missing, "--prompt", "The", "--in-flight", "4")
    assert code == 2 and "--in-flight 4 keeps the stages of a pipeline busy, and --pp 1 has " \
        "one stage" in text, text
    for seed in ("-1", str(2**63)):
        code, text = _run("generate", missing, "--prompt", "The", "--seed", seed)
        assert code == 2 and "Traceback" not in text, text
        assert "--seed must be" in text and f"got {seed}" in text, text
        assert " seed must" not in text.replace("--seed must", ""), text  # renamed


def test_generate_and_bias_refuse_an_output_they_cannot_write(tmp_path: Path) -> None:
    """An --output under a regular file: refused before the model is read (was: an OS error
    after every prompt was decoded; mt bias: a traceback after every probe had run)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "The"}\n')
    missing = str(tmp_path / "no-checkpoint")
    out = blocker / "out.jsonl"
    code, text = _run("generate", missing, "--input", str(prompts), "--output", str(out))
    assert code == 2, text
    assert f"--output {out}: {blocker} is a file, not a folder" in text, text
    report = blocker / "report"
    code, text = _run("bias", missing, "--output", str(report), "--no-likelihood")
    assert code == 2, text
    assert f"--output {report}: {blocker} is a file, not a folder" in text, text
    assert blocker.read_text() == "x"
    code, text = _run("bias", missing, "--output", str(tmp_path / "r"), "--no-likelihood",
                      "--samples", str(2**70))  # was: a hang listing 2**70 samples per prompt
    assert code == 2 and "--samples must be at most 10,000 per prompt" in text, text


def test_matrix_refuses_a_filter_that_selects_nothing(tmp_path: Path) -> None:
    """--only matching no case (was: "0 of 0 cases pass", exit 0); --steps 0; a --markdown
    file that cannot be written (was: a traceback after every case had run)."""
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
