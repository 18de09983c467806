"""What each training engine does not support, checked when a run is resolved (pure).

Each engine names the options it refuses, each with a message saying what to use instead;
:func:`unsupported` is what :func:`mt_pretrain.config.resolve.resolve` asks. Also the
engines' traits the resolver needs before anything is built.
"""

from __future__ import annotations

from mt_model import GPTConfig
from mt_pretrain.config.schema import PretrainConfig

__all__ = ["CHECKPOINT_HAS_MODEL", "deepspeed_unsupported", "unsupported"]

#: Whether an engine's checkpoints carry mt's meta.json (the model config): then --load takes
#: the architecture from the checkpoint. DeepSpeed's own files do not.
CHECKPOINT_HAS_MODEL = {"mt": True, "deepspeed": False}


def deepspeed_unsupported(config: PretrainConfig) -> list[str]:
    """What --engine deepspeed does not support (mt's own engine does), one message each."""
    par, problems = config.parallel, []
    if par.pp > 1 and par.schedule != "1f1b":
        problems.append(f"--engine deepspeed with --pp {par.pp} runs DeepSpeed's own 1F1B "
                        f"schedule; --schedule {par.schedule} needs --engine mt")
    if par.zero_stage == 0:
        problems.append("--engine deepspeed --zero-stage 0 does not train like one process: "
                        "DeepSpeed reports no gradient norm there, clips per pipeline stage, "
                        "and its bf16 path is 0.3% off at step 2 on 2 ranks; use "
                        "--zero-stage 1 (the same memory with one data-parallel rank)")
    if par.precision == "fp16":
        problems.append("--engine deepspeed supports --precision fp32 or bf16, got fp16; "
                        "use --engine mt for fp16 with loss scaling")
    if par.activation_checkpointing:
        problems.append("--activation-checkpointing is not supported with --engine deepspeed "
                        "(the engine runs the plain forward); use --engine mt")
    if par.compile:
        problems.append("--compile is not supported with --engine deepspeed (DeepSpeed "
                        "runs the model); use --engine mt")
    if config.train.rampup_start is not None:
        problems.append(f"--rampup-start {config.train.rampup_start}: batch-size ramp-up is "
                        "not supported with --engine deepspeed (its gradient accumulation "
                        "steps are fixed)")
    return problems


def unsupported(config: PretrainConfig) -> list[str]:
    """Why ``config``'s engine cannot run it (empty: it can). mt's own engine refuses its
    few limits in ParallelArgs already."""
    return deepspeed_unsupported(config) if config.parallel.engine == "deepspeed" else []


def architecture_unsupported(gpt: GPTConfig, config: PretrainConfig) -> list[str]:
    """Why the model's architecture cannot run with ``config``'s engine (empty: it can).
    mt's engine runs every mt-model architecture at any layout; the DeepSpeed engine runs
    the GPT-2 block."""
    if gpt.architecture == "gpt2" or config.parallel.engine != "deepspeed":
        return []
    return [f"--engine deepspeed trains the GPT-2 block, not this architecture "
            f"({gpt.architecture}); use --engine mt"]
