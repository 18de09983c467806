"""ZeRO partitioning as pure arithmetic: parameter sizes + DP size -> shard ranges.

A *flat buffer* holds a list of parameters back to back (parameter ``i`` occupies
``[param_start[i], param_start[i] + numels[i])``), padded at the end so that its length
divides by the number of ranks. Rank ``r`` owns the contiguous range
``[r * shard_numel, (r + 1) * shard_numel)``. A rank's shard cuts parameters at arbitrary
element offsets, so the shard is described as :class:`Piece` s: which parameter, where in
that parameter, where in the shard, how long.

The ZeRO optimizer applies this to every bucket (stages 0-2) or unit (stage 3) of the model;
with a single bucket it is exactly "each rank owns 1/N of one flat buffer". Nothing here
touches torch, so it is tested without processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Piece", "ShardLayout", "bucketize", "partition"]


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls into one rank's shard.

    Attributes:
        param_index: index of the parameter in the layout's ``numels``.
        param_offset: first element of the piece inside the (flattened) parameter.
        shard_offset: first element of the piece inside the rank's shard.
        length: number of elements.
    """

    param_index: int
    param_offset: int
    shard_offset: int
    length: int


@dataclass(frozen=True)
class ShardLayout:
    """How one flat buffer of parameters is split into ``world_size`` equal shards.

    Build it with :func:`partition`. All numbers are element counts.
    """

    numels: tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        bad = [(i, n) for i, n in enumerate(self.numels) if n < 0]
        if bad:
            raise ValueError(f"parameter numels must be >= 0, got (index, numel) {bad}")

    @property
    def numel(self) -> int:
        """Elements of real data (sum of ``numels``)."""
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        """Flat buffer length: ``numel`` rounded up to a multiple of ``world_size``.

        An empty buffer still gets one element per rank so every rank has a non-empty shard
        (collectives on zero-size tensors are a needless special case on some backends).
        """
        n = max(self.numel, 1)
        return -(-n // self.world_size) * self.world_size

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns (padding included)."""
        return self.padded_numel // self.world_size

    @property
    def param_starts(self) -> tuple[int, ...]:
        """Offset of each parameter in the flat buffer."""
        starts, offset = [], 0
        for n in self.numels:
            starts.append(offset)
            offset += n
        return tuple(starts)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the flat buffer (padding included)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """The parameter pieces inside ``rank``'s shard, in flat-buffer order.

        Zero-sized parameters and padding produce no piece.
        """
        lo, hi = self.shard_range(rank)
        out = []
        for i, (start, n) in enumerate(zip(self.param_starts, self.numels)):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                out.append(Piece(i, a - start, a - lo, b - a))
        return tuple(out)

    def owners(self, param_index: int) -> tuple[int, ...]:
        """Ranks whose shard holds at least one element of parameter ``param_index``."""
        start, n = self.param_starts[param_index], self.numels[param_index]
        if n == 0:
            return ()
        first, last = start // self.shard_numel, (start + n - 1) // self.shard_numel
        return tuple(range(first, last + 1))


def partition(numels: Sequence[int], world_size: int) -> ShardLayout:
    """Split a flat buffer of parameters with sizes ``numels`` over ``world_size`` ranks."""
    return ShardLayout(tuple(int(n) for n in numels), int(world_size))


def bucketize(
    numels: Sequence[int], bucket_numel: int, own_bucket_from: int | None = None
) -> list[list[int]]:
    """Group parameter indices into communication buckets of about ``bucket_numel`` elements.

    Parameters are taken in *reverse* order, because backward produces gradients roughly in
    reverse registration order: bucket 0 is ready first. A bucket closes once it holds at
    least ``bucket_numel`` elements, so no bucket is empty. A parameter with at least
    ``own_bucket_from`` elements (if given) gets a bucket of its own: the bucket's flat
    gradient can then be the tensor autograd produced, instead of a copy of it.
    Returns the parameter indices of each bucket.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    if own_bucket_from is not None and own_bucket_from < 1:
        raise ValueError(f"own_bucket_from must be >= 1 (or None), got {own_bucket_from}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(numels))):
        if current and own_bucket_from is not None and numels[i] >= own_bucket_from:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += int(numels[i])
        if size >= bucket_numel:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
