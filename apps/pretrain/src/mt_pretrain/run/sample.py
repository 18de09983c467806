"""A short greedy sample from the trained model, to see what it learned.

The model shards of every rank are gathered to rank 0 (fp32 master weights, unsharded by
the tensor-parallel plan, stages joined) and decoded there with mt-model's key/value cache
(:func:`mt_model.generate`, as `mt generate` does). Meant for the small models a sample is
useful for; large models skip it (`mt generate` decodes them at any layout).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mt_checkpoint import merge_model
from mt_dist import ParallelGroups
from mt_model import GPT, GPTConfig, Sampling, generate

__all__ = ["MAX_SAMPLE_PARAMETERS", "gather_model", "gather_weights", "greedy_generate"]

#: Gathering a model bigger than this onto one process for a sample is not worth it.
MAX_SAMPLE_PARAMETERS = 2_000_000_000


def gather_weights(weights: dict[str, torch.Tensor], styles: dict[str, str],
                   groups: ParallelGroups, gpt: GPTConfig) -> dict[str, torch.Tensor] | None:
    """Every fp32 master weight at its full (unsharded) shape, on rank 0 (None elsewhere), from
    each rank's ``weights`` (an engine's ``full_parameters()``). Collective."""
    mine = ((groups.pp_rank, groups.tp_rank), weights) if groups.grad_rank == 0 else None
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered: list[Any] = [None] * world
    if world > 1:
        dist.gather_object(mine, gathered if groups.rank == 0 else None, dst=0)
    else:
        gathered = [mine]
    if groups.rank != 0:
        return None
    parts = dict(item for item in gathered if item is not None)
    return merge_model(parts, styles, gpt.vocab_size)


def gather_model(weights: dict[str, torch.Tensor], styles: dict[str, str],
                 groups: ParallelGroups, gpt: GPTConfig) -> GPT | None:
    """The whole model as a single-device fp32 GPT on rank 0 (None elsewhere). Collective."""
    full = gather_weights(weights, styles, groups, gpt)
    if full is None:
        return None
    model = GPT(gpt, seed=None)
    model.load_state_dict(full, strict=True)
    return model.eval()


def greedy_generate(model: GPT, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """``prompt_ids`` and up to ``new_tokens`` greedy tokens after them (at most seq_len - 1;
    the prompt's tail is the context when both exceed seq_len)."""
    seq_len = model.config.seq_len
    new = max(1, min(new_tokens, seq_len - 1))
    context = (list(prompt_ids) or [0])[-(seq_len - new):]
    return list(prompt_ids) + generate(model, [context], Sampling(max_new_tokens=new))[0].tokens
