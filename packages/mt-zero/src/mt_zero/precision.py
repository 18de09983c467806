"""Mixed precision: the compute precisions and their traits (the one place they are spelled),
and the dynamic loss scaler (as small pure state machines). Pure: torch is imported only to
hand out a dtype."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["PRECISIONS", "LossScaler", "LossScalerConfig", "Precision", "compute_dtype",
           "precision_of"]


@dataclass(frozen=True)
class Precision:
    """A compute precision of the model parameters (master weights and optimizer state are
    fp32 whatever it is)."""

    name: str
    """What --precision calls it."""
    bytes: int
    """Bytes of one parameter, gradient or activation element."""
    torch_dtype: str
    """Its torch dtype, ``torch.<torch_dtype>``."""
    loss_scaling: bool
    """Gradients need dynamic loss scaling (fp16's narrow exponent range)."""


#: Every compute precision, by name: fp32 (the reference), then the 16-bit ones.
PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", 4, "float32", loss_scaling=False),
    Precision("bf16", 2, "bfloat16", loss_scaling=False),
    Precision("fp16", 2, "float16", loss_scaling=True),
)}


def precision_of(name: str) -> Precision:
    """The precision called ``name``; a ValueError naming the ones there are otherwise."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}; expected one of "
                         f"{', '.join(PRECISIONS)}") from None


def compute_dtype(precision: str) -> torch.dtype:
    """The torch dtype for a precision name (``fp32``, ``bf16`` or ``fp16``)."""
    import torch

    return getattr(torch, precision_of(precision).torch_dtype)


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
