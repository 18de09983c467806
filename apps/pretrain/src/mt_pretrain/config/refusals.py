"""What each training engine cannot run, and why, each option with what to use instead: checked
by the resolver before anything is built (:func:`unsupported`)."""

from __future__ import annotations

from collections.abc import Callable

from mt_model import GPTConfig
from mt_pretrain.config.engines import ENGINES, REFERENCE, EngineSpec
from mt_pretrain.config.schema import PretrainConfig
from mt_zero.precision import PRECISIONS

__all__ = ["REFUSALS", "engine_of", "unsupported"]


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
    if config.checkpoint.async_save:
        problems.append("--async-save is not supported with --engine deepspeed (its engine "
                        "writes its own checkpoints, in the foreground); use --engine mt")
    if config.train.rampup_start is not None:
        problems.append(f"--rampup-start {config.train.rampup_start}: batch-size ramp-up is "
                        "not supported with --engine deepspeed (its gradient accumulation "
                        "steps are fixed)")
    return problems


#: Why each engine cannot run a config (one message per option, empty: it can).
REFUSALS: dict[str, Callable[[PretrainConfig], list[str]]] = {
    "mt": _mt_refuses, "deepspeed": _deepspeed_refuses}


def engine_of(config: PretrainConfig) -> EngineSpec:
    """The engine ``config`` chose."""
    return ENGINES[config.parallel.engine]


def unsupported(config: PretrainConfig, gpt: GPTConfig | None = None) -> list[str]:
    """Why ``config``'s engine cannot run it (with ``gpt``, its architecture too); empty: it
    can."""
    spec = engine_of(config)
    problems = REFUSALS[spec.name](config)
    if gpt is not None and spec.architectures and gpt.architecture not in spec.architectures:
        problems.append(f"--engine {spec.name} trains the {', '.join(spec.architectures)} "
                        f"block, not this architecture ({gpt.architecture}); use --engine "
                        f"{REFERENCE}")
    return problems
