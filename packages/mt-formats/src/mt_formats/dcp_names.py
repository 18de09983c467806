"""The state-dict names a torch DCP checkpoint of a GPT may carry, and how each stored
tensor maps to mt's canonical tensors.

A DCP folder stores whatever state dict was saved; for a language model that is one of:

- ``torchtitan``: torchtitan's Llama 3 (0.3: ``layers.N.attention.qkv_linear.wq.weight``,
  ``lm_head.weight``; earlier releases: ``layers.N.attention.wq.weight``,
  ``output.weight``), ``tok_embeddings``, ``attention_norm``, ``feed_forward.w1``
  (gate) / ``w3`` (up) / ``w2`` (down), ``ffn_norm``, ``norm``. Its RoPE rotates adjacent
  pairs of a head (Meta's layout) where mt and Hugging Face rotate the two halves, so the
  rows of ``wq`` and ``wk`` are permuted per head on the way in and out (the permutation
  Hugging Face's and torchtitan's own converters apply).
- ``hf-gpt2``: ``transformers.GPT2LMHeadModel.state_dict()`` (``transformer.h.N.attn.c_attn
  .weight``, Conv1D weights transposed, ``lm_head.weight`` a copy of the tied ``wte``).
- ``hf-llama``: ``transformers.LlamaForCausalLM.state_dict()``.
- ``mt``: ``mt_model.GPT``'s own names.

torchtitan and mt names may sit under an outer ``model.`` (a state dict saved as
``{"model": ...}``); GPT-2's may lack ``transformer.`` (``GPT2Model``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mt_formats.errors import ConvertError
from mt_formats.hf_config import HF_IGNORED, hf_name
from mt_formats.hf_llama import is_llama, llama_parts
from mt_model import GPTConfig

__all__ = ["Naming", "Part", "detect_naming", "from_interleaved", "to_interleaved",
           "writer_naming"]

_TITAN_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight",
              "model.norm.weight": "norm.weight"}
_TITAN_LAYER = {
    "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
    "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
    "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: First name component of every tensor of a family (other entries of the state dict, such
#: as torchtitan's ``optimizer.*`` or ``lr_scheduler.*``, are not the model's).
_ROOTS = {"torchtitan": ("tok_embeddings", "layers", "norm", "output", "lm_head"),
          "hf-gpt2": ("wte", "wpe", "h", "ln_f"),
          "hf-llama": ("model", "lm_head"),
          "mt": ("embed", "blocks", "ln_f", "head")}
#: (family, marker tensor, the prefixes it may carry)
_MARKERS = (("torchtitan", "tok_embeddings.weight", ("", "model.")),
            ("hf-gpt2", "wte.weight", ("transformer.", "")),
            ("hf-llama", "model.embed_tokens.weight", ("",)),
            ("mt", "embed.tokens.weight", ("", "model.")))


@dataclass(frozen=True)
class Part:
    """One stored tensor of a canonical one: its key, its rows of the canonical tensor (-1:
    all of it) and how it is stored (``""``, ``"transpose"`` or ``"interleave H"``: rows
    of H heads in torchtitan's RoPE order)."""

    key: str
    rows: int = -1
    transform: str = ""

    def shape(self, canonical: tuple[int, ...]) -> tuple[int, ...]:
        """The stored shape, given the canonical tensor's."""
        if self.transform == "transpose":
            return tuple(reversed(canonical))
        return (canonical[0] if self.rows < 0 else self.rows, *canonical[1:])

    def store(self, piece: torch.Tensor) -> torch.Tensor:
        """This part's rows of the canonical tensor, as stored."""
        if self.transform == "transpose":
            return piece.t().contiguous()
        if self.transform.startswith("interleave"):
            return to_interleaved(piece, int(self.transform.split()[1]))
        return piece.contiguous()

    def load(self, stored: torch.Tensor) -> torch.Tensor:
        """The canonical rows of a stored tensor (the inverse of :meth:`store`)."""
        if self.transform == "transpose":
            return stored.t().contiguous()
        if self.transform.startswith("interleave"):
            return from_interleaved(stored, int(self.transform.split()[1]))
        return stored


def to_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of ``heads`` heads from the rotate-half order (mt, Hugging Face: per head the
    first halves of the rotated pairs, then the second halves) to the interleaved order of
    torchtitan and Meta's Llama (per head, the pairs side by side)."""
    rows = weight.shape[0]
    return (weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


def from_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`to_interleaved`."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


@dataclass(frozen=True)
class Naming:
    """A family of names (see the module docstring) under ``prefix``. torchtitan's
    variant: ``legacy`` names (``attention.wq``, ``output``) or 0.3's."""

    family: str
    prefix: str = ""
    legacy: bool = False

    @property
    def embed_key(self) -> str:
        return self.prefix + dict((f, m) for f, m, _ in _MARKERS)[self.family]

    def head_key(self) -> str:
        """The output head's key (families that store one)."""
        if self.family == "torchtitan":
            return self.prefix + ("output.weight" if self.legacy else "lm_head.weight")
        return {"hf-gpt2": "lm_head.weight", "hf-llama": "lm_head.weight",
                "mt": self.prefix + "head.weight"}[self.family]

    def owns(self, key: str) -> bool:
        """Whether ``key`` is one of the model's tensors (not optimizer state, a buffer
        or another entry saved beside them)."""
        if key == self.head_key():
            return True
        if not key.startswith(self.prefix):
            return False
        rest = key[len(self.prefix):]
        if self.family == "hf-gpt2" and HF_IGNORED.match(rest):
            return False  # the causal-mask buffers older transformers saved
        return rest.split(".", 1)[0] in _ROOTS[self.family]

    def parts(self, name: str, config: GPTConfig) -> list[Part]:
        """The stored tensors canonical tensor ``name`` is made of (rows concatenated)."""
        if self.family == "mt":
            return [Part(self.prefix + name)]
        if self.family == "hf-gpt2":
            short, transposed = hf_name(name)
            return [Part(self.prefix + short, -1, "transpose" if transposed else "")]
        parts = [Part(key, rows) for key, rows in llama_parts(name, config)]
        if self.family == "hf-llama":
            return parts
        return [self._titan(part, config) for part in parts]

    def _titan(self, part: Part, config: GPTConfig) -> Part:
        key = part.key
        if key == "lm_head.weight":
            return Part(self.head_key(), part.rows)
        if key in _TITAN_TOP:
            return Part(self.prefix + _TITAN_TOP[key], part.rows)
        match = _HF_LAYER.match(key)
        if not match or match.group(2) not in _TITAN_LAYER:
            raise ConvertError(f"tensor {key!r} has no torchtitan Llama equivalent (torchtitan's "
                               "Llama has no biases)")
        layer, rest = match.groups()
        leaf = _TITAN_LAYER[rest]
        if self.legacy:
            leaf = leaf.replace("qkv_linear.", "")
        transform = {"self_attn.q_proj.weight": f"interleave {config.n_heads}",
                     "self_attn.k_proj.weight": f"interleave {config.n_kv_heads}"}.get(rest, "")
        return Part(f"{self.prefix}layers.{layer}.{leaf}", part.rows, transform)

    def tied_copy(self, config: GPTConfig) -> str | None:
        """The key of the stored copy of a tied embedding (``lm_head.weight``: transformers
        and torchtitan list tied weights under both names), or None."""
        if self.family == "hf-gpt2" or (self.family in ("torchtitan", "hf-llama")
                                        and config.tied_embeddings):
            return self.head_key()
        return None

    def sizes(self, shapes: Mapping[str, tuple[int, ...]], fields: Mapping[str, Any],
              where: Path) -> dict[str, Any]:
        """The config fields the stored shapes decide (sizes, and the architecture the names
        imply), given the other fields (``n_heads``, ``mlp``) from ``fields``."""
        def shape(key: str) -> tuple[int, ...]:
            if self.prefix + key not in shapes and key not in shapes:
                raise ConvertError(f"{where}: no tensor {self.prefix + key!r}: not the "
                                   f"{self.family} names it otherwise uses")
            return shapes.get(self.prefix + key) or shapes[key]

        vocab, hidden = shape(self.embed_key.removeprefix(self.prefix))
        pattern = {"torchtitan": r"layers\.(\d+)\.", "hf-gpt2": r"h\.(\d+)\.",
                   "hf-llama": r"model\.layers\.(\d+)\.", "mt": r"blocks\.(\d+)\."}[self.family]
        layers = {int(m.group(1)) for key in shapes
                  if (m := re.match(re.escape(self.prefix) + pattern, key))}
        if layers != set(range(len(layers))) or not layers:
            raise ConvertError(f"{where}: layer numbers {sorted(layers)} are not 0..N-1")
        sizes: dict[str, Any] = {"n_layers": len(layers), "hidden": hidden, "vocab_size": vocab}
        if self.family == "hf-gpt2":
            sizes.update(seq_len=shape("wpe.weight")[0], ffn_hidden=shape("h.0.mlp.c_fc.weight")[1],
                         position="learned", norm="layernorm", mlp="gelu", bias=True,
                         tied_embeddings=True)
            return sizes
        if self.family == "mt":
            if self.prefix + "embed.positions.weight" in shapes:
                sizes["seq_len"] = shapes[self.prefix + "embed.positions.weight"][0]
            rows = shape("blocks.0.mlp.fc.weight")[0]
            sizes["ffn_hidden"] = rows // 2 if fields.get("mlp") == "swiglu" else rows
            sizes["tied_embeddings"] = self.head_key() not in shapes
            return sizes
        gate, k_rows = (("layers.0.feed_forward.w1.weight", "layers.0.attention."
                         + ("" if self.legacy else "qkv_linear.") + "wk.weight")
                        if self.family == "torchtitan" else
                        ("model.layers.0.mlp.gate_proj.weight",
                         "model.layers.0.self_attn.k_proj.weight"))
        heads = fields.get("n_heads")
        if not isinstance(heads, int) or heads < 1 or hidden % heads:
            raise ConvertError(f"{where}: n_heads {heads!r} of the given config does not "
                               f"divide the hidden size {hidden}")
        biased = self.family == "hf-llama" and any(k.endswith("q_proj.bias") for k in shapes)
        sizes.update(ffn_hidden=shape(gate)[0], n_kv_heads=shape(k_rows)[0] // (hidden // heads),
                     position="rope", norm="rmsnorm", mlp="swiglu", bias=biased,
                     tied_embeddings=self.head_key() not in shapes)
        return sizes


def detect_naming(keys: set[str], where: Path) -> Naming:
    """The family of names ``keys`` (a DCP folder's tensor keys) use, or a ConvertError."""
    for family, marker, prefixes in _MARKERS:
        for prefix in prefixes:
            if prefix + marker in keys:
                legacy = (family == "torchtitan"
                          and f"{prefix}layers.0.attention.wq.weight" in keys)
                return Naming(family, prefix, legacy)
    sample = sorted(keys)[:6]
    raise ConvertError(f"{where}: no language model's embedding among the stored tensors "
                       "(looked for torchtitan's tok_embeddings.weight, Hugging Face's "
                       "transformer.wte.weight or model.embed_tokens.weight, mt's "
                       f"embed.tokens.weight); stored: {sample}{' ...' if len(keys) > 6 else ''}")


def writer_naming(config: GPTConfig) -> Naming:
    """The names mt writes: torchtitan's for a Llama-shaped model (without biases),
    transformers' GPT-2 names for GPT-2, mt's own for any other block."""
    if is_llama(config):
        if config.bias:
            raise ConvertError("torchtitan's Llama has no biases; this model has them: "
                               "write it as hf instead")
        return Naming("torchtitan")
    if config.architecture == "gpt2":
        return Naming("hf-gpt2", "transformer.")
    return Naming("mt")
