"""Hugging Face Llama checkpoints (``LlamaForCausalLM``): config, names, reader and writer.

mt's Llama-family model (``position="rope"``, ``norm="rmsnorm"``, ``mlp="swiglu"``) stores
some HF tensors fused along dim 0: ``attn.kv`` = [k_proj; v_proj] (grouped-query),
``attn.qkv`` = [q_proj; k_proj; v_proj] (multi-head), ``mlp.fc`` = [gate_proj; up_proj]. HF's
q/k layout is already the rotate-half one mt's RoPE uses, so no permutation is needed. Read:
``model.safetensors`` or a sharded index (as GPT-2 folders). Written: ``config.json`` and one
``model.safetensors`` loadable by ``LlamaForCausalLM.from_pretrained`` without missing or
unexpected keys. A tied head (``tie_word_embeddings``) is stored once, as HF does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from mt_formats.canonical import CheckpointReader, CheckpointWriter, TensorRef, canonical_shapes
from mt_formats.errors import ConvertError
from mt_formats.hf_tokenizer import write_hf_config
from mt_formats.safetensors_io import SafetensorsWriter
from mt_formats.tensors import TensorSpec, check_names
from mt_model import GPTConfig

__all__ = ["LlamaReader", "LlamaWriter", "gpt_config_from_llama", "is_llama",
           "llama_config_from_gpt", "llama_parts"]

SAFETENSORS = "model.safetensors"
HEAD = "lm_head.weight"
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_TOP = {"embed.tokens.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
        "head.weight": HEAD}
_BLOCK_PARTS = {
    "ln1.weight": ("input_layernorm.weight",),
    "ln2.weight": ("post_attention_layernorm.weight",),
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.q": ("self_attn.q_proj",),
    "attn.kv": ("self_attn.k_proj", "self_attn.v_proj"),
    "attn.proj": ("self_attn.o_proj",),
    "mlp.fc": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.proj": ("mlp.down_proj",),
}


def is_llama(config: GPTConfig) -> bool:
    """Whether ``config`` is a model ``LlamaForCausalLM`` computes."""
    return (config.position, config.norm, config.mlp) == ("rope", "rmsnorm", "swiglu")


def llama_parts(name: str, config: GPTConfig) -> list[tuple[str, int]]:
    """(HF key, rows) of each HF tensor whose dim-0 concatenation is mt tensor ``name``."""
    if name in _TOP:
        return [(_TOP[name], -1)]
    match = _BLOCK.match(name)
    if match:
        layer, rest = match.groups()
        module, _, leaf = rest.rpartition(".")
        keys = _BLOCK_PARTS.get(rest) or _BLOCK_PARTS.get(module)
        if keys is not None:
            kv = config.n_kv_heads * config.head_dim
            rows = {"attn.qkv": [config.hidden, kv, kv], "attn.kv": [kv, kv],
                    "mlp.fc": [config.ffn_hidden, config.ffn_hidden]}.get(module, [-1])
            suffix = "" if rest in _BLOCK_PARTS else f".{leaf}"
            return [(f"model.layers.{layer}.{key}{suffix}", n) for key, n in zip(
                keys, rows if len(keys) > 1 else [-1], strict=True)]
    raise ConvertError(f"tensor {name!r} has no Hugging Face Llama equivalent")


def llama_config_from_gpt(config: GPTConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to ``mt_model.GPT(config)``."""
    if not is_llama(config):
        raise ConvertError(f"this model ({config.architecture}) is neither GPT-2 nor "
                           "Llama-shaped: the hf format cannot express it")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden,
        "intermediate_size": config.ffn_hidden, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "hidden_act": "silu",
        "max_position_embeddings": config.seq_len, "rms_norm_eps": config.layernorm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": config.bias, "mlp_bias": config.bias,
        "tie_word_embeddings": config.tied_embeddings, "initializer_range": config.init_std,
        "attention_dropout": config.attention_dropout, "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
        "mt": {"gpt_config": config.to_dict()},
    }


def gpt_config_from_llama(data: dict[str, Any], path: Path) -> GPTConfig:
    """The mt config of a HF Llama ``config.json``; what mt cannot reproduce (RoPE scaling,
    other activations, a head width other than hidden / heads, different attention and
    MLP bias settings) raises :class:`ConvertError` naming the field."""
    def refuse(key: str, value: Any, allowed: str) -> None:
        raise ConvertError(f"{path}: {key}={value!r} is not supported by mt's Llama "
                           f"({allowed})")

    if data.get("rope_scaling"):
        refuse("rope_scaling", data["rope_scaling"], "no RoPE scaling")
    # transformers >= 5 writes rope_parameters {rope_type, rope_theta}; older, rope_theta.
    rope = data.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        refuse("rope_parameters.rope_type", rope["rope_type"], "default (no RoPE scaling)")
    theta = float(rope.get("rope_theta", data.get("rope_theta", 10000.0)))
    if data.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", data["hidden_act"], "silu")
    hidden, heads = data.get("hidden_size", 4096), data.get("num_attention_heads", 32)
    if data.get("head_dim") not in (None, hidden // max(heads, 1)):
        refuse("head_dim", data["head_dim"], f"hidden_size / num_attention_heads = "
                                             f"{hidden // max(heads, 1)}")
    bias = bool(data.get("attention_bias", False))
    if bool(data.get("mlp_bias", False)) != bias:
        refuse("mlp_bias", data.get("mlp_bias"), "equal to attention_bias")
    try:
        return GPTConfig(
            n_layers=data.get("num_hidden_layers", 32), hidden=hidden, n_heads=heads,
            vocab_size=data.get("vocab_size", 32000),
            seq_len=data.get("max_position_embeddings", 2048),
            ffn_hidden=data.get("intermediate_size", 11008),
            attention_dropout=data.get("attention_dropout", 0.0),
            layernorm_eps=data.get("rms_norm_eps", 1e-6),
            init_std=data.get("initializer_range", 0.02),
            position="rope", rope_theta=theta, norm="rmsnorm",
            mlp="swiglu", n_kv_heads=data.get("num_key_value_heads") or heads, bias=bias,
            tied_embeddings=bool(data.get("tie_word_embeddings", False)))
    except (TypeError, ValueError) as err:
        raise ConvertError(f"{path}: cannot build an mt config: {err}") from None


class LlamaReader(CheckpointReader):
    """Reads a Hugging Face Llama directory as canonical mt tensors."""

    format = "hf"

    def __init__(self, root: Path, data: dict[str, Any], files: dict[str, Any]) -> None:
        self.root = Path(root)
        self.config = gpt_config_from_llama(data, self.root / "config.json")
        self._shapes = canonical_shapes(self.config)
        self._files = files
        try:
            self._where = {key: (file, key) for file, reader in files.items()
                           for key in reader.keys()}
            expected = [key for name in self._shapes
                        for key, _ in llama_parts(name, self.config)]
            found = [k for k in self._where if not (k == HEAD and self.config.tied_embeddings)]
            check_names(self.root, found, expected)
            for name, shape in self._shapes.items():
                rows = sum(self._spec(key).shape[0] for key, _ in llama_parts(name, self.config))
                tail = self._spec(llama_parts(name, self.config)[0][0]).shape[1:]
                if (rows, *tail) != shape:
                    raise ConvertError(f"{self.root}: {name} would have shape "
                                       f"{[rows, *tail]}, config.json needs {list(shape)}")
        except BaseException:
            self.close()
            raise

    def _spec(self, key: str) -> TensorSpec:
        file, _ = self._where[key]
        return self._files[file].spec(key)

    def names(self) -> list[str]:
        return list(self._shapes)

    def spec(self, name: str) -> TensorSpec:
        first = llama_parts(name, self.config)[0][0]
        return TensorSpec(self._shapes[name], self._spec(first).dtype)

    def sources(self, name: str) -> list[TensorRef]:
        parts = llama_parts(name, self.config)
        return [TensorRef(self._where[key][0], key, self._spec(key),
                          f"rows {i + 1}/{len(parts)}" if len(parts) > 1 else "")
                for i, (key, _) in enumerate(parts)]

    def read(self, name: str) -> torch.Tensor:
        tensors = [self._files[self._where[key][0]].get(key)
                   for key, _ in llama_parts(name, self.config)]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    def close(self) -> None:
        for reader in getattr(self, "_files", {}).values():
            reader.close()


class LlamaWriter(CheckpointWriter):
    """Writes ``config.json`` and ``model.safetensors`` for ``LlamaForCausalLM`` (and the
    tokenizer when one is known)."""

    format = "hf"

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec]) -> None:
        super().__init__(config, specs)
        llama_config_from_gpt(config, torch.float32)  # refuses what HF cannot express
        self._parts = {name: llama_parts(name, config) for name in self.specs}
        self._writer: SafetensorsWriter | None = None
        self._directory: Path | None = None

    def _entries(self, name: str) -> list[tuple[str, TensorSpec]]:
        spec = self.specs[name]
        return [(key, TensorSpec((spec.shape[0] if rows < 0 else rows, *spec.shape[1:]),
                                 spec.dtype)) for key, rows in self._parts[name]]

    def targets(self, name: str) -> list[TensorRef]:
        entries = self._entries(name)
        return [TensorRef(SAFETENSORS, key, spec, f"rows {i + 1}/{len(entries)}"
                          if len(entries) > 1 else "") for i, (key, spec) in enumerate(entries)]

    def open(self, directory: Path) -> None:
        self._directory = Path(directory)
        entries = {key: spec for name in self.specs for key, spec in self._entries(name)}
        self._writer = SafetensorsWriter(self._directory / SAFETENSORS, entries)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        assert self._writer is not None, "open() first"
        start = 0
        for key, spec in self._entries(name):
            self._writer.write(key, tensor[start:start + spec.shape[0]].contiguous())
            start += spec.shape[0]

    def finish(self) -> None:
        assert self._writer is not None and self._directory is not None, "open() first"
        self._writer.close()
        body = llama_config_from_gpt(self.config, self.specs["embed.tokens.weight"].dtype)
        write_hf_config(self._directory, body, self.tokenizer, self.config)

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
