"""Plan-driven tensor parallelism: a plan is data, ``{module-name pattern: style}``.

:func:`apply_tensor_parallel` walks a plain single-device model, matches every module name
against the plan and replaces the module in place by its parallel version built from the
original weights (exact slices; a meta model gives meta shards). Patterns are matched
segment by segment with shell wildcards: ``"blocks.*.attn.qkv"`` matches
``blocks.0.attn.qkv`` but not ``blocks.0.x.attn.qkv``.

Module styles:

======================== ===============================================================
``column``               nn.Linear -> :class:`ColumnParallelLinear`
``column_qkv``           fused [q; k; v] nn.Linear -> ColumnParallelLinear(fused_chunks=3)
``column_pair``          fused [k; v] or [gate; up] nn.Linear -> ColumnParallelLinear(2)
``kv_replicated``        [k; v] with fewer heads than tp -> :class:`ReplicatedKVLinear`
``row``                  nn.Linear -> :class:`RowParallelLinear`
``vocab_embedding``      nn.Embedding -> :class:`VocabParallelEmbedding`
``gpt_embedding``        tokens + positions + drop -> :class:`ParallelTokenPositionEmbedding`
``vocab_head``           head (tied, or with its own weight) -> :class:`VocabParallelHead`
``vocab_cross_entropy``  loss ``forward(logits, targets)`` -> :class:`VocabParallelCrossEntropy`
``norm``                 LayerNorm / RMSNorm: kept (replicated input), or sequence-parallel
``sequence_dropout``     dropout between blocks: kept, or in the TP RNG stream with SP
``tp_rng``               any module whose activations are sharded: run in the TP RNG stream
======================== ===============================================================
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn
from torch.distributed import ProcessGroup

from mt_dist.collectives import group_rank, group_size
from mt_tensor_parallel.embedding import ParallelTokenPositionEmbedding
from mt_tensor_parallel.layers import ColumnParallelLinear, ReplicatedKVLinear, RowParallelLinear
from mt_tensor_parallel.rng import RNGTracker
from mt_tensor_parallel.sequence import (
    RNGRegion,
    SequenceParallelLayerNorm,
    SequenceParallelRMSNorm,
)
from mt_tensor_parallel.sharding import (
    DEFAULT_PAD_MULTIPLE,
    check_divisibility,
    merge_shards,
    shard_tensor,
)
from mt_tensor_parallel.vocab import (
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    VocabParallelHead,
)

__all__ = [
    "GPT_PLAN",
    "MODULE_STYLES",
    "TPContext",
    "apply_tensor_parallel",
    "decoder_plan",
    "match_plan",
    "merge_state_dicts",
    "param_styles",
    "shard_state_dict",
]

GPT_PLAN: Mapping[str, str] = MappingProxyType({
    "embed": "gpt_embedding",
    "blocks.*.ln1": "norm",
    "blocks.*.attn.qkv": "column_qkv",
    "blocks.*.attn.core": "tp_rng",
    "blocks.*.attn.proj": "row",
    "blocks.*.drop1": "sequence_dropout",
    "blocks.*.ln2": "norm",
    "blocks.*.mlp.fc": "column",
    "blocks.*.mlp.proj": "row",
    "blocks.*.drop2": "sequence_dropout",
    "ln_f": "norm",
    "head": "vocab_head",
    "loss_fn": "vocab_cross_entropy",
})
"""The tensor-parallel plan of ``mt_model.GPT``'s GPT-2 block (module names are mt_model's
contract); :func:`decoder_plan` gives the plan of any of its architectures."""


def decoder_plan(config: object, tp: int) -> Mapping[str, str]:
    """The plan of an ``mt_model.GPT`` of ``config`` (duck-typed: ``n_heads``,
    ``n_kv_heads``, ``mlp``) at TP degree ``tp``: the GPT-2 plan, with grouped-query
    attention's ``attn.q`` column-parallel and ``attn.kv`` split by heads when ``tp`` divides
    the key/value heads, else replicated (``kv_replicated``), and SwiGLU's fused [gate; up]
    split as a pair. Norms (LayerNorm or RMSNorm), the embedding (with or without a position
    table) and the head (tied or not) take the GPT-2 styles."""
    plan = dict(GPT_PLAN)
    heads = getattr(config, "n_heads", None)
    kv = getattr(config, "n_kv_heads", None) or heads
    if kv != heads:
        del plan["blocks.*.attn.qkv"]
        plan["blocks.*.attn.q"] = "column"
        plan["blocks.*.attn.kv"] = "column_pair" if kv % tp == 0 else "kv_replicated"
    if getattr(config, "mlp", "gelu") == "swiglu":
        plan["blocks.*.mlp.fc"] = "column_pair"
    return MappingProxyType(plan)


@dataclass(frozen=True)
class TPContext:
    """What a style builder needs besides the module it replaces."""

    group: ProcessGroup | None
    tp_rank: int
    tp_size: int
    sequence_parallel: bool
    tracker: RNGTracker
    vocab_size: int | None
    pad_multiple: int
    kv_heads: int | None = None


def _linear(module: nn.Module, style: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"style {style!r} needs an nn.Linear, got {type(module).__name__}")
    return module


def _column(module: nn.Module, ctx: TPContext) -> nn.Module:
    return ColumnParallelLinear.from_linear(_linear(module, "column"), ctx.group,
                                            sequence_parallel=ctx.sequence_parallel)


def _column_qkv(module: nn.Module, ctx: TPContext) -> nn.Module:
    return ColumnParallelLinear.from_linear(_linear(module, "column_qkv"), ctx.group,
                                            fused_chunks=3,
                                            sequence_parallel=ctx.sequence_parallel)


def _column_pair(module: nn.Module, ctx: TPContext) -> nn.Module:
    return ColumnParallelLinear.from_linear(_linear(module, "column_pair"), ctx.group,
                                            fused_chunks=2,
                                            sequence_parallel=ctx.sequence_parallel)


def _kv_replicated(module: nn.Module, ctx: TPContext) -> nn.Module:
    if ctx.kv_heads is None:
        raise ValueError("style 'kv_replicated' needs the key/value head count: give the "
                         "model a config with n_kv_heads")
    return ReplicatedKVLinear(_linear(module, "kv_replicated"), ctx.group, ctx.kv_heads,
                              ctx.sequence_parallel)


def _row(module: nn.Module, ctx: TPContext) -> nn.Module:
    return RowParallelLinear.from_linear(_linear(module, "row"), ctx.group,
                                         sequence_parallel=ctx.sequence_parallel)


def _vocab_embedding(module: nn.Module, ctx: TPContext) -> nn.Module:
    if not isinstance(module, nn.Embedding):
        raise TypeError(f"style 'vocab_embedding' needs an nn.Embedding, got "
                        f"{type(module).__name__}")
    return VocabParallelEmbedding.from_embedding(
        module, ctx.group, pad_multiple=ctx.pad_multiple,
        reduce="sequence" if ctx.sequence_parallel else "all")


def _gpt_embedding(module: nn.Module, ctx: TPContext) -> nn.Module:
    return ParallelTokenPositionEmbedding.from_module(
        module, ctx.group, sequence_parallel=ctx.sequence_parallel, tracker=ctx.tracker,
        pad_multiple=ctx.pad_multiple)


def _vocab_head(module: nn.Module, ctx: TPContext) -> nn.Module:
    return VocabParallelHead.from_head(module, ctx.group, ctx.sequence_parallel,
                                       ctx.pad_multiple)


def _vocab_cross_entropy(module: nn.Module, ctx: TPContext) -> nn.Module:
    if ctx.vocab_size is None:
        raise ValueError("style 'vocab_cross_entropy' needs the vocabulary size: pass "
                         "vocab_size= or slice a 'vocab_embedding' / 'gpt_embedding' too")
    return VocabParallelCrossEntropy(ctx.group, ctx.vocab_size,
                                     ignore_index=getattr(module, "ignore_index", -100))


def _norm(module: nn.Module, ctx: TPContext) -> nn.Module:
    if not ctx.sequence_parallel:
        return module  # replicated input: the plain norm is already correct
    if isinstance(module, nn.RMSNorm):
        return SequenceParallelRMSNorm(module, ctx.group)
    if not isinstance(module, nn.LayerNorm):
        raise TypeError(f"style 'norm' needs an nn.LayerNorm or nn.RMSNorm, got "
                        f"{type(module).__name__}")
    return SequenceParallelLayerNorm.from_layernorm(module, ctx.group)


def _sequence_dropout(module: nn.Module, ctx: TPContext) -> nn.Module:
    return RNGRegion(module, ctx.tracker) if ctx.sequence_parallel else module


def _tp_rng(module: nn.Module, ctx: TPContext) -> nn.Module:
    return RNGRegion(module, ctx.tracker)


MODULE_STYLES: Mapping[str, Callable[[nn.Module, TPContext], nn.Module]] = MappingProxyType({
    "column": _column,
    "column_qkv": _column_qkv,
    "column_pair": _column_pair,
    "kv_replicated": _kv_replicated,
    "row": _row,
    "vocab_embedding": _vocab_embedding,
    "gpt_embedding": _gpt_embedding,
    "vocab_head": _vocab_head,
    "vocab_cross_entropy": _vocab_cross_entropy,
    "norm": _norm,
    "sequence_dropout": _sequence_dropout,
    "tp_rng": _tp_rng,
})
"""Style name -> builder ``(original module, TPContext) -> parallel module``."""

# Parameter (relative to the matched module) -> parameter style of mt_tensor_parallel.sharding.
# Anything not listed is replicated.
_PARAM_STYLES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "column": {"weight": "column", "bias": "column"},
    "column_qkv": {"weight": "column_qkv", "bias": "column_qkv"},
    "column_pair": {"weight": "column_pair", "bias": "column_pair"},
    "row": {"weight": "row"},
    "vocab_head": {"weight": "vocab"},
    "vocab_embedding": {"weight": "vocab"},
    "gpt_embedding": {"tokens.weight": "vocab"},
})


def _matches(pattern: str, name: str) -> bool:
    parts, segments = pattern.split("."), name.split(".")
    return len(parts) == len(segments) and all(
        fnmatch.fnmatchcase(seg, part) for part, seg in zip(parts, segments, strict=True))


def match_plan(names: Iterable[str], plan: Mapping[str, str], strict: bool = True
               ) -> dict[str, str]:
    """``{module name: style}`` for every name matched by a plan pattern.

    Raises ValueError for unknown styles, a name matched by two patterns, a match nested
    inside another match, and (``strict``) a pattern that matches nothing, naming it.
    """
    unknown = {p: s for p, s in plan.items() if s not in MODULE_STYLES}
    if unknown:
        raise ValueError(f"unknown styles in plan: {unknown}; known: {sorted(MODULE_STYLES)}")
    matched: dict[str, str] = {}
    used: set[str] = set()
    for name in names:
        hits = [p for p in plan if name and _matches(p, name)]
        if len(hits) > 1:
            raise ValueError(f"module {name!r} matches several plan patterns: {hits}")
        if hits:
            matched[name] = plan[hits[0]]
            used.add(hits[0])
    if strict:
        unused = [p for p in plan if p not in used]
        if unused:
            raise ValueError(f"plan patterns match no module of the model: {unused}")
    for name in matched:
        parents = [m for m in matched if name.startswith(m + ".")]
        if parents:
            raise ValueError(f"plan matches both {parents[0]!r} and its child {name!r}")
    return matched


def param_styles(param_names: Iterable[str], plan: Mapping[str, str]) -> dict[str, str]:
    """Shard style (``mt_tensor_parallel.sharding``) of every parameter name of the
    unsliced model under ``plan``: what checkpoint conversion and sharded init need."""
    styles: dict[str, str] = {}
    for name in param_names:
        styles[name] = "replicate"
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            prefix, leaf = ".".join(parts[:cut]), ".".join(parts[cut:])
            style = next((s for p, s in plan.items() if _matches(p, prefix)), None)
            if style is not None:
                styles[name] = _PARAM_STYLES.get(style, {}).get(leaf, "replicate")
                break
    return styles


def shard_state_dict(full: Mapping[str, torch.Tensor], plan: Mapping[str, str], tp_rank: int,
                     tp_size: int, *, pad_multiple: int = DEFAULT_PAD_MULTIPLE
                     ) -> dict[str, torch.Tensor]:
    """This rank's state dict from an unsliced one (pure): load it into the model that
    :func:`apply_tensor_parallel` made with the same plan. Each tensor is read once, so
    ``full`` may be a lazy mapping (e.g. one that computes each initial value on demand)."""
    styles = param_styles(full.keys(), plan)
    return {name: shard_tensor(styles[name], full[name], tp_rank, tp_size,
                               pad_multiple=pad_multiple) for name in full}


def merge_state_dicts(shards: Sequence[Mapping[str, torch.Tensor]], plan: Mapping[str, str],
                      *, vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard_state_dict`: the unsliced state dict from every TP rank's
    one (index = tp rank). ``vocab_size`` drops the vocabulary padding rows."""
    styles = param_styles(shards[0].keys(), plan)
    return {name: merge_shards(styles[name], [s[name] for s in shards], vocab_size=vocab_size)
            for name in shards[0]}


def _check_config(model: nn.Module, tp: int, sequence_parallel: bool) -> None:
    # Duck-typed: a model carrying a GPT-like config is checked up front, with the numbers.
    config = getattr(model, "config", None)
    needed = ("n_heads", "hidden")
    if config is not None and all(hasattr(config, k) for k in needed):
        check_divisibility(tp=tp, n_heads=config.n_heads, hidden=config.hidden,
                           ffn_hidden=getattr(config, "ffn_hidden", None),
                           seq_len=getattr(config, "seq_len", None),
                           sequence_parallel=sequence_parallel,
                           n_kv_heads=getattr(config, "n_kv_heads", None))


def _vocab_size(model: nn.Module, matched: Mapping[str, str]) -> int | None:
    for name, style in matched.items():
        module = model.get_submodule(name)
        if style == "vocab_embedding":
            return module.num_embeddings
        if style == "gpt_embedding":
            return module.tokens.num_embeddings
    # E.g. a last pipeline stage holding the head and loss but no embedding module.
    return getattr(getattr(model, "config", None), "vocab_size", None)


def apply_tensor_parallel(model: nn.Module, group: ProcessGroup | None,
                          plan: Mapping[str, str], sequence_parallel: bool = False,
                          rng_tracker: RNGTracker | None = None, *, strict: bool = True,
                          pad_multiple: int = DEFAULT_PAD_MULTIPLE,
                          vocab_size: int | None = None) -> nn.Module:
    """Slice ``model`` in place over the tensor-parallel ``group`` following ``plan``.

    Every matched module is replaced by its parallel version holding this rank's exact
    slice of the original weights. ``rng_tracker`` provides the per-rank dropout stream
    (default: ``RNGTracker(torch.initial_seed(), tp_rank)``). ``strict=False`` allows plan
    patterns that match nothing (e.g. a pipeline stage without the embedding).
    ``vocab_size`` (real, unpadded) is needed by ``vocab_cross_entropy``; by default it is
    read from the embedding the plan slices, else from ``model.config.vocab_size``.
    Returns ``model``.
    """
    tp_size, tp_rank = group_size(group), group_rank(group)
    _check_config(model, tp_size, sequence_parallel)
    matched = match_plan([n for n, _ in model.named_modules()], plan, strict)
    tracker = rng_tracker or RNGTracker(torch.initial_seed() % 2**62, tp_rank)
    vocab = vocab_size if vocab_size is not None else _vocab_size(model, matched)
    kv_heads = getattr(getattr(model, "config", None), "n_kv_heads", None)
    ctx = TPContext(group, tp_rank, tp_size, sequence_parallel, tracker, vocab, pad_multiple,
                    kv_heads)
    for name, style in matched.items():
        original = model.get_submodule(name)
        replacement = MODULE_STYLES[style](original, ctx)
        replacement.train(original.training)
        if replacement is not original:
            model.set_submodule(name, replacement)
    return model
