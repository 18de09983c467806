"""A short greedy sample from the trained model, to see what it learned.

The model shards of every rank are gathered to rank 0 (fp32 master weights, unsharded by
the tensor-parallel plan, stages joined) and run there as a plain single-device GPT.
Meant for the small models a sample is useful for; large models skip it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mt_checkpoint import merge_model
from mt_dist import ParallelGroups
from mt_model import GPT, GPTConfig

__all__ = ["MAX_SAMPLE_PARAMETERS", "gather_model", "gather_weights", "greedy_generate"]

#: Gathering a model bigger than this onto one process for a sample is not worth it.
MAX_SAMPLE_PARAMETERS = 2_000_000_000


def gather_weights(weights: dict[str, torch.Tensor], styles: dict[str, str],
                   groups: ParallelGroups, gpt: GPTConfig) -> dict[str, torch.Tensor] | None:
    """Every fp32 master weight at its full (unsharded) shape, on rank 0 (None elsewhere), from
    each rank's ``weights`` (an engine's ``full_parameters()``). Collective."""
    mine = ((groups.pp_rank, groups.tp_rank), weights) if groups.dp_rank == 0 else None
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


@torch.no_grad()
def greedy_generate(model: GPT, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Append ``new_tokens`` argmax tokens to ``prompt_ids`` (context cut to seq_len)."""
    ids = list(prompt_ids) or [0]
    seq_len = model.config.seq_len
    for _ in range(new_tokens):
        context = torch.tensor([ids[-seq_len:]], dtype=torch.long)
        logits = model(context)
        ids.append(int(logits[0, -1].argmax()))
    return ids
