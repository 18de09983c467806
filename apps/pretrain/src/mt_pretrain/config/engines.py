"""The training engines a run can use (`--engine`), each defined once with its traits: the one
registry every part of the app asks (pure; the implementations are imported only when a rank
builds the engine a run chose).

An engine's traits say what the resolver checks before anything is built (the options it
refuses, each with what to use instead; the architectures it trains; whether its checkpoints
carry the model), what the contract matrix needs (whether it draws dropout from mt's keyed
streams, whether it reduces 16-bit gradients its own way), and where its implementation lives.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mt_zero.precision import PRECISIONS

if TYPE_CHECKING:
    from mt_model import GPTConfig
    from mt_pretrain.config.schema import PretrainConfig

__all__ = ["ENGINES", "REFERENCE", "EngineSpec", "engine_of", "unsupported"]


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
    keyed_dropout: bool
    """It draws dropout masks from mt's keyed streams, equal at every layout."""
    own_reduction: bool
    """It reduces 16-bit gradients its own way (the contract allows a wider 16-bit floor)."""
    start_seconds: float
    """Extra seconds it takes to start a run on a 2-core CPU (the contract matrix's costs)."""
    tag: str
    """Its mark in contract case names ("" for the reference engine)."""
    chunked_loss: bool
    """It computes the loss from the final hidden states, chunk by chunk, with the head (the
    default of --chunked-loss): else the logits, then the loss."""
    refuses: Callable[[PretrainConfig], list[str]]
    """Why it cannot run a config (one message per option, empty: it can)."""
    architectures: tuple[str, ...] | None
    """The mt-model architectures it trains (None: every one)."""

    def load(self) -> Any:
        """The engine class (imports the implementation, and what it needs)."""
        module, name = self.implementation.split(":")
        return getattr(importlib.import_module(module), name)


def _mt_refuses(config: PretrainConfig) -> list[str]:
    return []  # its few limits are checked by ParallelArgs itself


def _deepspeed_refuses(config: PretrainConfig) -> list[str]:
    par, problems = config.parallel, []
    if par.pp > 1 and par.schedule != "1f1b":
        problems.append(f"--engine deepspeed with --pp {par.pp} runs DeepSpeed's own 1F1B "
                        f"schedule; --schedule {par.schedule} needs --engine mt")
    if par.zero_stage == 0:
        problems.append("--engine deepspeed --zero-stage 0 does not train like one process: "
                        "DeepSpeed reports no gradient norm there, clips per pipeline stage, "
                        "and its bf16 path is 0.3% off at step 2 on 2 ranks; use "
                        "--zero-stage 1 (the same memory with one data-parallel rank)")
    if PRECISIONS[par.precision].loss_scaling:
        problems.append(f"--engine deepspeed runs no loss scaling, which --precision "
                        f"{par.precision} needs; use --engine mt for {par.precision}")
    if par.chunked_loss:
        problems.append("--chunked-loss is not supported with --engine deepspeed (DeepSpeed "
                        "runs the model to the logits; under ZeRO-3 the head's weight is "
                        "there only inside that forward); use --engine mt")
    if par.recompute_mode != "none":
        flag = ("--activation-checkpointing" if par.activation_checkpointing else
                f"--recompute {par.recompute_mode}")
        problems.append(f"{flag} is not supported with --engine deepspeed (the engine runs "
                        "the plain forward); use --engine mt")
    if par.compile:
        problems.append("--compile is not supported with --engine deepspeed (DeepSpeed "
                        "runs the model); use --engine mt")
    if par.cp > 1:
        problems.append(f"--cp {par.cp} is not supported with --engine deepspeed (its engines "
                        "reduce gradients over their own data-parallel group, not over the "
                        "context-parallel ranks); use --engine mt")
    if config.train.rampup_start is not None:
        problems.append(f"--rampup-start {config.train.rampup_start}: batch-size ramp-up is "
                        "not supported with --engine deepspeed (its gradient accumulation "
                        "steps are fixed)")
    return problems


#: Every engine, by --engine name; the first is the reference the others are compared with.
ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("mt", "mt_pretrain.engines.mt:MTEngine", checkpoint_has_model=True,
               keyed_dropout=True, own_reduction=False, start_seconds=0.0, tag="",
               chunked_loss=True, refuses=_mt_refuses, architectures=None),
    # Optional dependency: DeepSpeed reads its environment at import (set inside).
    EngineSpec("deepspeed", "mt_pretrain.engines.deepspeed_engine:DeepSpeedEngine",
               checkpoint_has_model=False, keyed_dropout=False, own_reduction=True,
               start_seconds=4.0, tag="ds", chunked_loss=False,
               refuses=_deepspeed_refuses, architectures=("gpt2",)),
)}
REFERENCE = next(iter(ENGINES))


def engine_of(config: PretrainConfig) -> EngineSpec:
    """The engine ``config`` chose."""
    return ENGINES[config.parallel.engine]


def unsupported(config: PretrainConfig, gpt: GPTConfig | None = None) -> list[str]:
    """Why ``config``'s engine cannot run it (with ``gpt``, its architecture too); empty: it
    can."""
    spec = engine_of(config)
    problems = spec.refuses(config)
    if gpt is not None and spec.architectures and gpt.architecture not in spec.architectures:
        problems.append(f"--engine {spec.name} trains the {', '.join(spec.architectures)} "
                        f"block, not this architecture ({gpt.architecture}); use --engine "
                        f"{REFERENCE}")
    return problems
