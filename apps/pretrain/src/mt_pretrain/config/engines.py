"""The training engines a run can use (`--engine`), each defined once with its traits: the one
registry every part of the app asks (pure data: the implementations are imported only when a
rank builds the engine a run chose).

An engine's traits say what a run needs to know before anything is built (the architectures it
trains, whether its checkpoints carry the model, its default loss) and where its
implementation lives; the options each refuses are :mod:`mt_pretrain.config.refusals`', what
the contract matrix needs of it is the matrix's (:data:`mt_pretrain.contract.matrix.TRAITS`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["ENGINES", "REFERENCE", "EngineSpec"]


@dataclass(frozen=True)
class EngineSpec:
    """One training engine and its traits."""

    name: str
    """What --engine calls it."""
    implementation: str
    """``module:Class`` of its :class:`~mt_pretrain.engines.base.Engine` (``Class.create``
    builds it on a rank)."""
    checkpoint_has_model: bool
    """Its checkpoints carry mt's meta.json (the model config): --load takes the
    architecture from the checkpoint."""
    chunked_loss: bool
    """It computes the loss from the final hidden states, chunk by chunk, with the head (the
    default of --chunked-loss): else the logits, then the loss."""
    architectures: tuple[str, ...] | None
    """The mt-model architectures it trains (None: every one)."""

    def load(self) -> Any:
        """The engine class (imports the implementation, and what it needs)."""
        module, name = self.implementation.split(":")
        return getattr(importlib.import_module(module), name)


#: Every engine, by --engine name; the first is the reference the others are compared with.
ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("mt", "mt_pretrain.engines.mt:MTEngine", checkpoint_has_model=True,
               chunked_loss=True, architectures=None),
    # Optional dependency: DeepSpeed reads its environment at import (set inside).
    EngineSpec("deepspeed", "mt_pretrain.engines.deepspeed_engine:DeepSpeedEngine",
               checkpoint_has_model=False, chunked_loss=False, architectures=("gpt2",)),
)}
REFERENCE = next(iter(ENGINES))
