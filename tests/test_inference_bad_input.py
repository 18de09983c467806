"""`mt generate`, `mt bias`, `mt eval` and `mt serve` on bad input: one line naming the flag
and the value at fault, exit 2, before any model is read (no checkpoint needed: the options
are checked first); their help names the extras to install."""

from __future__ import annotations

from pathlib import Path

from mt_cli import app
from typer.testing import CliRunner


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})
    return result.exit_code, " ".join(result.output.split())


def test_generate_refuses_an_empty_stop_string_and_names_the_seed_flag(tmp_path: Path) -> None:
    """--stop '' and --in-flight without a pipeline
    and a --seed out of mt-model's range (its Sampling check, in the flag's name)."""
    missing = str(tmp_path / "no-checkpoint")
    code, text = _run("generate", missing, "--prompt", "The", "--stop", "\n", "--stop", "")
    assert code == 2 and "--stop is empty: give the text to stop before" in text, text
    # A command line's bytes that are not UTF-8 reach Python as lone surrogates
    # (surrogateescape), which no tokenizer takes.
    latin1 = b"caf\xe9".decode("utf-8", "surrogateescape")
    code, text = _run("generate", missing, "--prompt", latin1, "--stop", "\ud800")
    assert code == 2 and "--prompt holds the byte 0xe9, not UTF-8, at character 3: give " \
        "UTF-8 text; --stop holds a lone surrogate \\ud800 at character 0" in text, text
    code, text = _run("generate", missing, "--prompt", "The", "--in-flight", "4")
    assert code == 2 and "--in-flight 4 keeps the stages of a pipeline busy, and --pp 1 has " \
        "one stage" in text, text
    for seed in ("-1", str(2**63)):
        code, text = _run("generate", missing, "--prompt", "The", "--seed", seed)
        assert code == 2 and "Traceback" not in text, text
        assert "--seed must be" in text and f"got {seed}" in text, text
        assert " seed must" not in text.replace("--seed must", ""), text  # renamed


def test_generate_and_bias_refuse_an_output_they_cannot_write(tmp_path: Path) -> None:
    """An --output under a regular file: refused before the model is read."""
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
                      "--samples", str(2**70))
    assert code == 2 and "--samples must be at most 10,000 per prompt" in text, text


def test_help_keeps_the_extras_to_install() -> None:
    """Square brackets are Rich markup: the help must still say 'mt-inference[harness]'."""
    for command, extra in (("eval", "harness"), ("bias", "harness"), ("serve", "serve")):
        result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0 and f"'mt-inference[{extra}]'" in result.output, command


def test_serve_refuses_a_host_that_is_no_address(tmp_path: Path) -> None:
    """A port given with --host, a URL: named as such (not as a host other machines reach,
    which asked for an --api-key the address could never use)."""
    missing = str(tmp_path / "no-checkpoint")
    for host, said in (
            ("127.0.0.1:8000", "--host 127.0.0.1:8000 holds a port: give --host 127.0.0.1 "
             "--port 8000"),
            ("[::1]:80", "--host [::1]:80 holds a port: give --host [::1] --port 80"),
            ("http://0.0.0.0", "--host http://0.0.0.0 is not an address or host name to "
             "listen on")):
        code, text = _run("serve", missing, "--host", host)
        assert code == 2 and said in text and "api-key" not in text, text
    for host in ("::1", "[::1]", "localhost"):  # addresses: only the checkpoint is missing
        code, text = _run("serve", missing, "--host", host)
        assert code == 2 and "--host" not in text, text
    # a host name (a compose service's, with an underscore), reachable from others: a key
    code, text = _run("serve", missing, "--host", "model_server", "--api-key", "k3y")
    assert code == 2 and "--host" not in text, text
