"""Cross-app: `mt generate` on a model `mt pretrain` trained (GPT-2 vocabulary), read as its
mt checkpoint and as its `mt convert --to hf` export: greedy completions equal transformers'
`generate` on the export; a seeded sample is the same from either folder and alone or
batched; stop strings, streaming, and bad input (one line naming the file and line, exit 2)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from e2e_models import trained_gpt2_vocab
from mt_cli import app
from typer.testing import CliRunner

PROMPTS = ["Call me Ishmael. Some years ago", "The whale", "It was the best of times, it was"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generate")
    ckpt, hf = trained_gpt2_vocab(root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return {"ckpt": ckpt, "hf": hf, "prompts": prompts, "root": root}


def _generate(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["generate", *args])
    return result.exit_code, result.output


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_greedy_equals_transformers(model: dict[str, Path], tmp_path: Path) -> None:
    import transformers

    out = tmp_path / "greedy.jsonl"
    code, text = _generate(str(model["ckpt"]), "--input", str(model["prompts"]), "--output",
                           str(out), "--max-new-tokens", "12", "--logprobs")
    assert code == 0, text
    assert f"{out.name}.sha256: sha256sum -c checks it" in " ".join(text.split())
    check = subprocess.run(["sha256sum", "-c", "--strict", f"{out.name}.sha256"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert check.returncode == 0 and f"{out.name}: OK" in check.stdout
    rows = _rows(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model["hf"]).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model["hf"])
    for prompt, row in zip(PROMPTS, rows, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            theirs = hf.generate(ids, max_new_tokens=12, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
        expected = theirs.tolist()
        if tokenizer.eos_token_id in expected:  # mt stops at end-of-text, excluded
            expected = expected[:expected.index(tokenizer.eos_token_id)]
        assert row["token_ids"] == expected, prompt
        assert row["completion"] == tokenizer.decode(expected)
        assert len(row["logprobs"]) == len(expected) and all(lp <= 0 for lp in row["logprobs"])
        assert row["finish_reason"] == ("length" if len(expected) == 12 else "stop")


def test_a_seeded_sample_is_the_same_from_every_source(model: dict[str, Path],
                                                        tmp_path: Path) -> None:
    sample = ["--max-new-tokens", "10", "--temperature", "0.9", "--top-k", "50", "--seed", "7"]
    outs = {}
    for source, batch in (("ckpt", "8"), ("hf", "8"), ("ckpt", "1")):
        out = tmp_path / f"{source}-{batch}.jsonl"
        code, text = _generate(str(model[source]), "--input", str(model["prompts"]),
                               "--output", str(out), "--batch-size", batch, *sample)
        assert code == 0, text
        outs[(source, batch)] = [r["token_ids"] for r in _rows(out)]
    assert outs[("ckpt", "8")] == outs[("hf", "8")] == outs[("ckpt", "1")]
    code, text = _generate(str(model["ckpt"]), "--input", str(model["prompts"]),
                           *sample[:-1], "8")
    assert code == 0 and [json.loads(line)["token_ids"] for line in text.splitlines()
                          if line.startswith("{")] != outs[("ckpt", "8")]


def test_stop_streaming_and_bad_input(model: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "full.jsonl"
    code, text = _generate(str(model["ckpt"]), "--input", str(model["prompts"]), "--output",
                           str(out), "--max-new-tokens", "8")
    assert code == 0, text
    full = _rows(out)[1]
    stop = full["completion"][len(full["completion"]) // 2:][:3]
    assert stop.strip()
    code, text = _generate(str(model["ckpt"]), "--prompt", PROMPTS[1], "--max-new-tokens",
                           "8", "--stop", stop)
    assert code == 0, text
    cut = full["completion"][:full["completion"].index(stop)]
    assert text.startswith(PROMPTS[1] + cut) and "[stop:" in text, text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    code, text = _generate(str(model["ckpt"]), "--input", str(bad))
    assert code == 2 and f'{bad}:2: a row must be {{"prompt": TEXT}}' in " ".join(text.split())
    code, text = _generate(str(model["ckpt"]), "--input", str(model["prompts"]), "--output",
                           str(model["prompts"]))
    assert code == 2 and "is the input" in text
    code, text = _generate(str(model["ckpt"]), "--prompt", "x", "--top-p", "0")
    assert code == 2 and "--top-p must be in (0, 1], got 0" in text
    code, text = _generate(str(model["ckpt"]), "--prompt", "x", "--max-new-tokens", "5000")
    assert code == 2 and "exceed the model's 64 positions" in text, text


def test_a_prompt_too_long_is_named_by_its_line(model: dict[str, Path], tmp_path: Path) -> None:
    """A row of --input whose prompt and --max-new-tokens exceed the model's positions is
    refused before any decoding, naming its file and line (whatever batch it falls in)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in [*PROMPTS, "whale " * 80]))
    out = tmp_path / "out.jsonl"
    code, text = _generate(str(model["ckpt"]), "--input", str(prompts), "--output", str(out),
                           "--max-new-tokens", "4", "--batch-size", "2")
    text = " ".join(text.split())
    assert code == 2 and f"{prompts}:4: a prompt of " in text, text
    assert "tokens + 4 new tokens exceed the model's 64 positions: lower --max-new-tokens" \
        in text, text
    assert not out.exists()


def test_rows_with_data_of_their_own_are_prompts(tmp_path: Path) -> None:
    """A row's own fields (an id, mt generate's own output: ``logprobs`` as a list, a
    ``seed`` or ``n`` kept as metadata, a ``max_tokens`` of null) are the user's: the row is
    read as its prompt; only a sampling setting the options give is refused."""
    from mt_eval import TaskError
    from mt_inference.generation import read_prompts

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "id": 1, "logprobs": [-1.5], "seed": 3, "n": 2, '
                    '"max_tokens": null}\n')
    assert read_prompts(rows) == [(f"{rows}:1", "a")]
    rows.write_text('{"prompt": "a", "temperature": 0.5}\n')
    with pytest.raises(TaskError, match=r"rows.jsonl:1: the row sets temperature"):
        read_prompts(rows)
