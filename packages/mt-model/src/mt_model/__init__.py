"""mt_model: GPT configs (tiny .. MT-NLG 530B), a plain single-device GPT, deterministic
per-parameter init, and analytic parameter / FLOP counts.

The model is ordinary PyTorch and never imports ``torch.distributed``; parallelism is
applied from outside by other mt packages using the module names documented in
:mod:`mt_model.gpt`.
"""

from mt_model.config import PRESETS, GPTConfig, GPTConfigError, preset
from mt_model.gpt import GPT, MLP, Attention, Block, CoreAttention, Embedding, LMHead, LMLoss
from mt_model.init import init_gpt_, init_parameter, init_std_for, parameter_seed
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

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "MLP",
    "PRESETS",
    "TIED_WEIGHT",
    "Attention",
    "Block",
    "CoreAttention",
    "Embedding",
    "GPTConfig",
    "GPTConfigError",
    "LMHead",
    "LMLoss",
    "__version__",
    "block_matmul_parameters",
    "count_block_parameters",
    "count_parameters",
    "gradient_free_slices",
    "init_gpt_",
    "init_parameter",
    "init_std_for",
    "model_flops_per_iteration",
    "model_flops_per_token_training",
    "parameter_seed",
    "parameter_stages",
    "preset",
    "tflops_per_gpu",
]
