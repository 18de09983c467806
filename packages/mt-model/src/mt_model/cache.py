"""The key/value cache of incremental decoding: prefill a batch of prompts once, then one
token per step, each step attending to every earlier position without computing it again.

Prompts of different lengths share a batch left-padded: row ``r`` starts ``pad[r]`` slots
in, so every row's newest token sits in the same slot and one write per layer fills the
batch. A slot's position is its index minus the row's padding (the first real token is
position 0, as when the prompt runs alone); padded slots are never attended to. The cache
holds, per layer, keys and values ``[b, kv_heads, capacity, head_dim]`` allocated at the
first write from the projected tensors' own widths, so a tensor-parallel rank holding some of
the heads caches just those.
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

    def mask(self, new: int, device: torch.device) -> torch.Tensor:
        """[b, 1, new, length + new] boolean: which cached slots each new token may attend
        to (its own row's real tokens up to itself)."""
        total = self.length + new
        keys = torch.arange(total, device=device)
        queries = torch.arange(self.length, total, device=device)
        causal = keys.unsqueeze(0) <= queries.unsqueeze(1)  # [new, total]
        real = keys.unsqueeze(0) >= self.pad.to(device).unsqueeze(1)  # [b, total]
        return (causal.unsqueeze(0) & real.unsqueeze(1)).unsqueeze(1)

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
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
