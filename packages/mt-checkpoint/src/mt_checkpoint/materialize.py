"""A model at a layout from full weights: this rank's pipeline stage of a GPT, tensor-parallel
slices and all, each parameter its exact slice of the unsharded value (the same numbers as one
process, whatever the layout). Training materializes the unsharded init this way, evaluation,
generation and serving a checkpoint's full weights.

GPT on the meta device -> tensor parallel by plan -> this rank's stage -> materialized -> each
parameter copied from its full value, sliced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mt_dist import ParallelGroups
from mt_model import GPT, TIED_WEIGHT, GPTConfig
from mt_pipeline import ModelLayout, PipelineStage, StagePlan, build_stage
from mt_tensor_parallel import (
    KeyedRNG,
    RNGTracker,
    VocabParallelCrossEntropy,
    apply_tensor_parallel,
    decoder_plan,
    param_styles,
    shard_tensor,
)

__all__ = ["Built", "materialize_stage", "sharding_styles"]


@dataclass
class Built:
    """This rank's part of the model.

    Attributes:
        stage: the pipeline stage module (the whole model when pp == 1); parameter names are
            those of the unsharded GPT.
        tracker: the tensor-parallel RNG streams (None when tp == 1).
        full_shapes: unsharded shape of every parameter of the whole model.
        styles: tensor-parallel shard style of every parameter name.
    """

    stage: PipelineStage
    tracker: RNGTracker | None
    full_shapes: dict[str, tuple[int, ...]]
    styles: dict[str, str]


def sharding_styles(gpt: GPTConfig, tp: int) -> dict[str, str]:
    """Tensor-parallel shard style of every parameter of the unsharded model at TP degree
    ``tp`` (grouped-query key/value heads are split or replicated depending on it)."""
    with torch.device("meta"):
        model = GPT(gpt, seed=None)
    return param_styles([n for n, _ in model.named_parameters()], decoder_plan(gpt, tp))


def materialize_stage(gpt: GPTConfig, stage_plan: StagePlan, groups: ParallelGroups, tp: int,
                      full_value: Callable[[str, tuple[int, ...]], torch.Tensor], seed: int,
                      sequence_parallel: bool, device: torch.device,
                      keyed_dropout: bool = False, chunked_loss: bool = False) -> Built:
    """This rank's stage of ``gpt`` (``stage_plan``'s layers, TP slices of degree ``tp``),
    each parameter this rank's exact slice of ``full_value(name, full_shape)``: the same
    numbers as the one-process model, whatever the layout. ``seed`` seeds the TP RNG streams
    (and ``keyed_dropout``'s masks); ``chunked_loss``: the stage's loss computes the head with
    it, chunk by chunk (mt-tensor-parallel's ``VocabParallelCrossEntropy.head_loss``, on one
    rank too)."""
    with torch.device("meta"):
        model = GPT(gpt, seed=None)
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    styles = param_styles(list(full_shapes), decoder_plan(gpt, tp))
    tracker = None
    if tp > 1:
        tracker = RNGTracker(seed, groups.tp_rank)
        apply_tensor_parallel(model, groups.tp, decoder_plan(gpt, tp),
                              sequence_parallel=sequence_parallel, rng_tracker=tracker)
    elif chunked_loss:  # one rank: the vocabulary-parallel loss over a group of one
        model.loss_fn = VocabParallelCrossEntropy(None, gpt.vocab_size)
    rng = KeyedRNG(seed, tracker, use_cuda=device.type == "cuda",
                   slice_index=groups.cp_rank) if keyed_dropout else None
    layout = ModelLayout(tied_weight=TIED_WEIGHT if gpt.tied_embeddings else None,
                         fused_loss=chunked_loss)
    stage = build_stage(model, stage_plan, layout, rng=rng)
    del model  # modules of other stages stay on the meta device and are dropped here
    stage.to_empty(device=device)
    with torch.no_grad():
        for name, param in stage.named_parameters():
            full = full_value(name, full_shapes[name])
            if tp > 1:
                full = shard_tensor(styles[name], full, groups.tp_rank, tp)
            param.copy_(full.to(device=device, dtype=param.dtype))
    if any(True for _ in stage.buffers()):
        raise RuntimeError("the model has buffers, which meta materialization leaves "
                           "uninitialized; mt does not support that")
    return Built(stage, tracker, full_shapes, styles)
