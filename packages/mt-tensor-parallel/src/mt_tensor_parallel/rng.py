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

__all__ = ["DEFAULT_TP_SEED_OFFSET", "KeyedRNG", "RNGTracker", "TP_RNG", "mix_seed"]

TP_RNG = "tensor-parallel"
# Any constant works; it keeps the TP stream away from the default stream of the same seed.
DEFAULT_TP_SEED_OFFSET = 2718
_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 over them): nearby inputs give unrelated
    seeds, so streams keyed by (seed, micro-batch, layer) do not overlap."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state + (int(value) & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state >> 1


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
        self._start(name, seed)

    def _start(self, name: str, seed: int) -> None:
        """Stream ``name`` at the start of the sequence of ``seed`` (CPU, and CUDA's)."""
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

    def reseed(self, seed: int) -> None:
        """Restart every stream from ``seed`` (each still apart from the others and from
        the other TP ranks' streams: its own creation seed is mixed in)."""
        for name, base in self.seeds.items():
            self._start(name, mix_seed(seed, base))

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


class KeyedRNG:
    """Random numbers as a function of (seed, key, region), not of what ran before.

    :meth:`enter` re-seeds every generator that dropout draws from: torch's default CPU
    generator, the current CUDA device's (when ``use_cuda``) and the streams of an optional
    :class:`RNGTracker`. Call it at the start of each region (the embedding, each layer) of
    each micro-batch, with ``key`` naming the micro-batch by its data (e.g. its first
    sample's index in the run) and ``region`` naming the layer. Then

    - the masks do not depend on the layout: data parallelism, pipeline stages, schedules and
      ZeRO do not change which micro-batch or layer a mask belongs to (tensor-parallel
      regions still draw per-rank streams, by design: their activations are shards);
    - recomputation (activation checkpointing) replays the same masks when the region is
      entered again inside the recomputed function;
    - a resumed run needs no saved generator state.

    ``slice_index`` (a context-parallel rank's index; 0 without context parallelism) is mixed
    into every seed: the ranks holding slices of one sequence draw different masks for their
    equally shaped slices, as tensor-parallel streams do for shards.
    """

    def __init__(self, seed: int, tracker: RNGTracker | None = None,
                 use_cuda: bool | None = None, slice_index: int = 0) -> None:
        self.seed = seed
        self.tracker = tracker
        self.use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self.slice_index = slice_index

    def enter(self, key: int, region: int) -> None:
        """Seed every generator for ``region`` of micro-batch ``key``."""
        seed = mix_seed(self.seed, key, region) if not self.slice_index else \
            mix_seed(self.seed, key, region, self.slice_index)
        torch.default_generator.manual_seed(seed)
        if self.use_cuda:
            torch.cuda.manual_seed(seed)
        if self.tracker is not None:
            self.tracker.reseed(seed)
