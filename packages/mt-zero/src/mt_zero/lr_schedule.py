"""Learning-rate schedule in tokens: linear warmup, then cosine decay to a floor (MT-NLG)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LRSchedule"]


@dataclass(frozen=True)
class LRSchedule:
    """``lr(tokens)`` for the step whose batch brings consumption to ``tokens``.

    Attributes:
        peak: learning rate at the end of warmup.
        floor: learning rate after the decay.
        warmup_tokens: tokens of linear warmup from 0.
        decay_tokens: tokens (from the start) at which the cosine reaches ``floor``.
    """

    peak: float
    floor: float
    warmup_tokens: int
    decay_tokens: int

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.peak:
            raise ValueError(f"need 0 <= floor {self.floor} <= peak {self.peak}")
        if self.warmup_tokens < 0 or self.decay_tokens < self.warmup_tokens:
            raise ValueError(f"need 0 <= warmup_tokens {self.warmup_tokens} <= decay_tokens "
                             f"{self.decay_tokens}")

    @classmethod
    def create(cls, lr: float, min_lr: float | None, warmup_tokens: int | None,
               decay_tokens: int | None, train_tokens: int) -> LRSchedule:
        """Defaults: floor lr / 10, warmup 5% of training, decay over all training tokens."""
        decay = decay_tokens if decay_tokens is not None else train_tokens
        warmup = warmup_tokens if warmup_tokens is not None else train_tokens // 20
        return cls(lr, lr / 10 if min_lr is None else min_lr, min(warmup, decay), decay)

    def __call__(self, tokens: int) -> float:
        if self.warmup_tokens and tokens <= self.warmup_tokens:
            return self.peak * tokens / self.warmup_tokens
        if tokens >= self.decay_tokens:
            return self.floor
        progress = (tokens - self.warmup_tokens) / (self.decay_tokens - self.warmup_tokens)
        return self.floor + (self.peak - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
