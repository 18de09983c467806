"""Pure slicing maths: which part of a full tensor a tensor-parallel rank holds, and back.

Nothing here communicates. Layers build their shards with :func:`shard_tensor`, and
checkpoint conversion between TP degrees reuses :func:`shard_tensor` / :func:`merge_shards`,
so "the weights of the sliced model are exactly slices of the unsliced one" is one function.

Parameter styles (how one tensor is cut):

- ``"replicate"``: every rank holds the full tensor.
- ``"column"``: split dim 0 (output features of a Linear weight, or its bias).
- ``"column_qkv"``: dim 0 holds ``chunks`` fused blocks ([q; k; v]); each block is split
  into ``tp`` contiguous pieces and a rank holds [q_r; k_r; v_r].
- ``"column_pair"``: the same with two fused blocks ([k; v] of grouped-query attention,
  [gate; up] of SwiGLU): a rank holds [k_r; v_r].
- ``"row"``: split the last dim (input features of a Linear weight).
- ``"vocab"``: pad dim 0 with zero rows to :func:`padded_vocab_size`, then split dim 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "PARAM_STYLES",
    "DEFAULT_PAD_MULTIPLE",
    "check_divisibility",
    "padded_vocab_size",
    "vocab_range",
    "shard_tensor",
    "merge_shards",
]

PARAM_STYLES: tuple[str, ...] = ("replicate", "column", "column_qkv", "column_pair", "row",
                                 "vocab")
_FUSED = {"column_qkv": 3, "column_pair": 2}
DEFAULT_PAD_MULTIPLE = 128


def check_divisibility(*, tp: int, n_heads: int, hidden: int, ffn_hidden: int | None = None,
                       seq_len: int | None = None, sequence_parallel: bool = False,
                       n_kv_heads: int | None = None) -> None:
    """Raise ValueError naming the numbers when a GPT shape cannot be sliced ``tp`` ways.

    Meant to run before any process group exists. Heads (hence the qkv and attention
    output widths), the MLP width and, with sequence parallelism, the sequence length must
    divide by ``tp``; grouped-query key/value heads must divide by ``tp`` or divide it. All
    problems are reported at once.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    problems: list[str] = []
    if n_heads % tp != 0:
        problems.append(f"n_heads {n_heads} is not divisible by tp {tp}")
    if hidden % tp != 0:
        problems.append(f"hidden {hidden} is not divisible by tp {tp}")
    if ffn_hidden is not None and ffn_hidden % tp != 0:
        problems.append(f"ffn_hidden {ffn_hidden} is not divisible by tp {tp}")
    if n_kv_heads is not None and n_kv_heads % tp and tp % n_kv_heads:
        problems.append(f"n_kv_heads {n_kv_heads} and tp {tp}: key/value heads are split over "
                        "TP when tp divides them and replicated when they divide tp; neither "
                        "holds")
    if sequence_parallel and seq_len is not None and seq_len % tp != 0:
        problems.append(
            f"seq_len {seq_len} is not divisible by tp {tp} (needed by sequence parallelism)"
        )
    if problems:
        raise ValueError("cannot apply tensor parallelism: " + "; ".join(problems))


def padded_vocab_size(vocab_size: int, tp_size: int,
                      pad_multiple: int = DEFAULT_PAD_MULTIPLE) -> int:
    """Smallest multiple of ``pad_multiple * tp_size`` that is >= ``vocab_size``.

    The MT-NLG GPT-2 vocabulary 50257 with 8-way TP and 128 gives 51200.
    """
    if vocab_size < 1 or tp_size < 1 or pad_multiple < 1:
        raise ValueError(
            f"vocab_size {vocab_size}, tp_size {tp_size} and pad_multiple {pad_multiple} "
            "must all be >= 1"
        )
    unit = pad_multiple * tp_size
    return -(-vocab_size // unit) * unit


def vocab_range(padded_vocab: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the padded vocabulary rows owned by ``tp_rank``."""
    _check_rank(tp_rank, tp_size)
    if padded_vocab % tp_size != 0:
        raise ValueError(f"padded vocab {padded_vocab} is not divisible by tp {tp_size}")
    per_rank = padded_vocab // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def _check_rank(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not in [0, tp_size {tp_size})")


def _split(tensor: torch.Tensor, dim: int, tp_rank: int, tp_size: int, what: str
           ) -> torch.Tensor:
    if tensor.shape[dim] % tp_size != 0:
        raise ValueError(
            f"{what}: dimension {dim} of size {tensor.shape[dim]} of a tensor of shape "
            f"{tuple(tensor.shape)} is not divisible by tp {tp_size}"
        )
    piece = tensor.shape[dim] // tp_size
    return _own(tensor.narrow(dim, tp_rank * piece, piece))


def _own(view: torch.Tensor) -> torch.Tensor:
    """A copy of ``view`` with its own storage (a shard must not keep the full tensor's
    alive); on the meta device a new tensor of its shape, since torch clones a strided meta
    tensor through its Python reference, which imports sympy."""
    return view.new_empty(view.shape) if view.is_meta else view.clone()


def shard_tensor(style: str, tensor: torch.Tensor, tp_rank: int, tp_size: int, *,
                 chunks: int = 3, pad_multiple: int = DEFAULT_PAD_MULTIPLE) -> torch.Tensor:
    """The part of the full ``tensor`` that rank ``tp_rank`` of ``tp_size`` holds.

    ``chunks`` is the number of fused blocks for ``"column_qkv"``; ``pad_multiple`` the
    vocabulary padding unit for ``"vocab"``. Works on any device, including meta.
    """
    _check_rank(tp_rank, tp_size)
    if style == "replicate":
        return _own(tensor)
    if style == "column":
        return _split(tensor, 0, tp_rank, tp_size, "column")
    if style in _FUSED:
        chunks = _FUSED[style] if style == "column_pair" else chunks
        if tensor.shape[0] % chunks != 0:
            raise ValueError(
                f"{style}: dimension 0 of size {tensor.shape[0]} is not divisible by "
                f"chunks {chunks}"
            )
        blocks = tensor.reshape(chunks, tensor.shape[0] // chunks, *tensor.shape[1:])
        local = _split(blocks, 1, tp_rank, tp_size, f"{style} block")
        return local.reshape(-1, *tensor.shape[1:])
    if style == "row":
        return _split(tensor, tensor.dim() - 1, tp_rank, tp_size, "row")
    if style == "vocab":
        padded = padded_vocab_size(tensor.shape[0], tp_size, pad_multiple)
        start, end = vocab_range(padded, tp_rank, tp_size)
        shard = tensor.new_zeros((end - start, *tensor.shape[1:]))
        real_end = min(end, tensor.shape[0])
        if real_end > start:
            shard[: real_end - start] = tensor[start:real_end]
        return shard
    raise ValueError(f"unknown parameter style {style!r}; known styles: {PARAM_STYLES}")


def merge_shards(style: str, shards: Sequence[torch.Tensor], *, chunks: int = 3,
                 vocab_size: int | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: rebuild the full tensor from every rank's shard
    (index = tp rank). ``"replicate"`` returns rank 0's copy; ``"vocab"`` drops the padding
    rows when ``vocab_size`` is given."""
    if not shards:
        raise ValueError("merge_shards needs at least one shard")
    if style == "replicate":
        return shards[0].clone()
    if style == "column":
        return torch.cat(list(shards), dim=0)
    if style in _FUSED:
        chunks = _FUSED[style] if style == "column_pair" else chunks
        blocks = [s.reshape(chunks, s.shape[0] // chunks, *s.shape[1:]) for s in shards]
        merged = torch.cat(blocks, dim=1)
        return merged.reshape(-1, *shards[0].shape[1:])
    if style == "row":
        return torch.cat(list(shards), dim=shards[0].dim() - 1)
    if style == "vocab":
        full = torch.cat(list(shards), dim=0)
        return full if vocab_size is None else full[:vocab_size].clone()
    raise ValueError(f"unknown parameter style {style!r}; known styles: {PARAM_STYLES}")
