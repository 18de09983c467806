"""A Llama 3 forward written the way Meta's reference and torchtitan write it (complex-number
RoPE over adjacent pairs of a head), on torchtitan's tensor names: shares no code with mt's
rotate-half RoPE, so formats that store q / k in the pair order (torchtitan DCP, GGUF) are
checked against it, not against mt's own permutation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mt_model import GPTConfig

__all__ = ["titan_logits", "titan_state"]


def titan_logits(sd: dict[str, torch.Tensor], tokens: torch.Tensor, config: GPTConfig,
                  prefix: str = "", legacy: bool = False) -> torch.Tensor:
    """A Llama 3 forward as Meta's reference and torchtitan write it, on torchtitan names."""
    wq = "attention.wq.weight" if legacy else "attention.qkv_linear.wq.weight"
    heads, kv, eps = config.n_heads, config.n_kv_heads, config.layernorm_eps
    h = sd[prefix + "tok_embeddings.weight"][tokens]
    batch, seq, dim = h.shape
    head_dim = dim // heads
    freqs = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    cis = torch.polar(torch.ones_like(angles), angles)

    def rope(x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * cis[None, :, None, :]).flatten(3)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    for layer in range(config.n_layers):
        p = f"{prefix}layers.{layer}."
        x = norm(h, sd[p + "attention_norm.weight"])
        q = (x @ sd[p + wq].T).view(batch, seq, heads, head_dim)
        k = (x @ sd[p + wq.replace("wq", "wk")].T).view(batch, seq, kv, head_dim)
        v = (x @ sd[p + wq.replace("wq", "wv")].T).view(batch, seq, kv, head_dim)
        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(heads // kv, dim=2) for t in (k, v))
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        h = h + att.transpose(1, 2).reshape(batch, seq, dim) @ sd[p + "attention.wo.weight"].T
        x = norm(h, sd[p + "ffn_norm.weight"])
        gate, up = x @ sd[p + "feed_forward.w1.weight"].T, x @ sd[p + "feed_forward.w3.weight"].T
        h = h + (F.silu(gate) * up) @ sd[p + "feed_forward.w2.weight"].T
    head = sd[prefix + ("output.weight" if legacy else "lm_head.weight")]
    return norm(h, sd[prefix + "norm.weight"]) @ head.T


def titan_state(config: GPTConfig, prefix: str = "", legacy: bool = False,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """Random torchtitan-named Llama weights (norm weights away from 1, so they count)."""
    gen = torch.Generator().manual_seed(seed)
    dim, ffn, kv = config.hidden, config.ffn_hidden, config.n_kv_heads * config.head_dim
    qkv = "attention." if legacy else "attention.qkv_linear."
    shapes = {"tok_embeddings.weight": (config.vocab_size, dim), "norm.weight": (dim,),
              ("output.weight" if legacy else "lm_head.weight"): (config.vocab_size, dim)}
    for layer in range(config.n_layers):
        p = f"layers.{layer}."
        shapes.update({p + qkv + "wq.weight": (dim, dim), p + qkv + "wk.weight": (kv, dim),
                       p + qkv + "wv.weight": (kv, dim), p + "attention.wo.weight": (dim, dim),
                       p + "feed_forward.w1.weight": (ffn, dim),
                       p + "feed_forward.w3.weight": (ffn, dim),
                       p + "feed_forward.w2.weight": (dim, ffn),
                       p + "attention_norm.weight": (dim,), p + "ffn_norm.weight": (dim,)})
    return {prefix + key: (1 + 0.1 * torch.randn(shape, generator=gen)) if len(shape) == 1
            else 0.1 * torch.randn(shape, generator=gen) for key, shape in shapes.items()}
