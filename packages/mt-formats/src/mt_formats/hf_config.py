"""Hugging Face GPT-2 ``config.json`` <-> :class:`mt_model.GPTConfig`, and tensor names.

Differences the mapping takes care of:

- HF GPT-2 stores its linear layers as ``Conv1D`` with the weight transposed
  (``[in, out]``); mt uses ``nn.Linear`` (``[out, in]``). The fused ``c_attn`` has the same
  ``[q; k; v]`` order with heads contiguous, so a transpose is the whole conversion.
- Activation: HF ``gelu_new`` / ``gelu_pytorch_tanh`` is the tanh approximation
  (``gelu_approximate="tanh"``), HF ``gelu`` the exact erf form (``"none"``).
- The output head is tied to ``wte`` in both; mt stores it once, HF files may carry a
  duplicate ``lm_head.weight`` (accepted when equal) and, before transformers 4.31, the
  causal-mask buffers ``attn.bias`` / ``attn.masked_bias`` (ignored).
- mt-only settings (``init_std``, ``scaled_output_init``, one dropout for embeddings and
  residuals) travel in an extra ``"mt"`` section of the HF config, which transformers keeps
  as a plain attribute, so mt -> HF -> mt restores the exact config.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from mt_formats.errors import ConvertError
from mt_model import GPTConfig

__all__ = [
    "HF_IGNORED",
    "gpt_config_from_hf",
    "hf_config_from_gpt",
    "hf_name",
]

GPT2_EOS = 50256
_TANH = ("gelu_new", "gelu_pytorch_tanh")
_SHAPE_FIELDS = ("n_layers", "hidden", "n_heads", "vocab_size", "seq_len", "ffn_hidden",
                 "layernorm_eps", "gelu_approximate")

# canonical suffix inside a block -> (HF suffix, stored transposed)
_BLOCK_NAMES: dict[str, tuple[str, bool]] = {
    "ln1.weight": ("ln_1.weight", False),
    "ln1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True),
    "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False),
    "ln2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),
    "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
    "mlp.proj.bias": ("mlp.c_proj.bias", False),
}
_TOP_NAMES: dict[str, str] = {
    "embed.tokens.weight": "wte.weight",
    "embed.positions.weight": "wpe.weight",
    "ln_f.weight": "ln_f.weight",
    "ln_f.bias": "ln_f.bias",
}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")

HF_IGNORED = re.compile(r"^h\.\d+\.attn\.(?:bias|masked_bias)$")
"""Old transformers saved the causal mask as a buffer; it carries no weights."""


def hf_name(name: str) -> tuple[str, bool]:
    """HF key (without the ``transformer.`` prefix) of canonical tensor ``name`` and
    whether HF stores it transposed."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name], False
    match = _BLOCK.match(name)
    if match and match.group(2) in _BLOCK_NAMES:
        suffix, transposed = _BLOCK_NAMES[match.group(2)]
        return f"h.{match.group(1)}.{suffix}", transposed
    raise ConvertError(f"tensor {name!r} has no Hugging Face GPT-2 equivalent")


def hf_config_from_gpt(config: GPTConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of a ``GPT2LMHeadModel`` equal to ``mt_model.GPT(config)``."""
    if config.architecture != "gpt2":
        raise ConvertError(f"the hf format writes GPT2LMHeadModel; this model's architecture "
                           f"({config.architecture}) is not GPT-2's")
    in_vocab = config.vocab_size > GPT2_EOS  # GPT-2 BPE ids only make sense if they exist
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.seq_len,
        "n_ctx": config.seq_len,  # read by transformers < 4 and some other tools
        "n_embd": config.hidden,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.ffn_hidden,
        "activation_function": "gelu_new" if config.gelu_approximate == "tanh" else "gelu",
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.attention_dropout,
        "layer_norm_epsilon": config.layernorm_eps,
        "initializer_range": config.init_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": GPT2_EOS if in_vocab else None,
        "eos_token_id": GPT2_EOS if in_vocab else None,
        "dtype": str(dtype).removeprefix("torch."),
        "mt": {"gpt_config": config.to_dict()},
    }


def _require(path: Path, data: dict[str, Any], key: str, allowed: tuple[Any, ...],
             default: Any) -> None:
    value = data.get(key, default)
    if value not in allowed:
        raise ConvertError(f"{path}: {key}={value!r} is not supported by mt's GPT "
                           f"(supported: {list(allowed)})")


def gpt_config_from_hf(data: dict[str, Any], path: Path) -> GPTConfig:
    """The mt config of a HF GPT-2 ``config.json`` (``path`` is for messages). Settings mt
    cannot reproduce (untied head, unscaled or layer-scaled attention, cross attention,
    other activations) raise :class:`ConvertError`."""
    _require(path, data, "model_type", ("gpt2",), None)
    _require(path, data, "scale_attn_weights", (True,), True)
    _require(path, data, "scale_attn_by_inverse_layer_idx", (False,), False)
    _require(path, data, "add_cross_attention", (False,), False)
    _require(path, data, "tie_word_embeddings", (True,), True)
    activation = data.get("activation_function", "gelu_new")
    if activation not in (*_TANH, "gelu"):
        raise ConvertError(f"{path}: activation_function={activation!r} is not supported "
                           f"(supported: {[*_TANH, 'gelu']})")
    try:
        config = GPTConfig(
            n_layers=data.get("n_layer", 12),
            hidden=data.get("n_embd", 768),
            n_heads=data.get("n_head", 12),
            vocab_size=data.get("vocab_size", 50257),
            seq_len=data.get("n_positions", data.get("n_ctx", 1024)),
            ffn_hidden=data.get("n_inner"),
            dropout=data.get("resid_pdrop", 0.1),
            attention_dropout=data.get("attn_pdrop", 0.1),
            layernorm_eps=data.get("layer_norm_epsilon", 1e-5),
            init_std=data.get("initializer_range", 0.02),
            scaled_output_init=True,  # HF GPT-2 scales c_proj init by 1/sqrt(2 n_layer) too
            gelu_approximate="tanh" if activation in _TANH else "none",
        )
    except (TypeError, ValueError) as err:
        raise ConvertError(f"{path}: cannot build an mt GPT config: {err}") from None
    return _merge_mt_section(config, data.get("mt"), path)


def _merge_mt_section(config: GPTConfig, section: Any, path: Path) -> GPTConfig:
    # The "mt" section only restores settings HF cannot express; the GPT-2 fields stay
    # authoritative, so a hand-edited HF config is never silently overridden.
    if not isinstance(section, dict) or not isinstance(section.get("gpt_config"), dict):
        return config
    try:
        stored = GPTConfig.from_dict(section["gpt_config"])
    except (TypeError, ValueError) as err:
        raise ConvertError(f"{path}: invalid mt.gpt_config section: {err}") from None
    if any(getattr(stored, f) != getattr(config, f) for f in _SHAPE_FIELDS):
        return config
    return stored
