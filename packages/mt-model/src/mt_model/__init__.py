"""mt_model: GPT configs (tiny .. MT-NLG 530B), a plain single-device GPT, deterministic
per-parameter init, and analytic parameter / FLOP counts.

The model is ordinary PyTorch and never imports ``torch.distributed``; parallelism is
applied from outside by other mt packages using the module names documented in
:mod:`mt_model.gpt`. Configs and counts import without torch; the modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mt_model.config import PRESETS, GPTConfig, GPTConfigError, preset
from mt_model.params import (
    TIED_WEIGHT,
    block_matmul_parameters,
    count_block_parameters,
    count_parameters,
    gradient_free_slices,
    model_flops_per_iteration,
    model_flops_per_token_training,
    parameter_stages,
    tflops_per_gpu,
)

if TYPE_CHECKING:  # imported on first use (see __getattr__); named here for tools
    from mt_model.cache import KVCache, LayerCache
    from mt_model.decoding import (
        SEED_MAX,
        Completion,
        DecodeBatch,
        DecodeModel,
        DecodeRequest,
        PromptScores,
        Sampling,
        Token,
        WholeModel,
        generate,
        interleave,
    )
    from mt_model.gpt import (
        GPT,
        MLP,
        Attention,
        Block,
        CoreAttention,
        Embedding,
        LMHead,
        LMLoss,
        decoding_layout_,
    )
    from mt_model.init import init_gpt_, init_parameter, init_std_for, parameter_seed

__version__ = "0.1.0"

#: Names whose modules import torch (seconds): loaded on first use, so that configs and
#: counts (a planner, a command line's --help) never pay for torch.
_LAZY = {name: module for module, names in {
    "mt_model.gpt": ("GPT", "MLP", "Attention", "Block", "CoreAttention", "Embedding",
                     "LMHead", "LMLoss", "decoding_layout_"),
    "mt_model.init": ("init_gpt_", "init_parameter", "init_std_for", "parameter_seed"),
    "mt_model.cache": ("KVCache", "LayerCache"),
    "mt_model.decoding": ("Completion", "DecodeBatch", "DecodeModel", "PromptScores",
                          "DecodeRequest", "SEED_MAX", "Sampling", "Token", "WholeModel",
                          "generate", "interleave"),
}.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mt_model' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "GPT",
    "MLP",
    "PRESETS",
    "PromptScores",
    "TIED_WEIGHT",
    "Attention",
    "Block",
    "Completion",
    "CoreAttention",
    "DecodeBatch",
    "DecodeModel",
    "Embedding",
    "GPTConfig",
    "GPTConfigError",
    "KVCache",
    "LMHead",
    "LMLoss",
    "LayerCache",
    "DecodeRequest",
    "SEED_MAX",
    "Sampling",
    "Token",
    "WholeModel",
    "__version__",
    "block_matmul_parameters",
    "count_block_parameters",
    "count_parameters",
    "decoding_layout_",
    "generate",
    "gradient_free_slices",
    "init_gpt_",
    "init_parameter",
    "init_std_for",
    "interleave",
    "model_flops_per_iteration",
    "model_flops_per_token_training",
    "parameter_seed",
    "parameter_stages",
    "preset",
    "tflops_per_gpu",
]
