"""Separate random streams for tensor-parallel regions.

Dropout on *replicated* activations must draw the same mask on every TP rank (they hold
the same numbers, and must keep holding the same numbers), so it uses torch's default
generator, seeded identically on all TP ranks. Dropout on *sharded* activations (attention
heads, sequence-parallel hidden states) must draw different masks per rank, or every shard
would be dropped in the same pattern; it runs inside :meth:`RNGTracker.fork`, which swaps
in a stream seeded with ``seed + offset + tp_rank`` and puts the default generator back
(untouched) afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["RNGTracker", "TP_RNG", "DEFAULT_TP_SEED_OFFSET"]

TP_RNG = "tensor-parallel"
# Any constant works; it keeps the TP stream away from the default stream of the same seed.
DEFAULT_TP_SEED_OFFSET = 2718


class RNGTracker:
    """Named RNG states (CPU, plus the current CUDA device's when CUDA is available).

    ``RNGTracker(seed, tp_rank)`` creates the ``"tensor-parallel"`` state seeded with
    ``seed + offset + tp_rank``; :meth:`add` registers more named states.
    """

    def __init__(self, seed: int, tp_rank: int, offset: int = DEFAULT_TP_SEED_OFFSET,
                 use_cuda: bool | None = None) -> None:
        self.use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self._cpu: dict[str, torch.Tensor] = {}
        self._cuda: dict[str, torch.Tensor] = {}
        self.seeds: dict[str, int] = {}
        self.add(TP_RNG, seed + offset + tp_rank)

    def add(self, name: str, seed: int) -> None:
        """Register a new named stream seeded with ``seed`` (names and seeds must be new)."""
        if name in self.seeds:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self.seeds.values():
            raise ValueError(f"seed {seed} is already used by another RNG state")
        self.seeds[name] = seed
        self._cpu[name] = torch.Generator().manual_seed(seed).get_state()
        if self.use_cuda:
            saved = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(seed)
            self._cuda[name] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(saved)

    @contextmanager
    def fork(self, name: str = TP_RNG) -> Iterator[None]:
        """Run the body with stream ``name`` as the default generator, then restore the
        default generator and save the advanced stream for the next fork."""
        if name not in self._cpu:
            raise KeyError(f"unknown RNG state {name!r}; known: {sorted(self._cpu)}")
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if self.use_cuda else None
        torch.set_rng_state(self._cpu[name])
        if self.use_cuda:
            torch.cuda.set_rng_state(self._cuda[name])
        try:
            yield
        finally:
            self._cpu[name] = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if saved_cuda is not None:
                self._cuda[name] = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(saved_cuda)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of every stream (for checkpoints)."""
        return {
            "cpu": {k: v.clone() for k, v in self._cpu.items()},
            "cuda": {k: v.clone() for k, v in self._cuda.items()},
        }

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore streams saved by :meth:`state_dict`."""
        self._cpu = {k: v.clone() for k, v in state["cpu"].items()}
        if self.use_cuda:
            self._cuda = {k: v.clone() for k, v in state.get("cuda", {}).items()}
