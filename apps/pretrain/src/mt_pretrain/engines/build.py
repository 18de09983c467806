"""Build this rank's model shard and mt's optimizer: the middle of "the path of one run".

GPT on the meta device -> tensor parallel by plan -> this rank's pipeline stage ->
materialized and initialized with exactly the values of the unsharded init (-> mt-zero's
ZeRO / DP optimizer wrapper, for mt's engine). Each arrow is one call into a package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mt_checkpoint import rank_seed
from mt_dist import ParallelGroups
from mt_model import GPT, TIED_WEIGHT, GPTConfig, init_parameter
from mt_pipeline import ModelLayout, PipelineStage, StagePlan, build_stage
from mt_plan.layout import ParallelLayout
from mt_pretrain.config.resolve import RunPlan, sharding_styles
from mt_pretrain.config.schema import TrainArgs
from mt_tensor_parallel import (
    ContextParallel,
    KeyedRNG,
    RNGTracker,
    VocabParallelCrossEntropy,
    apply_tensor_parallel,
    attach_context,
    decoder_plan,
    shard_tensor,
)
from mt_zero import ZeroOptimizer, counts_once, decay_param_groups

__all__ = ["Built", "build_model_stage", "make_optimizer", "materialize_stage",
           "seed_everything"]


@dataclass
class Built:
    """This rank's part of the model (the engine adds the optimizer).

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


def seed_everything(seed: int, groups: ParallelGroups) -> None:
    """Seed torch's default generator with mt-checkpoint's rank seed: equal across TP ranks
    (replicated dropout must match), different across pipeline stages and replicas."""
    torch.manual_seed(rank_seed(seed, groups.pp_rank, groups.dp_rank))


def build_model_stage(plan: RunPlan, groups: ParallelGroups, seed: int,
                      sequence_parallel: bool, device: torch.device,
                      keyed_dropout: bool = False) -> Built:
    """Meta GPT -> TP -> stage -> materialize -> the unsharded init's values, sliced.

    ``keyed_dropout`` gives the stage a :class:`~mt_tensor_parallel.KeyedRNG`: dropout masks
    drawn per (micro-batch, layer), the same on every layout. With context parallelism the
    stage's embedding and attention take this rank's slice of every sequence
    (:class:`~mt_tensor_parallel.ContextParallel` over ``groups.cp``).
    """
    gpt = plan.model  # all position rows, even when training uses fewer
    built = materialize_stage(
        gpt, plan.stages.stages[groups.pp_rank], groups, plan.topology.tp,
        # Pure per-name init of the full tensor: the one-process model's numbers.
        lambda name, shape: init_parameter(name, shape, gpt, seed),
        seed, sequence_parallel, device, keyed_dropout, plan.layout.chunked_loss)
    if plan.topology.cp > 1:
        taken = attach_context(built.stage, ContextParallel(groups.cp, plan.gpt.seq_len))
        stage_plan = plan.stages.stages[groups.pp_rank]
        expected = len(stage_plan.layers) + stage_plan.has_embedding  # attention cores, input
        if taken != expected:  # a module that would treat a slice as a whole sequence
            raise RuntimeError(f"context parallelism reached {taken} modules of pipeline "
                               f"stage {groups.pp_rank}, which has {expected} that need it")
    return built


def materialize_stage(gpt: GPTConfig, stage_plan: StagePlan, groups: ParallelGroups, tp: int,
                      full_value: Callable[[str, tuple[int, ...]], torch.Tensor], seed: int,
                      sequence_parallel: bool, device: torch.device,
                      keyed_dropout: bool = False, chunked_loss: bool = False) -> Built:
    """This rank's stage of ``gpt`` (``stage_plan``'s layers, TP slices of degree ``tp``),
    each parameter this rank's exact slice of ``full_value(name, full_shape)``: the same
    numbers as the one-process model, whatever the layout. ``chunked_loss``: the stage's
    loss computes the head with it, chunk by chunk (mt-tensor-parallel's
    ``VocabParallelCrossEntropy.head_loss``, on one rank too)."""
    with torch.device("meta"):
        model = GPT(gpt, seed=None)
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    styles = sharding_styles(gpt, tp)
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
                           "uninitialized; mt pretrain does not support that")
    return Built(stage, tracker, full_shapes, styles)


def make_optimizer(train: TrainArgs, layout: ParallelLayout, stage: PipelineStage,
                   groups: ParallelGroups, styles: dict[str, str]) -> ZeroOptimizer:
    """AdamW (``train``'s hyperparameters) inside the ZeRO wrapper (``layout``'s stage and
    precision) over the dp x cp ranks of this model shard; norms count each parameter once
    over TP x PP x DP."""

    def factory(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        # fused: one vectorised kernel per tensor (on this CPU 10x the default loop's speed).
        return torch.optim.AdamW(param_groups, lr=train.lr,
                                 betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                                 fused=True)

    is_first, is_last = groups.is_first_stage, groups.is_last_stage
    # The last stage's copy of the tied embedding duplicates the first stage's.
    def pp_duplicate(name: str, _param: nn.Parameter) -> bool:
        return name == TIED_WEIGHT and is_last and not is_first

    counted = counts_once(groups.tp_rank,
                          tp_replicated=lambda name, _p: styles.get(name) == "replicate",
                          pp_duplicate=pp_duplicate)
    # ZeRO-3 gathers per unit: the stage (embedding, head, norms) and each block.
    units = [stage, *stage.get_submodule(stage.layout.layers).values()] \
        if layout.zero_stage == 3 else None
    return ZeroOptimizer(
        stage, factory, dp_group=groups.grad_group, units=units,
        config=layout.zero_config(clip_grad=train.clip_grad),
        param_groups=decay_param_groups(stage.named_parameters(), train.weight_decay),
        norm_groups=[groups.tp, groups.pp],
        count_in_norm=counted,
    )
