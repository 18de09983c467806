"""The model the evaluation tests score (a helper module of tests/, not a test): a tiny GPT
with the GPT-2 vocabulary trained briefly by `mt pretrain`, and its `mt convert --to hf`
export (weights, config and the tokenizer it trained with)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from typer.testing import CliRunner

from mt_convert.cli import app as convert_app
from mt_pretrain.config.load import load_config
from mt_pretrain.launch import launch

T = TypeVar("T")


def single_threaded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` with torch on one thread (the ranks it starts use one each)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def trained_gpt2_vocab(root: Path, model: str = "tiny", seq_len: int | None = None,
                       steps: int = 3) -> tuple[Path, Path]:
    """(the checkpoint of ``steps`` steps of `mt pretrain --model MODEL --vocab-size 50257`
    (tiny: GPT-2-shaped; llama-test: grouped-query heads, RoPE), its Hugging Face export with
    the tokenizer) under ``root``. The tests compare mt with its references on the same
    weights, so a few steps do (each step computes 50257 logits a position: seconds each at
    320 positions)."""
    config = load_config(None, {
        "model": model, "vocab_size": 50257, "tokenizer": "gpt2", "nproc": 1,
        "micro_batch_size": 4, "global_batch_size": 8, "train_steps": steps, "eval_interval": 0,
        "sample_tokens": 0, "progress": False, "log_interval": 100, "timeout": 300.0,
        "out_dir": str(root / "run"), "cache_dir": str(root / "cache"),
        **({"seq_len": seq_len} if seq_len else {})})
    summary = single_threaded(launch, config, {}, 600)
    result = CliRunner().invoke(convert_app, [summary.checkpoint, str(root / "hf"), "--to",
                                              "hf"])
    assert result.exit_code == 0, result.output
    return Path(summary.checkpoint), root / "hf"
