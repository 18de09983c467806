"""Mixed-precision settings and the dynamic loss scaler (as small pure state machines)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = ["PRECISIONS", "LossScaler", "LossScalerConfig", "compute_dtype"]

#: Names accepted for the compute precision of the model parameters.
PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def compute_dtype(precision: str) -> torch.dtype:
    """The torch dtype for a precision name (``fp32``, ``bf16`` or ``fp16``)."""
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(
            f"unknown precision {precision!r}; expected one of {sorted(PRECISIONS)}"
        ) from None


@dataclass(frozen=True)
class LossScalerConfig:
    """Dynamic loss scaling for fp16 training."""

    init_scale: float = 2.0**16
    """Loss scale before the first step."""
    growth_factor: float = 2.0
    """Scale multiplier after ``growth_interval`` consecutive clean steps."""
    backoff_factor: float = 0.5
    """Scale multiplier after a step whose gradients overflowed (that step is skipped)."""
    growth_interval: int = 1000
    """Clean steps needed before the scale grows."""
    min_scale: float = 1.0
    """The scale never backs off below this."""

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and self.min_scale > 0):
            raise ValueError(
                f"init_scale {self.init_scale} and min_scale {self.min_scale} must be > 0"
            )
        if not (self.growth_factor > 1.0 and 0.0 < self.backoff_factor < 1.0):
            raise ValueError(
                f"need growth_factor {self.growth_factor} > 1 and "
                f"0 < backoff_factor {self.backoff_factor} < 1"
            )
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")


@dataclass(frozen=True)
class LossScaler:
    """State of a dynamic loss scaler; :meth:`update` returns the next state.

    Attributes:
        config: the policy.
        scale: the current loss scale.
        clean_steps: consecutive steps without overflow since the last change of scale.
        skipped_steps: total steps skipped because of overflow.
    """

    config: LossScalerConfig = LossScalerConfig()
    scale: float = -1.0
    clean_steps: int = 0
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        if self.scale == -1.0:
            object.__setattr__(self, "scale", self.config.init_scale)
        if self.scale <= 0:
            raise ValueError(f"loss scale must be > 0, got {self.scale}")

    def update(self, found_inf: bool) -> LossScaler:
        """The state after a step that did (skip) or did not overflow."""
        if found_inf:
            scale = max(self.scale * self.config.backoff_factor, self.config.min_scale)
            return replace(self, scale=scale, clean_steps=0, skipped_steps=self.skipped_steps + 1)
        clean = self.clean_steps + 1
        if clean >= self.config.growth_interval:
            return replace(self, scale=self.scale * self.config.growth_factor, clean_steps=0)
        return replace(self, clean_steps=clean)

    def state_dict(self) -> dict[str, float | int]:
        """Plain numbers for checkpoints (the config is not saved: it is the user's choice)."""
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> LossScaler:
        """This config with the saved numbers."""
        return replace(self, scale=float(state["scale"]), clean_steps=int(state["clean_steps"]),
                       skipped_steps=int(state["skipped_steps"]))
