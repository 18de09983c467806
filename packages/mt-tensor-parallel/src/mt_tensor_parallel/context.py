"""Context parallelism (CP): each of ``cp`` ranks holds a slice of every sequence.

**The slices** (pure): the sequence is cut into ``2 cp`` equal chunks and rank ``r`` holds
chunks ``r`` and ``2 cp - 1 - r``. Under a causal mask a later token attends to more keys,
so pairing an early chunk with a late one gives every rank the same work (the layout of
Megatron-core and torchtitan). :func:`cp_positions` gives a rank's positions in the whole
sequence, :func:`shard_sequence` cuts its slice out of a full tensor and
:func:`unshard_sequence` puts every rank's slices back in order.

**Attention** (:class:`ContextParallel`, what mt-model's embedding and attention core read
from their ``context`` attribute): queries stay local; keys and values are all-gathered over
the CP group (their gradient is reduce-scattered back: each rank's queries add to every key's
gradient) and put in position order, so each rank holds the whole sequence's keys. Each of a
rank's two runs of queries attends to the keys before it and causally to its own (mt-model's
``chunked_causal_attention``), and positions (learned or rotary) are those of the slice, so
every token sees exactly what it sees in one process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from mt_dist.collectives import group_rank, group_size
from mt_tensor_parallel.mappings import gather_from_sequence

__all__ = ["ContextParallel", "attach_context", "cp_chunks", "cp_positions", "shard_sequence",
           "unshard_sequence"]


def cp_chunks(seq_len: int, cp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two [start, end) chunks of the sequence that CP rank ``rank`` of ``cp`` holds."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} of {cp}: need cp >= 1 and 0 <= rank < cp")
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp} "
                         "(each CP rank holds two equal chunks)")
    size = seq_len // (2 * cp)
    late = 2 * cp - 1 - rank
    return (rank * size, (rank + 1) * size), (late * size, (late + 1) * size)


def cp_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """The positions (in the whole sequence) of the tokens CP rank ``rank`` holds, in order."""
    (a, b), (c, d) = cp_chunks(seq_len, cp, rank)
    return [*range(a, b), *range(c, d)]


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """CP rank ``rank``'s slice of ``x`` along ``dim`` (the sequence; no communication)."""
    (a, b), (c, d) = cp_chunks(x.shape[dim], cp, rank)
    return torch.cat([x.narrow(dim, a, b - a), x.narrow(dim, c, d - c)], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every CP rank's slice (``shards[r]`` is rank r's)."""
    cp = len(shards)
    seq_len = sum(s.shape[dim] for s in shards)
    pieces: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        half = shard.shape[dim] // 2
        pieces[rank] = shard.narrow(dim, 0, half)
        pieces[2 * cp - 1 - rank] = shard.narrow(dim, half, half)
    out = torch.cat([p for p in pieces if p is not None], dim=dim)
    assert out.shape[dim] == seq_len
    return out


class ContextParallel:
    """This rank's part of a context-parallel group, as an attention core uses it.

    Args:
        group: the CP group (``None``: one rank, the whole sequence).
        seq_len: the whole sequence's length (divisible by 2 x the group's size).
    """

    def __init__(self, group: ProcessGroup | None, seq_len: int) -> None:
        self.group, self.seq_len = group, seq_len
        self.size, self.rank = group_size(group), group_rank(group)
        self.runs = cp_chunks(seq_len, self.size, self.rank)
        """This rank's positions as [start, end) runs, in the order of its tokens."""
        self._positions = torch.tensor(cp_positions(seq_len, self.size, self.rank))
        gathered = [p for r in range(self.size) for p in cp_positions(seq_len, self.size, r)]
        # Gathered slices come in rank order; this index puts them in position order.
        self._order = torch.tensor(sorted(range(seq_len), key=gathered.__getitem__))
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        if device not in self._cache:
            self._cache[device] = (self._positions.to(device), self._order.to(device))
        return self._cache[device]

    def positions(self, device: torch.device) -> torch.Tensor:
        """Positions in the whole sequence of this rank's tokens [seq_len / cp]."""
        return self._on(device)[0]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's [b, s / cp, ...] keys or values: the whole sequence [b, s, ...] in
        position order; backward reduce-scatters (sums every rank's gradient for this rank's
        slice)."""
        whole = gather_from_sequence(x, self.group, reduce_grads=True)
        return whole if self.size == 1 else whole.index_select(1, self._on(x.device)[1])


def attach_context(model: nn.Module, context: ContextParallel | None) -> int:
    """Give ``context`` to every module of ``model`` that reads one (an attribute named
    ``context``, as mt-model's attention core has); ``None`` takes it away. Returns how many
    modules took it (0: the model has no context-parallel attention)."""
    modules = [m for m in model.modules() if "context" in vars(m)]
    for module in modules:
        module.context = context
    return len(modules)
