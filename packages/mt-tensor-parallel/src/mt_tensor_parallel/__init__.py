"""Megatron-style tensor slicing with sequence parallelism, applied to a plain model by plan.

Public API:

- communication (autograd, group passed explicitly): :func:`copy_to_tp`,
  :func:`reduce_from_tp`, :func:`scatter_to_tp`, :func:`gather_from_tp`,
  :func:`scatter_to_sequence`, :func:`gather_from_sequence`,
  :func:`reduce_scatter_to_sequence`;
- replicated parameters with partial gradients (norms under sequence parallelism ...):
  :func:`partial_grad_params`, :func:`defer_replicated_grads` (summed once per step by the
  optimizer instead of in every backward);
- layers: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`, :class:`VocabParallelHead`,
  :func:`vocab_parallel_cross_entropy` / :class:`VocabParallelCrossEntropy`,
  :class:`SequenceParallelLayerNorm`, :class:`ParallelTokenPositionEmbedding`;
- randomness: :class:`RNGTracker`, :class:`RNGRegion`, :class:`KeyedRNG` (masks as a function
  of (seed, micro-batch, layer): layout-independent and replayed by recomputation);
- plans: :data:`GPT_PLAN`, :func:`decoder_plan` (any mt_model architecture: grouped-query
  key/value heads split or replicated, SwiGLU pairs, RMSNorm, untied heads),
  :func:`apply_tensor_parallel`, :func:`param_styles`,
  :func:`shard_state_dict`, :func:`merge_state_dicts`;
- pure slicing maths: :func:`check_divisibility`, :func:`padded_vocab_size`,
  :func:`shard_tensor`, :func:`merge_shards`;
- context parallelism (:mod:`mt_tensor_parallel.context`): :class:`ContextParallel` (what an
  attention core reads to attend over a sequence split across ranks), :func:`cp_positions`,
  :func:`shard_sequence`, :func:`unshard_sequence` (the causally balanced slices).
"""

from mt_tensor_parallel.context import (
    ContextParallel,
    attach_context,
    cp_chunks,
    cp_positions,
    shard_sequence,
    unshard_sequence,
)
from mt_tensor_parallel.embedding import ParallelTokenPositionEmbedding
from mt_tensor_parallel.layers import ColumnParallelLinear, ReplicatedKVLinear, RowParallelLinear
from mt_tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    partial_use,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tp,
)
from mt_tensor_parallel.plan import (
    GPT_PLAN,
    MODULE_STYLES,
    TPContext,
    apply_tensor_parallel,
    decoder_plan,
    match_plan,
    merge_state_dicts,
    param_styles,
    shard_state_dict,
)
from mt_tensor_parallel.replicated import defer_replicated_grads, partial_grad_params
from mt_tensor_parallel.rng import TP_RNG, KeyedRNG, RNGTracker, mix_seed
from mt_tensor_parallel.sequence import (
    RNGRegion,
    SequenceParallelLayerNorm,
    SequenceParallelRMSNorm,
)
from mt_tensor_parallel.sharding import (
    DEFAULT_PAD_MULTIPLE,
    PARAM_STYLES,
    check_divisibility,
    merge_shards,
    padded_vocab_size,
    shard_tensor,
    vocab_range,
)
from mt_tensor_parallel.vocab import (
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    VocabParallelHead,
    gather_vocab_logits,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
    vocab_parallel_logprobs,
)

__all__ = [
    "DEFAULT_PAD_MULTIPLE",
    "GPT_PLAN",
    "MODULE_STYLES",
    "PARAM_STYLES",
    "TP_RNG",
    "ColumnParallelLinear",
    "ContextParallel",
    "KeyedRNG",
    "ParallelTokenPositionEmbedding",
    "RNGRegion",
    "RNGTracker",
    "ReplicatedKVLinear",
    "RowParallelLinear",
    "SequenceParallelLayerNorm",
    "SequenceParallelRMSNorm",
    "TPContext",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "apply_tensor_parallel",
    "attach_context",
    "decoder_plan",
    "defer_replicated_grads",
    "check_divisibility",
    "copy_to_tp",
    "cp_chunks",
    "cp_positions",
    "gather_from_sequence",
    "gather_from_tp",
    "match_plan",
    "partial_grad_params",
    "partial_use",
    "merge_shards",
    "merge_state_dicts",
    "mix_seed",
    "gather_vocab_logits",
    "padded_vocab_size",
    "param_styles",
    "reduce_from_tp",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
    "scatter_to_tp",
    "shard_sequence",
    "shard_state_dict",
    "shard_tensor",
    "unshard_sequence",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_logprobs",
    "vocab_range",
]
