"""The key/value cache of incremental decoding: prefill a batch of prompts once, then one
token per step, each step attending to every earlier position without computing it again.

Prompts of different lengths share a batch left-padded: row ``r`` starts ``pad[r]`` slots
in, so every row's newest token sits in the same slot and one write per layer fills the
batch. A slot's position is its index minus the row's padding (the first real token is
position 0, as when the prompt runs alone); padded slots are never attended to. The cache
holds, per layer, keys and values ``[b, kv_heads, capacity, head_dim]`` allocated at the
first write from the projected tensors' own widths, so a tensor-parallel rank holding some of
the heads caches just those, and a pipeline stage only the layers it runs.

Continuous batching: :meth:`KVCache.join` merges the caches of two batches (the shorter one is
padded on the left to the longer one's length) and :meth:`KVCache.keep` drops finished rows
(and the slots no remaining row uses).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["KVCache", "LayerCache"]


class KVCache:
    """Keys and values of every layer for a left-padded batch (see the module docstring).

    Args:
        layers: transformer layers of the model (or of the pipeline stage).
        pad: left padding of each row (``capacity`` minus the row's total length is free).
        capacity: slots per row: padding + prompt + tokens to generate.
    """

    def __init__(self, layers: int, pad: Sequence[int] | torch.Tensor, capacity: int) -> None:
        self.pad = torch.as_tensor(pad, dtype=torch.int64)
        if self.pad.ndim != 1 or (self.pad < 0).any() or int(self.pad.max()) >= capacity:
            raise ValueError(f"padding {self.pad.tolist()} does not fit capacity {capacity}")
        self.capacity, self.length = capacity, 0
        self._mask: tuple[tuple, torch.Tensor | None] | None = None  # this step's, for all layers
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers

    @property
    def batch(self) -> int:
        """Rows of the batch."""
        return self.pad.shape[0]

    def positions(self, new: int, device: torch.device) -> torch.Tensor:
        """[b, new] positions of the next ``new`` slots (clamped at 0 inside the padding)."""
        if self.length + new > self.capacity:
            raise ValueError(f"{self.length} cached + {new} new positions exceed the cache's "
                             f"capacity of {self.capacity}")
        slots = torch.arange(self.length, self.length + new, device=device)
        return (slots.unsqueeze(0) - self.pad.to(device).unsqueeze(1)).clamp_min(0)

    def mask(self, new: int, device: torch.device) -> torch.Tensor | None:
        """[b, 1, new, length + new] boolean: which cached slots each new token may attend
        to (its own row's real tokens up to itself); None when that is every slot (one new
        token per row and no padding). Made once per step, for every layer."""
        key = (self.length, new, device)
        if self._mask is None or self._mask[0] != key:
            self._mask = (key, self._make_mask(new, device))
        return self._mask[1]

    def _make_mask(self, new: int, device: torch.device) -> torch.Tensor | None:
        if new == 1 and not bool(self.pad.any()):
            return None
        total = self.length + new
        keys = torch.arange(total, device=device)
        queries = torch.arange(self.length, total, device=device)
        causal = keys.unsqueeze(0) <= queries.unsqueeze(1)  # [new, total]
        real = keys.unsqueeze(0) >= self.pad.to(device).unsqueeze(1)  # [b, total]
        return (causal.unsqueeze(0) & real.unsqueeze(1)).unsqueeze(1)

    def join(self, other: KVCache, capacity: int) -> KVCache:
        """The rows of this cache, then ``other``'s, in one cache of ``capacity`` slots: both
        right-aligned on the longer one's filled length (the shorter's rows get more left
        padding), so every row's newest token is again in the same slot."""
        length = max(self.length, other.length)
        if capacity < length:
            raise ValueError(f"capacity {capacity} below the {length} filled slots")
        joined = KVCache(len(self.keys), torch.cat([self.pad + length - self.length,
                                                    other.pad + length - other.length]),
                         capacity)
        joined.length = length
        for store in ("keys", "values"):
            mine, theirs = getattr(self, store), getattr(other, store)
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                if (a is None) != (b is None):
                    raise ValueError(f"layer {i} is cached in one batch only")
                if a is None or b is None:
                    continue
                out = a.new_zeros((a.shape[0] + b.shape[0], a.shape[1], capacity, a.shape[3]))
                out[:a.shape[0], :, length - self.length:length] = a[:, :, :self.length]
                out[a.shape[0]:, :, length - other.length:length] = b[:, :, :other.length]
                getattr(joined, store)[i] = out
        return joined

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order), and drop the leading slots that are padding in
        all of them (positions are unchanged: they count from each row's own padding)."""
        index = torch.as_tensor(list(rows), dtype=torch.int64)
        if index.numel() == 0:
            raise ValueError("a cache keeps at least one row")
        self.pad = self.pad[index]
        self._mask = None
        cut = min(int(self.pad.min()), self.length)
        self.pad = self.pad - cut
        self.length -= cut
        self.capacity -= cut
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t[index.to(t.device), :, cut:]

    def layer(self, index: int) -> LayerCache:
        """The view layer ``index`` reads and writes."""
        return LayerCache(self, index)

    def advance(self, new: int) -> None:
        """Mark ``new`` slots as filled (after every layer has written them)."""
        self.length += new


class LayerCache:
    """One layer's part of a :class:`KVCache`: what attention needs for a step."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def positions(self, new: int, device: torch.device) -> torch.Tensor:
        """[b, new] positions of the new tokens."""
        return self.cache.positions(new, device)

    def extend(self, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store ``k``, ``v`` [b, m, new, d] after the cached slots; returns (all keys, all
        values, the attention mask) up to the newest slot."""
        c, i = self.cache, self.index
        new, start = k.shape[2], c.length
        if c.keys[i] is None:
            shape = (k.shape[0], k.shape[1], c.capacity, k.shape[3])
            c.keys[i] = k.new_zeros(shape)
            c.values[i] = v.new_zeros(shape)
        keys, values = c.keys[i], c.values[i]
        assert keys is not None and values is not None
        keys[:, :, start:start + new] = k
        values[:, :, start:start + new] = v
        return (keys[:, :, :start + new], values[:, :, :start + new],
                c.mask(new, k.device))
