"""Plain single-device GPT (pre-LayerNorm, learned positions, GeLU, tied embeddings).

The module tree and its names are a contract: the tensor-parallel plan swaps modules by
name, pipeline stages call ``embed``, slices of ``blocks``, ``ln_f``, ``head`` and
``loss_fn`` separately, and checkpoint converters map state-dict keys. Nothing here knows
about parallelism: every width that tensor parallelism may slice (attention heads) is read
from the tensors at run time instead of from the config.

Activation: GeLU with ``approximate=config.gelu_approximate``; the default ``"none"`` is
the exact erf form (``F.gelu``'s default). Use ``"tanh"`` to match OpenAI GPT-2 weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mt_model.config import GPTConfig
from mt_model.init import init_gpt_

__all__ = [
    "GPT",
    "Block",
    "Embedding",
    "Attention",
    "CoreAttention",
    "MLP",
    "LMHead",
    "LMLoss",
]


class Embedding(nn.Module):
    """Token + learned absolute position embedding, then dropout.

    Children: ``tokens`` (vocab_size x hidden, also the output projection), ``positions``
    (seq_len x hidden), ``drop``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.hidden)
        self.positions = nn.Embedding(config.seq_len, config.hidden)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx`` [b, s] token ids -> [b, s, hidden]."""
        seq = idx.shape[-1]
        max_seq = self.positions.num_embeddings
        if seq > max_seq:
            raise ValueError(f"sequence length {seq} exceeds the model's seq_len {max_seq}")
        positions = torch.arange(seq, device=idx.device)
        return self.drop(self.tokens(idx) + self.positions(positions))


class CoreAttention(nn.Module):
    """Causal multi-head attention on already projected q, k, v (no parameters).

    Takes q, k, v of shape [b, s, n * head_dim] and returns [b, s, n * head_dim]. The head
    count n is derived from the width, so a tensor-parallel rank holding n / tp heads runs
    this module unchanged.
    """

    def __init__(self, head_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, seq, width = q.shape
        if width % self.head_dim != 0:
            raise ValueError(f"attention width {width} is not a multiple of {self.head_dim}")
        heads = width // self.head_dim

        def split(t: torch.Tensor) -> torch.Tensor:  # [b, s, n*d] -> [b, n, s, d]
            return t.reshape(batch, seq, heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            split(q),
            split(k),
            split(v),
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
        )
        return out.transpose(1, 2).reshape(batch, seq, width)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, dropout={self.dropout}"


class Attention(nn.Module):
    """Self-attention: ``qkv`` projection ([q; k; v], each block heads-contiguous),
    ``core`` attention, ``proj`` output projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.core = CoreAttention(config.head_dim, config.attention_dropout)
        self.proj = nn.Linear(config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # chunk (not a config width) so a TP-sliced qkv giving [q_l; k_l; v_l] still works.
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(self.core(q, k, v))


class MLP(nn.Module):
    """``fc`` (hidden -> ffn), GeLU, ``proj`` (ffn -> hidden)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden, config.ffn_hidden)
        self.act = nn.GELU(approximate=config.gelu_approximate)
        self.proj = nn.Linear(config.ffn_hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + drop1(attn(ln1(x)))``, then
    ``x + drop2(mlp(ln2(x)))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden, eps=config.layernorm_eps)
        self.attn = Attention(config)
        self.drop1 = nn.Dropout(config.dropout)
        self.ln2 = nn.LayerNorm(config.hidden, eps=config.layernorm_eps)
        self.mlp = MLP(config)
        self.drop2 = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, hidden] -> [b, s, hidden]."""
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class LMHead(nn.Module):
    """Output projection with an externally owned weight (tied to ``embed.tokens``).

    It owns no parameter, so the tied matrix is one parameter and a pipeline's last stage
    (or a vocab-parallel replacement) can pass whichever copy it holds.
    """

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[b, s, hidden] x [vocab, hidden] -> logits [b, s, vocab]."""
        return F.linear(hidden, weight)


class LMLoss(nn.Module):
    """Mean token cross entropy; logits are upcast to float32 first (bf16 safety).

    Targets equal to ``ignore_index`` (default -100) do not count, as in
    ``F.cross_entropy``.
    """

    def __init__(self, ignore_index: int = -100) -> None:
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """logits [b, s, vocab], targets [b, s] -> scalar float32 loss."""
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            targets.reshape(-1),
            ignore_index=self.ignore_index,
        )


class GPT(nn.Module):
    """Decoder-only GPT: ``embed`` -> ``blocks`` -> ``ln_f`` -> ``head`` (tied) [-> ``loss_fn``].

    ``seed`` (default 0) applies :func:`mt_model.init_gpt_` after construction, so
    ``GPT(config)`` is deterministic and independent of torch's global RNG. The init is
    skipped when ``seed`` is None (e.g. weights will be loaded) or when the model is built
    on the meta device (materialise with ``to_empty`` and call ``init_gpt_`` yourself).
    """

    def __init__(self, config: GPTConfig, seed: int | None = 0) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.hidden, eps=config.layernorm_eps)
        self.head = LMHead()
        self.loss_fn = LMLoss()
        if seed is not None and not any(p.is_meta for p in self.parameters()):
            init_gpt_(self, seed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx`` [b, s] -> logits [b, s, vocab], or the mean loss if ``targets`` is given."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x), self.embed.tokens.weight)
        if targets is None:
            return logits
        return self.loss_fn(logits, targets)
