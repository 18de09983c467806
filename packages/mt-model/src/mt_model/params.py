"""Analytic parameter counts and model FLOPs (for planning, throughput and MFU).

Everything here is closed-form arithmetic on a :class:`GPTConfig`; nothing builds a model,
so it works for 530B-parameter configs on a laptop.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from mt_model.config import GPTConfig

#: The token embedding, also the output projection (tied): the first and the last pipeline
#: stage each hold it.
TIED_WEIGHT = "embed.tokens.weight"

__all__ = [
    "TIED_WEIGHT",
    "count_parameters",
    "block_matmul_parameters",
    "count_block_parameters",
    "gradient_free_slices",
    "parameter_stages",
    "model_flops_per_iteration",
    "model_flops_per_token_training",
    "tflops_per_gpu",
]


def count_block_parameters(config: GPTConfig) -> int:
    """Parameters of one transformer block: attention projections (q, k, v, output), MLP
    (fc, proj; SwiGLU's fc is twice as wide) and two norms, with biases when
    ``config.bias``: ``4h^2 + 2hf + 9h + f`` for the GPT-2 block (``12h^2 + 13h`` at f = 4h)."""
    h, f, b = config.hidden, config.ffn_hidden, int(config.bias)
    kv = config.n_kv_heads * config.head_dim
    attention = (h * (h + 2 * kv) + b * (h + 2 * kv)) + (h * h + b * h)
    fc = 2 * f if config.mlp == "swiglu" else f
    mlp = (h * fc + b * fc) + (f * h + b * h)
    norms = 2 * _norm_parameters(config)
    return attention + mlp + norms


def block_matmul_parameters(config: GPTConfig) -> int:
    """Weights of one block's matmuls (q, k, v, output projection, fc, proj; no biases or
    norms): ``12h^2`` for the GPT-2 block at f = 4h. Forward FLOPs per token are twice this."""
    h, f = config.hidden, config.ffn_hidden
    kv = config.n_kv_heads * config.head_dim
    fc = 2 * f if config.mlp == "swiglu" else f
    return h * (h + 2 * kv) + h * h + h * fc + f * h


def _norm_parameters(config: GPTConfig) -> int:
    return config.hidden * (2 if config.norm == "layernorm" and config.bias else 1)


def count_parameters(config: GPTConfig) -> int:
    """Total parameters of :class:`mt_model.GPT` for ``config``: a tied output projection is
    the token embedding (counted once), an untied one adds ``vocab x hidden``."""
    h = config.hidden
    embeddings = config.vocab_size * h + (config.seq_len * h if config.position == "learned"
                                          else 0)
    head = 0 if config.tied_embeddings else config.vocab_size * h
    return (embeddings + config.n_layers * count_block_parameters(config)
            + _norm_parameters(config) + head)


def model_flops_per_iteration(
    config: GPTConfig, global_batch: int, seq_len: int | None = None
) -> float:
    """Model FLOPs of one training iteration with full activation recomputation.

    ``F = 96 * B * s * l * h^2 * (1 + s / (6h) + V / (16 * l * h))`` (Narayanan et al. 2021,
    "Efficient large-scale language model training on GPU clusters", eq. 3): forward,
    backward (2x forward) and one recomputed forward of every matmul, for ffn_hidden = 4h
    and multi-head attention; other widths, grouped-query attention and SwiGLU count their
    own matmuls (:func:`block_matmul_parameters`). This is the number MT-NLG used to report
    126/121/113 TFLOP/s per GPU.
    ``seq_len`` defaults to ``config.seq_len``.
    """
    if global_batch <= 0:
        raise ValueError(f"global_batch must be positive, got {global_batch}")
    s = config.seq_len if seq_len is None else seq_len
    if s <= 0:
        raise ValueError(f"seq_len must be positive, got {s}")
    layers, h, vocab = config.n_layers, config.hidden, config.vocab_size
    # Forward, backward (2x) and recomputation of each block's matmuls (2 FLOPs per weight
    # and token) and attention (4sh per token), plus the head's forward and backward: with
    # f = 4h and multi-head attention this is the paper's formula.
    block = 2.0 * block_matmul_parameters(config) + 4.0 * s * h
    return global_batch * s * (4.0 * layers * block + 6.0 * h * vocab)


def model_flops_per_token_training(config: GPTConfig) -> float:
    """Training FLOPs per token without recomputation, for MFU: ``6N + 12 * l * h * s``.

    ``6N`` covers forward + backward of every weight matmul (N = :func:`count_parameters`,
    tied embedding once, since the head matmul is the one using it; an untied model's input
    embedding, a lookup, is left out); ``12 * l * h * s`` is
    the attention score and value matmuls (PaLM, Chowdhery et al. 2022, appendix B).
    """
    n = count_parameters(config)
    if not config.tied_embeddings:  # the input embedding is a lookup, not a matmul
        n -= config.vocab_size * config.hidden
    return 6.0 * n + 12.0 * config.n_layers * config.hidden * config.seq_len


def tflops_per_gpu(
    config: GPTConfig,
    global_batch: int,
    iteration_seconds: float,
    n_gpus: int,
    seq_len: int | None = None,
) -> float:
    """Achieved model TFLOP/s per GPU, using :func:`model_flops_per_iteration`."""
    if iteration_seconds <= 0 or n_gpus <= 0:
        raise ValueError(
            f"iteration_seconds={iteration_seconds} and n_gpus={n_gpus} must be positive"
        )
    flops = model_flops_per_iteration(config, global_batch, seq_len)
    return flops / (iteration_seconds * n_gpus) / 1e12


def gradient_free_slices(config: GPTConfig) -> dict[str, slice]:
    """Parameter elements whose gradient is exactly zero in exact arithmetic, by name.

    The key bias of each attention: it adds ``q . b_k`` to every score of a query alike, and
    softmax ignores a constant per row. In floating point its gradient is round-off noise
    (about 1e-10 here), which Adam's normalisation turns into updates of up to ``lr`` per
    step; so these elements drift by noise in any run, and comparisons of two runs (layouts,
    engines) must leave them out. They sit in the middle third of ``attn.qkv.bias`` ([q; k; v]).
    """
    if not config.bias:
        return {}
    h, kv = config.hidden, config.n_kv_heads * config.head_dim
    if config.n_kv_heads != config.n_heads:  # [k; v] of attn.kv
        return {f"blocks.{i}.attn.kv.bias": slice(0, kv) for i in range(config.n_layers)}
    return {f"blocks.{i}.attn.qkv.bias": slice(h, 2 * h) for i in range(config.n_layers)}


def parameter_stages(name: str, stage_layers: Sequence[Collection[int]],
                     tied: bool = True) -> list[int]:
    """The pipeline stages holding GPT parameter ``name``, given each stage's block indices
    (in stage order; interleaved stages hold several ranges): a block's parameters live with
    their block, the embedding on the first stage, the final norm and an untied head on the
    last, and the tied token embedding (``tied``) on both."""
    last = len(stage_layers) - 1
    if name.startswith("blocks."):
        layer = int(name.split(".")[1])
        return [s for s, layers in enumerate(stage_layers) if layer in layers]
    if name == TIED_WEIGHT and tied:
        return sorted({0, last})
    if name.startswith("embed."):
        return [0]
    return [last]  # ln_f and anything after the blocks
