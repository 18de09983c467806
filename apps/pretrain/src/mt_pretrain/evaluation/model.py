"""What `mt eval` evaluates: the model config, its full weights and its tokenizer, read from
an `mt pretrain` checkpoint (the folder, its ``latest``, or one step)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mt_checkpoint import CheckpointError, find_checkpoint, read_meta
from mt_model import GPTConfig
from mt_pretrain.config.schema import DataArgs
from mt_pretrain.run.checkpoint import consolidated_model
from mt_pretrain.run.data import run_tokenizer

__all__ = ["EvalModel", "load_eval_model"]


@dataclass
class EvalModel:
    """A model to evaluate: ``weights`` are full (unsharded) fp32 tensors by mt name."""

    config: GPTConfig
    weights: dict[str, torch.Tensor]
    tokenizer: str
    source: str
    step: int | None = None


def _configured_tokenizer(config: Any, vocab_size: int) -> str | None:
    """The tokenizer of a checkpoint that predates the meta's ``tokenizer`` field."""
    data = dict(config.get("data") or {}) if isinstance(config, dict) else {}
    return run_tokenizer(DataArgs(data=data.get("data"), tokenizer=data.get("tokenizer")),
                         vocab_size)


def load_eval_model(path: str | Path, tokenizer: str | None = None) -> EvalModel:
    """Config, full weights and tokenizer of the checkpoint at ``path``."""
    folder = find_checkpoint(path)
    meta = read_meta(folder)
    model, weights = consolidated_model(folder)
    config = GPTConfig.from_dict(model)
    name = tokenizer or meta.tokenizer or _configured_tokenizer(meta.config, config.vocab_size)
    if name is None:
        raise CheckpointError(f"{folder}: the tokenizer the run trained with is not recorded "
                              "and its dataset is not here; pass --tokenizer (gpt2, "
                              "tokenizer-1k, a tokenizer.json or a folder)")
    return EvalModel(config, weights, name, str(folder), meta.step)
