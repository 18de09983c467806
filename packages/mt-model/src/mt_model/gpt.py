"""Plain single-device decoder: GPT-2 / MT-NLG by default (pre-LayerNorm, learned
positions, GeLU, tied embeddings), the Llama family's choices by config (RoPE, RMSNorm,
SwiGLU, grouped-query attention, no biases, untied head).

The module tree and its names are a contract: the tensor-parallel plan swaps modules by
name, pipeline stages call ``embed``, slices of ``blocks``, ``ln_f``, ``head`` and
``loss_fn`` separately, and checkpoint converters map state-dict keys. Multi-head attention
projects with one fused ``attn.qkv`` ([q; k; v]); grouped-query attention with ``attn.q``
and a fused ``attn.kv`` ([k; v]). The norms keep the names ``ln1``, ``ln2``, ``ln_f`` whatever
their kind. Nothing here knows about parallelism: every width that tensor parallelism may
slice (heads, MLP width) is read from the tensors at run time instead of from the config.

Activation: GeLU with ``approximate=config.gelu_approximate``; the default ``"none"`` is
the exact erf form (``F.gelu``'s default). Use ``"tanh"`` to match OpenAI GPT-2 weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mt_model.cache import KVCache, LayerCache
from mt_model.chunked_attention import chunked_causal_attention
from mt_model.config import GPTConfig
from mt_model.init import init_gpt_

__all__ = [
    "GPT",
    "Block",
    "Linear",
    "Embedding",
    "Attention",
    "CoreAttention",
    "MLP",
    "LMHead",
    "LMLoss",
    "apply_rope",
    "decoding_layout_",
    "linear",
    "make_norm",
    "PackedWeight",
    "rope_tables",
]

#: Rows (tokens) at most for which :func:`linear` multiplies the other way round.
FEW_ROWS = 64
#: Output features per product when :func:`linear` splits a large weight (the output head).
WEIGHT_BLOCK = 4096
#: The batch size oneDNN lays a packed weight out for (any number of rows runs on it).
PACK_ROWS = 16


class PackedWeight:
    """A float32 weight copied into oneDNN's blocked layout for its inner-product kernel
    (x86 CPU builds of torch), for :func:`linear` without autograd: GPT-2-small shape, 12
    layers' products and the output head per decoded token 2x faster than ``F.linear``
    (benchmarks/generate.py). It remembers the parameter it copies: :func:`linear` uses it
    for that parameter only, and packs again when the parameter was changed in place
    (its version counter) or given new storage, so it never serves stale weights."""

    __slots__ = ("source", "version", "ptr", "tensor")

    def __init__(self, source: torch.Tensor, tensor: torch.Tensor) -> None:
        self.source, self.tensor = source, tensor
        self.version, self.ptr = source._version, source.data_ptr()

    @staticmethod
    def of(weight: torch.Tensor) -> PackedWeight | None:
        """``weight`` packed, or None where this build of torch cannot (no oneDNN, not a
        float32 CPU tensor)."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 \
                or not torch.backends.mkldnn.is_available():
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                             PACK_ROWS)
        except (AttributeError, RuntimeError, NotImplementedError):
            return None
        return PackedWeight(weight, packed)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, source, bias)`` on the packed copy (packed again if stale)."""
        if self.source._version != self.version or self.source.data_ptr() != self.ptr:
            fresh = PackedWeight.of(self.source)
            if fresh is None:
                return F.linear(x, self.source, bias)
            self.tensor, self.version, self.ptr = fresh.tensor, fresh.version, fresh.ptr
        return torch.ops.mkldnn._linear_pointwise(x, self.tensor, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``. Without autograd on float32 CPU tensors (decoding,
    scoring) it runs on ``packed`` when that copies ``weight`` (:class:`PackedWeight`);
    without one, for a few rows (one token per request per step) it computes
    ``(weight @ x.T).T``, a large weight in blocks of :data:`WEIGHT_BLOCK` output features:
    the same products, in the orientation and pieces the CPU's GEMM serves faster when
    ``x`` is thin (GPT-2-small shape, 16 rows: 12 layers' matmuls 66 -> 44 ms, the output
    head 40 -> 21 ms)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    if packed is not None and packed.source is weight:
        return packed.apply(x, bias)
    rows = x.numel() // max(1, x.shape[-1])
    if rows > FEW_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1]).t()
    out = x.new_empty((weight.shape[0], rows))
    for start in range(0, weight.shape[0], WEIGHT_BLOCK):
        part = slice(start, start + WEIGHT_BLOCK)
        if bias is None:
            torch.mm(weight[part], flat, out=out[part])
        else:
            torch.addmm(bias[part].unsqueeze(1), weight[part], flat, out=out[part])
    return out.t().reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and names) computed by :func:`linear` (on
    ``packed``, set by :func:`decoding_layout_`, where there is one)."""

    packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


@torch.no_grad()
def decoding_layout_(model: nn.Module) -> nn.Module:
    """Lay ``model``'s projections and output head out for decoding on CPU: a
    :class:`PackedWeight` copy of each float32 weight where torch has oneDNN (it costs one
    more copy of those weights: GPT-2 small +490 MB; the parameters stay as they were, so
    training, checkpoint writers and state dicts see nothing of it); elsewhere each
    :class:`Linear` weight stored input-major ([in, out] in memory, the parameter keeps its
    [out, in] shape and values as a transposed view), the layout :func:`linear`'s thin
    products run fastest in (12 GPT-2-small layers, one token: 38 -> 29 ms). For a model
    that decodes or scores."""
    for module in model.modules():
        if isinstance(module, GPT):
            head = module.head
            head.packed = PackedWeight.of(head.weight if head.weight is not None
                                          else module.embed.tokens.weight)
        if not isinstance(module, Linear):
            continue
        module.packed = PackedWeight.of(module.weight)
        if module.packed is None and module.weight.is_contiguous():
            module.weight.data = module.weight.data.t().contiguous().t()
    return model


def make_norm(config: GPTConfig) -> nn.Module:
    """The block's normalisation: LayerNorm (with a bias when ``config.bias``) or RMSNorm."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.hidden, eps=config.layernorm_eps)
    return nn.LayerNorm(config.hidden, eps=config.layernorm_eps, bias=config.bias)


def rope_tables(seq: int, d: int, theta: float, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [s, d] of rotary position embedding as Llama computes them: frequencies
    ``theta^(-2i/d)`` and angles in float32, then cast."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device)
                               .float() / d)
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` [b, n, s, d] with :func:`rope_tables`' ``cos`` and
    ``sin``: the two halves of each head rotated (Llama's convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(rows, dim)``; on the meta device (shapes only) without its normal
    init, which torch runs there through its Python reference implementation: importing
    ``torch._dynamo`` the first time, about a second per process."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    return nn.Embedding(rows, dim)


class Embedding(nn.Module):
    """Token embedding (+ learned absolute positions), then dropout.

    Children: ``tokens`` (vocab_size x hidden, also the output projection when tied),
    ``positions`` (seq_len x hidden; only with learned positions), ``drop``.

    ``context`` (None: the tokens are a whole sequence) is a context-parallel slice, as the
    attention core takes it: without explicit ``positions`` the tokens are at
    ``context.positions(device)``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = _embedding(config.vocab_size, config.hidden)
        self.positions = _embedding(config.seq_len, config.hidden) \
            if config.position == "learned" else None
        self.max_seq = config.seq_len
        self.drop = nn.Dropout(config.dropout)
        self.context: Any = None

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``idx`` [b, s] token ids -> [b, s, hidden]; ``positions`` [b, s] (incremental
        decoding, :mod:`mt_model.cache`), else those of the context-parallel slice, else
        0 .. s - 1."""
        if positions is None and self.context is not None:
            positions = self.context.positions(idx.device)
        seq = idx.shape[-1]
        last = seq - 1 if positions is None else int(positions.max())
        if last >= self.max_seq:
            raise ValueError(f"sequence length {last + 1} exceeds the model's seq_len "
                             f"{self.max_seq}")
        x = self.tokens(idx)
        if self.positions is not None:
            x = x + self.positions(torch.arange(seq, device=idx.device) if positions is None
                                   else positions)
        return self.drop(x)


class CoreAttention(nn.Module):
    """Causal attention on already projected q [b, s, n * d] and k, v [b, s, m * d] (no
    parameters): RoPE on q and k when ``rope_theta`` is given; with m < n key/value heads
    (grouped-query) each serves n / m consecutive query heads. Head counts are derived from
    the widths, so a tensor-parallel rank holding n / tp and m / tp heads runs it unchanged.

    ``context`` (None: the whole sequence is here) is a context-parallel slice, e.g.
    mt-tensor-parallel's ``ContextParallel``: anything with ``positions(device)`` (this
    rank's tokens' positions in the sequence), ``runs`` (the same positions as [start, end)
    ranges, in order) and ``gather(x)`` (every rank's keys or values: the whole sequence's
    [b, s, ...], in position order). Keys and values are gathered, rotary embeddings take the
    positions, and each run of queries attends to the keys before it and causally to its own
    (:func:`mt_model.chunked_attention.chunked_causal_attention`: fused, no mask).
    """

    def __init__(self, head_dim: int, dropout: float = 0.0,
                 rope_theta: float | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.dropout = dropout
        self.rope_theta = rope_theta
        # Not buffers (meta-built models leave buffers uninitialized): a plain cache.
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.context: Any = None

    @property
    def selective_checkpoint(self) -> bool:
        """Whether selective recomputation (mt-pipeline) should run this module again in
        backward rather than keep what it saves: in training with attention dropout, where
        the math kernel keeps the scores, the probabilities and the mask ([b, n, s, s]
        each); otherwise a fused kernel keeps only its output and log-sum-exp."""
        return self.training and self.dropout > 0

    def _tables(self, seq: int, device: torch.device, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq, device, dtype)
        if key not in self._rope:
            self._rope[key] = rope_tables(seq, self.head_dim, self.rope_theta, device, dtype)
        return self._rope[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        """With ``cache`` the tokens are the next ones of a decoded batch: their keys and
        values join the cache and they attend to every cached position of their row."""
        batch, seq, width = q.shape
        for t in (q, k):
            if t.shape[-1] % self.head_dim:
                raise ValueError(f"attention width {t.shape[-1]} is not a multiple of "
                                 f"{self.head_dim}")
        heads, kv_heads = width // self.head_dim, k.shape[-1] // self.head_dim

        def split(t: torch.Tensor, n: int) -> torch.Tensor:  # [b, s, n*d] -> [b, n, s, d]
            return t.reshape(batch, seq, n, self.head_dim).transpose(1, 2)

        if self.context is not None and cache is None:
            return self._context_parallel(q, k, v, heads, kv_heads)
        q, k, v = split(q, heads), split(k, kv_heads), split(v, kv_heads)
        if cache is not None:
            return self._cached(q, k, v, cache).transpose(1, 2).reshape(batch, seq, width)
        if self.rope_theta is not None:
            cos, sin = self._tables(seq, q.device, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True,
            enable_gqa=kv_heads != heads)
        return out.transpose(1, 2).reshape(batch, seq, width)

    def _context_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          heads: int, kv_heads: int) -> torch.Tensor:
        """Attention of this rank's queries over the whole sequence's keys (``context``)."""
        ctx, (batch, seq, width) = self.context, q.shape
        k, v = ctx.gather(k), ctx.gather(v)  # [b, s, m * d], position order
        q = q.reshape(batch, seq, heads, self.head_dim).transpose(1, 2)
        k, v = (t.reshape(batch, t.shape[1], kv_heads, self.head_dim).transpose(1, 2)
                for t in (k, v))
        if self.rope_theta is not None:
            cos, sin = self._tables(k.shape[2], q.device, q.dtype)  # keys: every position
            mine = ctx.positions(q.device)
            q = apply_rope(q, cos[mine], sin[mine])
            k = apply_rope(k, cos, sin)
        out = chunked_causal_attention(q, k, v, ctx.runs,
                                       dropout=self.dropout if self.training else 0.0)
        return out.transpose(1, 2).reshape(batch, seq, width)

    def _cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: LayerCache) -> torch.Tensor:
        if self.rope_theta is not None:  # each row's own positions
            positions = cache.positions(q.shape[2], q.device)
            cos, sin = self._tables(cache.cache.capacity, q.device, q.dtype)
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values, mask = cache.extend(k, v)
        if mask is None and keys.shape[1] == q.shape[1]:
            # One new token per row, no padding: two batched products read the cache's slots
            # in place (SDPA's kernel is slower on them).
            scores = torch.matmul(q, keys.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
            return torch.matmul(torch.softmax(scores, dim=-1), values)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                              enable_gqa=keys.shape[1] != q.shape[1])

    def extra_repr(self) -> str:
        rope = f", rope_theta={self.rope_theta}" if self.rope_theta is not None else ""
        return f"head_dim={self.head_dim}, dropout={self.dropout}{rope}"


class Attention(nn.Module):
    """Self-attention: multi-head projects with ``qkv`` ([q; k; v], each block
    heads-contiguous); grouped-query with ``q`` and ``kv`` ([k; v]); then ``core`` attention
    and the ``proj`` output projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, kv_width = config.head_dim, config.n_kv_heads * config.head_dim
        if config.n_kv_heads == config.n_heads:
            self.qkv = Linear(config.hidden, 3 * config.hidden, bias=config.bias)
        else:
            self.q = Linear(config.hidden, config.hidden, bias=config.bias)
            self.kv = Linear(config.hidden, 2 * kv_width, bias=config.bias)
        self.core = CoreAttention(d, config.attention_dropout,
                                  config.rope_theta if config.position == "rope" else None)
        self.proj = Linear(config.hidden, config.hidden, bias=config.bias)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        # chunk (not a config width) so TP-sliced projections giving [q_l; k_l; v_l] or
        # [k_l; v_l] still work.
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            q, (k, v) = self.q(x), self.kv(x).chunk(2, dim=-1)
        return self.proj(self.core(q, k, v, cache))


class MLP(nn.Module):
    """``fc`` (hidden -> ffn), GeLU, ``proj`` (ffn -> hidden); with SwiGLU ``fc`` gives
    [gate; up] (hidden -> 2 ffn) and the activation is ``silu(gate) * up``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        width = 2 * config.ffn_hidden if self.swiglu else config.ffn_hidden
        self.fc = Linear(config.hidden, width, bias=config.bias)
        self.act = nn.SiLU() if self.swiglu else nn.GELU(approximate=config.gelu_approximate)
        self.proj = Linear(config.ffn_hidden, config.hidden, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.fc(x).chunk(2, dim=-1)
            return self.proj(self.act(gate) * up)
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + drop1(attn(ln1(x)))``, then
    ``x + drop2(mlp(ln2(x)))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = make_norm(config)
        self.attn = Attention(config)
        self.drop1 = nn.Dropout(config.dropout)
        self.ln2 = make_norm(config)
        self.mlp = MLP(config)
        self.drop2 = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        """[b, s, hidden] -> [b, s, hidden] (``cache``: this layer's part of a decoded
        batch's key/value cache)."""
        x = x + self.drop1(self.attn(self.ln1(x), cache))
        return x + self.drop2(self.mlp(self.ln2(x)))


class LMHead(nn.Module):
    """Output projection. Tied (default): the weight is the token embedding, owned
    elsewhere and passed to ``forward``, so the tied matrix is one parameter and a
    pipeline's last stage (or a vocab-parallel replacement) can pass whichever copy it
    holds. Untied (``vocab_size`` and ``hidden`` given): its own ``weight``."""

    def __init__(self, vocab_size: int | None = None, hidden: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden)) \
            if vocab_size is not None and hidden is not None else None
        self.packed: PackedWeight | None = None  # decoding_layout_'s copy of the weight

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """[b, s, hidden] x [vocab, hidden] -> logits [b, s, vocab]."""
        return linear(hidden, self.weight if weight is None else weight, packed=self.packed)


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
    """Decoder-only GPT: ``embed`` -> ``blocks`` -> ``ln_f`` -> ``head`` [-> ``loss_fn``].

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
        self.ln_f = make_norm(config)
        self.head = LMHead() if config.tied_embeddings else LMHead(config.vocab_size,
                                                                    config.hidden)
        self.loss_fn = LMLoss()
        if seed is not None and not any(p.is_meta for p in self.parameters()):
            init_gpt_(self, seed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                cache: KVCache | None = None, last: bool = False) -> torch.Tensor:
        """``idx`` [b, s] -> logits [b, s, vocab], or the mean loss if ``targets`` is given.
        With ``cache`` (incremental decoding) ``idx`` holds the batch's next tokens: they
        attend to the cached ones and join the cache. ``last``: the logits of the last
        position only ([b, 1, vocab]: a prefill needs no more)."""
        if cache is None:
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x)
        else:
            x = self.embed(idx, cache.positions(idx.shape[1], idx.device))
            for i, block in enumerate(self.blocks):
                x = block(x, cache.layer(i))
            cache.advance(idx.shape[1])
        tied = self.embed.tokens.weight if self.config.tied_embeddings else None
        logits = self.head(self.ln_f(x[:, -1:] if last else x), tied)
        if targets is None:
            return logits
        return self.loss_fn(logits, targets)
