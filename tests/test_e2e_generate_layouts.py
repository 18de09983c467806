"""Cross-app: `mt generate` at TP 2 x PP 2 (four processes) gives transformers' greedy tokens.

A GPT-2-shaped and a Llama-shaped model (grouped-query heads, RoPE, untied head), each
trained briefly by `mt pretrain` with the GPT-2 vocabulary and exported by `mt convert --to
hf`: prompts of different lengths decoded together, 64 new tokens each, at one process and at
TP 2 x PP 2, equal `generate(do_sample=False)` of transformers on the export, prompt by
prompt, and each token's log-probability equals transformers' within 1e-4 (fp32). A seeded
sample gives the same tokens at one process (batched and alone), TP 2 and PP 2 (two batches
interleaved through the stages; the batch whole is the greedy test's TP 2 x PP 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from e2e_models import trained_gpt2_vocab
from mt_cli import app
from typer.testing import CliRunner

PROMPTS = ["Call me Ishmael.", "The whale swam", "It was the best of times, it was the worst",
           "A"]
LAYOUTS = {"one": [], "tp2pp2": ["--nproc", "4", "--tp", "2", "--pp", "2"]}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("layouts")
    return {name: trained_gpt2_vocab(root / name, preset, seq_len=96)
            for name, preset in (("gpt2", "tiny"), ("llama", "llama-test"))}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def _generate(ckpt: Path, prompts: Path, out: Path, *args: str) -> list[dict]:
    result = CliRunner().invoke(app, ["generate", str(ckpt), "--input", str(prompts),
                                      "--output", str(out), *args])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_64_tokens_equal_transformers(models: dict[str, tuple[Path, Path]],
                                             prompts: Path, tmp_path: Path, name: str,
                                             layout: str) -> None:
    import transformers

    ckpt, hf_dir = models[name]
    rows = _generate(ckpt, prompts, tmp_path / "out.jsonl", "--max-new-tokens", "64",
                     "--logprobs", *LAYOUTS[layout])
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for prompt, row in zip(PROMPTS, rows, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=64, do_sample=False, output_scores=True,
                              return_dict_in_generate=True,
                              pad_token_id=tokenizer.eos_token_id)
        expected = out.sequences[0, ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in expected:  # mt stops at end-of-text, excluded
            expected = expected[:expected.index(tokenizer.eos_token_id)]
        assert row["token_ids"] == expected, (name, layout, prompt)
        want = [float(torch.log_softmax(score[0].float(), -1)[token])
                for score, token in zip(out.scores, expected, strict=False)]
        assert row["logprobs"] == pytest.approx(want, abs=1e-4, rel=0), (name, layout)
        assert len(expected) == 64 or row["finish_reason"] == "stop"


def test_a_seeded_sample_is_the_same_at_every_layout(models: dict[str, tuple[Path, Path]],
                                                     prompts: Path, tmp_path: Path) -> None:
    ckpt = models["llama"][0]
    sample = ["--max-new-tokens", "16", "--temperature", "0.9", "--top-p", "0.95", "--seed",
              "11"]
    runs = {"one": [], "alone": ["--batch-size", "1"], "tp2": ["--nproc", "2", "--tp", "2"],
            "pp2-interleaved": ["--nproc", "2", "--pp", "2", "--in-flight", "2"]}
    tokens = {run: [r["token_ids"] for r in _generate(ckpt, prompts, tmp_path / f"{run}.jsonl",
                                                      *sample, *args)]
              for run, args in runs.items()}
    assert all(len(t) == 16 for t in tokens["one"])
    assert all(tokens[run] == tokens["one"] for run in runs), tokens
