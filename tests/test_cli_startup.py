"""The `mt` command line starts without torch: `--help` of every command and every `mt data`
command import none of it (torch takes seconds to import), and `mt data prepare` run through
the CLI forks its workers (a loaded torch or a second thread would make them spawn, each
re-importing the CLI's modules).

Each check runs in a fresh interpreter where ``import torch`` fails, so that any import of it
on the way is an error naming the importer, not a slower start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# `mt convert`, `mt eval` ... are mounted from their entry points once installed; from the
# source tree, here (as tests/mt_cli.py does).
_NO_TORCH = """
import importlib
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from mt_inference.cli import COMMANDS
from mt_pretrain.cli.app import app
for name, module in {{**COMMANDS, "convert": "mt_convert.cli"}}.items():
    app.add_typer(importlib.import_module(module).app, name=name)
sys.argv = ["mt", *{args!r}]
app()
"""


@pytest.mark.parametrize("args", [
    ["--help"], ["pretrain", "--help"], ["data", "--help"], ["data", "prepare", "--help"],
    ["data", "inspect", "--help"], ["plan", "--help"], ["eval", "--help"], ["matrix", "--help"],
    ["generate", "--help"], ["serve", "--help"], ["bias", "--help"],
    ["convert", "--help"], ["--version"],
], ids=" ".join)
def test_help_imports_no_torch(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", _NO_TORCH.format(args=args)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "120"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Usage:" in done.stdout or "mt-data" in done.stdout, done.stdout


_PREPARE = """
import sys
import mt_data.pipeline as pipeline
from mt_pretrain.cli.app import app

chosen = []
pool_context = pipeline._pool_context
def spy():
    context = pool_context()
    chosen.append(context.get_start_method())
    return context
pipeline._pool_context = spy
sys.argv = ["mt", *{args!r}]
try:
    app()
finally:
    print("START-METHODS", chosen, "torch" in sys.modules, file=sys.stderr)
"""


def test_data_prepare_through_the_cli_forks_its_workers(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    with open(raw / "a.jsonl", "w", encoding="utf-8") as f:
        for i in range(400):
            f.write(json.dumps({"text": f"Document {i}: the quick brown fox jumps over the "
                                        "lazy dog, again and again. " * 4}) + "\n")
    args = ["data", "prepare", str(raw), "-o", str(tmp_path / "out"), "--workers", "2",
            "--tokenizer", "tokenizer-1k"]
    done = subprocess.run([sys.executable, "-c", _PREPARE.format(args=args)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "START-METHODS ['fork'] False" in done.stderr, done.stderr
    assert (tmp_path / "out" / "index.json").is_file()


_CONVERT = """
import sys
sys.modules["torch.distributed.checkpoint"] = None  # any import of it now raises
from mt_convert.cli import app
from mt_formats import save_model
from mt_model import GPT, GPTConfig
model = GPT(GPTConfig(n_layers=2, hidden=32, n_heads=4, vocab_size=64, seq_len=16), seed=0)
save_model(model, sys.argv[1] + "/tp", to="tp", tp=2)
sys.argv = ["mt-convert", sys.argv[1] + "/tp", sys.argv[1] + "/full"]
try:
    app()
finally:
    print("slow imports:", [m for m in ("torch._dynamo", "sympy") if m in sys.modules])
"""


def test_conversions_between_mt_formats_import_no_dcp(tmp_path: Path) -> None:
    """`mt convert` between formats that are not torch DCP or Megatron-core never imports
    ``torch.distributed.checkpoint`` (about a second, with DTensor and sympy), not even to
    detect the source's format; and the shapes it computes on the meta device (the model's,
    the shards') import neither ``torch._dynamo`` nor sympy (torch's Python reference
    implementations of some meta ops do: a second each)."""
    done = subprocess.run([sys.executable, "-c", _CONVERT, str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "full" / "model.safetensors").is_file()
    assert "slow imports: []" in done.stdout, done.stdout
