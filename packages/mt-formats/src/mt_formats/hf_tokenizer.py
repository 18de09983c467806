"""The tokenizer beside Hugging Face weights, as transformers loads it unaided."""

from __future__ import annotations

import json
from pathlib import Path

from mt_data import Tokenizer, load_tokenizer
from mt_data.tokenizer import TokenizerError
from mt_formats.errors import ConvertError
from mt_model import GPTConfig

__all__ = ["load_named_tokenizer", "write_hf_config", "write_hf_tokenizer"]


def load_named_tokenizer(name: str) -> Tokenizer:
    """``--tokenizer``'s tokenizer (a file, a folder or a name :func:`mt_data.load_tokenizer`
    knows); one that cannot be loaded is a :class:`ConvertError` naming it."""
    try:
        return load_tokenizer(name)
    except TokenizerError as err:
        raise ConvertError(f"tokenizer: {err}") from None


def write_hf_tokenizer(directory: Path, name: str, config: GPTConfig) -> int:
    """Write tokenizer ``name`` as transformers loads it unaided (``tokenizer.json``, its
    config and special tokens: GPT-2's end-of-text as BOS, EOS and UNK); returns its
    end-of-text id."""
    tokenizer = load_named_tokenizer(name)
    if tokenizer.vocab_size > config.vocab_size:
        raise ConvertError(f"tokenizer {name} has {tokenizer.vocab_size} ids, more than the "
                           f"model's vocabulary of {config.vocab_size}")
    tokenizer.save(directory / "tokenizer.json")
    special = {"bos_token": tokenizer.eod_token, "eos_token": tokenizer.eod_token,
               "unk_token": tokenizer.eod_token}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                "model_max_length": config.seq_len, "add_prefix_space": False,
                "clean_up_tokenization_spaces": False}
    for file, body in (("tokenizer_config.json", settings),
                       ("special_tokens_map.json", special)):
        (directory / file).write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    return tokenizer.eod_id


def write_hf_config(directory: Path, body: dict, tokenizer: str | None,
                    config: GPTConfig) -> None:
    """Write ``config.json`` (``body``) and, when ``tokenizer`` is given, the tokenizer, whose
    end-of-text id becomes the config's BOS and EOS."""
    if tokenizer is not None:
        eod = write_hf_tokenizer(directory, tokenizer, config)
        body = {**body, "bos_token_id": eod, "eos_token_id": eod}
    (directory / "config.json").write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
