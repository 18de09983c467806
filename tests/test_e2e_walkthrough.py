"""The README's walk from "my text" to a trained, evaluated and exported model, command by
command as a user types them (subprocesses, real files): prepare raw JSONL, train on it at
DP 2, evaluate the checkpoint, export it for Hugging Face transformers, load the export
there. The first step also tries the defaults that do not fit together (mt data prepare's
GPT-2 tokenizer with the tiny model) and checks the error says both ways out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mt_data.corpus import iter_corpus

# The commands run in the user's folder; this interpreter's import path, made absolute,
# finds mt there (a test runner's path may be relative to its own folder).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "300", "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in sys.path if p)}


def _mt(where: Path, *args: str, module: str = "mt_pretrain"
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                          text=True, timeout=600, env=ENV, cwd=where)


def test_from_my_text_to_an_evaluated_exported_model(tmp_path: Path) -> None:
    text = tmp_path / "my.jsonl"
    docs = list(iter_corpus())[:300]
    text.write_text("".join(json.dumps({"text": d["text"]}) + "\n" for d in docs))
    done = _mt(tmp_path, "data", "prepare", "my.jsonl", "-o", "gpt2-data", "--workers", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    train = ["--train-steps", "4", "--seq-len", "64", "--global-batch-size", "8",
             "--micro-batch-size", "2", "--nproc", "2", "--no-progress", "--sample-tokens", "0"]
    done = _mt(tmp_path, "pretrain", "--data", "gpt2-data", *train, "--out-dir", "wrong")
    assert done.returncode == 2, done.stdout + done.stderr
    error = " ".join(done.stderr.split())
    assert "uses a tokenizer of 50257 ids but the model vocabulary has 1000" in error, error
    assert "--tokenizer tokenizer-1k" in error and "--model gpt2-small" in error, error
    # The README's commands.
    done = _mt(tmp_path, "data", "prepare", "my.jsonl", "-o", "data", "--tokenizer",
               "tokenizer-1k", "--workers", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    done = _mt(tmp_path, "pretrain", "--data", "data", *train, "--out-dir", "run")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checkpoint run/checkpoints/step-00000004" in done.stdout, done.stdout
    done = _mt(tmp_path, "eval", "run/checkpoints", "--task", "mt-cloze", "--limit", "8",
               "--output", "results.json", module="mt_inference")
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["results"]["mt-cloze"]["sample_len"] == 8  # lm-eval's results schema
    done = _mt(tmp_path, "run/checkpoints", "hf", "--to", "hf", module="mt_convert")
    assert done.returncode == 0, done.stdout + done.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer("Call me Ishmael.", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], 1000)
