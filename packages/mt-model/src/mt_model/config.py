"""GPT model configuration: a frozen, validated dataclass and named presets.

The config describes the *unsharded* model. Parallel layouts (tensor, pipeline, data) are
applied from outside, so nothing here knows about ranks or devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["GPTConfig", "GPTConfigError", "PRESETS", "preset"]

_GELU_APPROXIMATIONS = ("none", "tanh")
#: The most layers a config may have (the deepest GPTs have about a hundred).
_MAX_LAYERS = 2**16
#: The largest width, vocabulary or sequence length: torch counts sizes in int64.
_MAX_SIZE = 2**63 - 1


class GPTConfigError(ValueError):
    """Raised when a :class:`GPTConfig` is inconsistent; the message names every number."""


def _default_ffn(hidden: int) -> int:
    return 4 * hidden


def _default_init_std(hidden: int) -> float:
    # MT-NLG (Smith et al. 2022): std = sqrt(1 / (3 * hidden)).
    return math.sqrt(1.0 / (3.0 * hidden))


def _is_int(value: object) -> bool:
    # bool is an int subclass, but n_layers=True is always a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class GPTConfig:
    """Shape, architecture and regularisation of a decoder-only transformer: by default the
    GPT-2 / MT-NLG block (pre-LayerNorm, learned positions, GeLU MLP, multi-head attention,
    tied input/output embedding); ``position``, ``norm``, ``mlp``, ``n_kv_heads``, ``bias``
    and ``tied_embeddings`` give the Llama family's choices.

    ``ffn_hidden`` and ``init_std`` may be passed as ``None``; they are then resolved in
    ``__post_init__`` to ``4 * hidden`` and ``sqrt(1 / (3 * hidden))`` so that reading them
    always gives a number.
    """

    n_layers: int
    """Number of transformer blocks."""
    hidden: int
    """Model width h (residual stream size)."""
    n_heads: int
    """Attention heads; must divide ``hidden``."""
    vocab_size: int
    """Rows of the (tied) token embedding, usually padded for tensor parallelism."""
    seq_len: int
    """Maximum sequence length (rows of the learned position embedding)."""
    ffn_hidden: int | None = None
    """MLP inner width; ``None`` means ``4 * hidden``."""
    dropout: float = 0.0
    """Dropout on embeddings and on both residual branches, in [0, 1)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (training only), in [0, 1)."""
    layernorm_eps: float = 1e-5
    """LayerNorm epsilon (> 0)."""
    init_std: float | None = None
    """Std of the normal init; ``None`` means ``sqrt(1 / (3 * hidden))`` (MT-NLG)."""
    scaled_output_init: bool = True
    """Scale attn.proj / mlp.proj init std by ``1 / sqrt(2 * n_layers)`` (GPT-2 / Megatron)."""
    gelu_approximate: str = field(default="none")
    """``"none"``: exact erf GeLU (default); ``"tanh"``: the tanh approximation used by
    OpenAI GPT-2 checkpoints (HF ``gelu_new``) and Megatron's fused bias-GeLU."""
    position: str = "learned"
    """``"learned"``: an absolute position table (GPT-2); ``"rope"``: rotary embeddings on
    queries and keys (Su et al. 2021, as Llama applies them: halves rotated), no table."""
    rope_theta: float = 10000.0
    """RoPE base (Llama 2: 10000; Llama 3: 500000)."""
    norm: str = "layernorm"
    """``"layernorm"`` or ``"rmsnorm"`` (Zhang & Sennrich 2019; eps ``layernorm_eps``)."""
    mlp: str = "gelu"
    """``"gelu"``: fc -> GeLU -> proj; ``"swiglu"``: fc gives [gate; up] (2 x ffn_hidden),
    then silu(gate) * up -> proj (Shazeer 2020)."""
    n_kv_heads: int | None = None
    """Key/value heads: ``None`` or ``n_heads`` is multi-head attention, fewer is
    grouped-query attention (each kv head serves ``n_heads / n_kv_heads`` query heads), 1 is
    multi-query attention."""
    bias: bool = True
    """Biases in the attention and MLP projections and the LayerNorms (Llama: none)."""
    tied_embeddings: bool = True
    """The output head is the token embedding (GPT-2); False gives the head its own weight
    ``head.weight``."""

    def __post_init__(self) -> None:
        if self.ffn_hidden is None and _is_int(self.hidden) and self.hidden > 0:
            object.__setattr__(self, "ffn_hidden", _default_ffn(self.hidden))
        if self.n_kv_heads is None and _is_int(self.n_heads):
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.init_std is None and _is_int(self.hidden) and self.hidden > 0:
            object.__setattr__(self, "init_std", _default_init_std(self.hidden))
        problems = self._problems()
        if problems:
            raise GPTConfigError("invalid GPTConfig: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        """Every inconsistency at once, so a user fixes a config in one go."""
        problems: list[str] = []
        for name in ("n_layers", "hidden", "n_heads", "vocab_size", "seq_len", "ffn_hidden"):
            value = getattr(self, name)
            if value is None and name == "ffn_hidden":
                continue  # left unresolved only because hidden is invalid (reported)
            if not _is_int(value) or value <= 0:
                problems.append(f"{name} must be a positive int, got {value!r}")
            elif value > (limit := _MAX_LAYERS if name == "n_layers" else _MAX_SIZE):

                problems.append(f"{name} must be at most {limit:,}, got {value:,}")
        if not problems and self.hidden % self.n_heads != 0:
            problems.append(
                f"hidden={self.hidden} is not divisible by n_heads={self.n_heads} "
                f"(remainder {self.hidden % self.n_heads})"
            )
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if not _is_real(value) or not 0.0 <= value < 1.0:
                problems.append(f"{name} must be in [0, 1), got {value!r}")
        for name in ("layernorm_eps", "init_std"):
            value = getattr(self, name)
            if value is None and name == "init_std":
                continue  # left unresolved only because hidden is invalid (reported)
            if not _is_real(value) or not value > 0.0 or math.isinf(value):
                problems.append(f"{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.scaled_output_init, bool):
            problems.append(f"scaled_output_init must be a bool, got {self.scaled_output_init!r}")
        if self.gelu_approximate not in _GELU_APPROXIMATIONS:
            problems.append(
                f"gelu_approximate must be one of {_GELU_APPROXIMATIONS}, "
                f"got {self.gelu_approximate!r}"
            )
        for name, allowed in (("position", _POSITIONS), ("norm", _NORMS), ("mlp", _MLPS)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("bias", "tied_embeddings"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_real(self.rope_theta) or not self.rope_theta > 1.0:
            problems.append(f"rope_theta must be a number > 1, got {self.rope_theta!r}")
        kv = self.n_kv_heads
        if not _is_int(kv) or kv <= 0:
            problems.append(f"n_kv_heads must be a positive int, got {kv!r}")
        elif _is_int(self.n_heads) and self.n_heads > 0 and self.n_heads % kv:
            problems.append(f"n_heads={self.n_heads} is not divisible by n_kv_heads={kv}: "
                            "each key/value head must serve the same number of query heads")
        if (self.position == "rope" and not problems and self.head_dim % 2):
            problems.append(f"rope needs an even head width, got hidden {self.hidden} / "
                            f"n_heads {self.n_heads} = {self.head_dim}")
        return problems

    @property
    def architecture(self) -> str:
        """``"gpt2"`` for the GPT-2 / MT-NLG block (learned positions, LayerNorm, GeLU,
        multi-head attention with biases, tied head), else a description of what differs."""
        differs = [name for name, gpt2 in _GPT2_ARCHITECTURE.items()
                   if getattr(self, name) != gpt2]
        if self.n_kv_heads != self.n_heads:
            differs.append("n_kv_heads")
        return "gpt2" if not differs else "+".join(
            f"{name}={getattr(self, name)}" for name in differs)

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``hidden // n_heads``."""
        return self.hidden // self.n_heads

    def replace(self, **overrides: Any) -> GPTConfig:
        """Return a copy with ``overrides`` applied (validated again).

        When ``hidden`` changes, ``ffn_hidden`` and ``init_std`` that still hold their derived
        defaults (``4 * hidden``, ``sqrt(1/(3*hidden))``) are re-derived from the new width
        unless they are overridden explicitly, so ``preset("tiny").replace(hidden=128)`` is
        the model one expects; likewise ``n_kv_heads`` follows ``n_heads`` in a multi-head
        model.
        """
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise GPTConfigError(f"unknown GPTConfig fields {unknown}")
        if "n_heads" in overrides and "n_kv_heads" not in overrides and \
                self.n_kv_heads == self.n_heads:
            overrides["n_kv_heads"] = None  # multi-head stays multi-head
        if "hidden" in overrides and overrides["hidden"] != self.hidden:
            if "ffn_hidden" not in overrides and self.ffn_hidden == _default_ffn(self.hidden):
                overrides["ffn_hidden"] = None
            if "init_std" not in overrides and math.isclose(
                self.init_std, _default_init_std(self.hidden), rel_tol=1e-12
            ):
                overrides["init_std"] = None
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field (derived defaults resolved)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GPTConfig:
        """Inverse of :meth:`to_dict`; rejects unknown keys and reports missing ones."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise GPTConfigError(
                f"unknown GPTConfig keys {unknown}; valid keys are {sorted(fields)}"
            )
        required = [
            name
            for name, f in fields.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in data]
        if missing:
            raise GPTConfigError(f"GPTConfig dict is missing required keys {missing}")
        return cls(**dict(data))


_POSITIONS = ("learned", "rope")
_NORMS = ("layernorm", "rmsnorm")
_MLPS = ("gelu", "swiglu")
_GPT2_ARCHITECTURE = {"position": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True,
                      "tied_embeddings": True}

# GPT-2 BPE has 50257 tokens; Megatron pads it to a multiple of 1024 (128 * 8-way TP) -> 51200.
_GPT2_VOCAB = 50257
_GPT2_VOCAB_PADDED = 51200

_LLAMA3_VOCAB = 128256
_LLAMA: dict[str, Any] = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu",
                          "bias": False, "tied_embeddings": False, "layernorm_eps": 1e-5,
                          "init_std": 0.02}

PRESETS: Mapping[str, GPTConfig] = MappingProxyType(
    {
        # Test / demo model: a few hundred thousand parameters, runs in milliseconds on CPU.
        "tiny": GPTConfig(n_layers=4, hidden=64, n_heads=4, vocab_size=1000, seq_len=64),
        # OpenAI GPT-2 family (Radford et al. 2019).
        "gpt2-small": GPTConfig(12, 768, 12, _GPT2_VOCAB, 1024),
        "gpt2-medium": GPTConfig(24, 1024, 16, _GPT2_VOCAB, 1024),
        "gpt2-large": GPTConfig(36, 1280, 20, _GPT2_VOCAB, 1024),
        "gpt2-xl": GPTConfig(48, 1600, 25, _GPT2_VOCAB, 1024),
        # GPT-3 XL sized model (Brown et al. 2020), padded GPT-2 vocabulary.
        "1.3b": GPTConfig(24, 2048, 16, _GPT2_VOCAB_PADDED, 2048),
        # Megatron-LM's 8.3B model (Shoeybi et al. 2019).
        "8.3b": GPTConfig(72, 3072, 24, _GPT2_VOCAB_PADDED, 2048),
        # Megatron-Turing NLG 530B (Smith et al. 2022).
        "mt-nlg-530b": GPTConfig(105, 20480, 128, _GPT2_VOCAB_PADDED, 2048),
        # Llama-shaped (Touvron et al. 2023; Grattafiori et al. 2024): RoPE, RMSNorm, SwiGLU,
        # grouped-query attention, no biases. A test model on the 1k tokenizer...
        "llama-test": GPTConfig(4, 64, 4, 1000, 64, ffn_hidden=176, n_kv_heads=2, **_LLAMA),
        # ... and the published shapes of Llama 3.2 1B (tied head) and Llama 3.1 8B.
        "llama-3.2-1b": GPTConfig(16, 2048, 32, _LLAMA3_VOCAB, 8192, ffn_hidden=8192,
                                  n_kv_heads=8, **{**_LLAMA, "rope_theta": 500000.0,
                                                   "tied_embeddings": True}),
        "llama-3.1-8b": GPTConfig(32, 4096, 32, _LLAMA3_VOCAB, 8192, ffn_hidden=14336,
                                  n_kv_heads=8, **{**_LLAMA, "rope_theta": 500000.0}),
    }
)


def preset(name: str) -> GPTConfig:
    """Return the named preset config; raises :class:`GPTConfigError` listing valid names."""
    if name not in PRESETS:
        raise GPTConfigError(f"unknown GPT preset {name!r}; valid presets: {sorted(PRESETS)}")
    return PRESETS[name]
