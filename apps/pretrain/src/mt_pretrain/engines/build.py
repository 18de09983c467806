"""Build this rank's model shard and mt's optimizer: the middle of "the path of one run".

GPT on the meta device -> tensor parallel by plan -> this rank's pipeline stage ->
materialized and initialized with exactly the values of the unsharded init (mt-checkpoint's
``materialize_stage``) -> mt-zero's ZeRO / DP optimizer wrapper, for mt's engine. Each arrow
is one call into a package.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mt_checkpoint import Built, materialize_stage, rank_seed
from mt_dist import ParallelGroups
from mt_model import TIED_WEIGHT, init_parameter
from mt_pipeline import PipelineStage
from mt_plan.layout import ParallelLayout
from mt_pretrain.config.resolve import RunPlan
from mt_pretrain.config.schema import TrainArgs
from mt_tensor_parallel import (
    ContextParallel,
    attach_context,
    defer_replicated_grads,
)
from mt_zero import ZeroOptimizer, counts_once, decay_param_groups

__all__ = ["build_model_stage", "make_optimizer", "seed_everything"]


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


def make_optimizer(train: TrainArgs, layout: ParallelLayout, stage: PipelineStage,
                   groups: ParallelGroups, styles: dict[str, str],
                   bucket_numel: int = 2**22) -> ZeroOptimizer:
    """AdamW (``train``'s hyperparameters) inside the ZeRO wrapper (``layout``'s stage and
    precision) over the dp x cp ranks of this model shard; norms count each parameter once
    over TP x PP x DP. Replicated parameters that each TP rank uses on its share of the work
    (norms under sequence parallelism ...) have their gradients summed over TP once per step,
    in one bucket, instead of in every micro-batch's backward."""

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
        config=layout.zero_config(clip_grad=train.clip_grad, bucket_numel=bucket_numel),
        param_groups=decay_param_groups(stage.named_parameters(), train.weight_decay),
        norm_groups=[groups.tp, groups.pp],
        count_in_norm=counted,
        partial_params=[p for _, p in defer_replicated_grads(stage)], partial_group=groups.tp,
    )
