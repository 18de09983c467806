"""Deterministic, per-parameter initialisation (MT-NLG recipe).

Every parameter draws its values from its own generator, seeded by a stable hash of
``(seed, name)``. A parameter's initial values therefore do not depend on the order in
which modules were built, on how many layers a pipeline stage holds, on the device the
model lives on, or on torch's global RNG: a sharded run can materialise exactly the
values of the unsharded reference by slicing ``init_parameter(name, full_shape, ...)``.
Values are always drawn on CPU in float32 and then cast, so they are bit-identical
across devices and the same up to rounding across dtypes.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence

import torch
from torch import nn

from mt_model.config import GPTConfig

__all__ = ["init_parameter", "init_gpt_", "parameter_seed", "init_std_for"]

# Roles are recognised from the canonical GPT parameter names (a contract shared with the
# tensor-parallel plan and the checkpoint converters). A leading prefix such as "module."
# is tolerated for recognising the role, but it is part of the hashed name.
_ONES = re.compile(r"(?:^|\.)(?:ln1|ln2|ln_f)\.weight$")
_ZEROS = re.compile(
    r"(?:^|\.)(?:(?:ln1|ln2|ln_f)|attn\.(?:qkv|q|kv|proj)|mlp\.(?:fc|proj))\.bias$"
)
_OUTPUT_PROJ = re.compile(r"(?:^|\.)(?:attn|mlp)\.proj\.weight$")
_NORMAL = re.compile(
    r"(?:^|\.)(?:embed\.(?:tokens|positions)|attn\.(?:qkv|q|kv)|mlp\.fc|head)\.weight$")


def parameter_seed(seed: int, name: str) -> int:
    """Stable 63-bit generator seed for parameter ``name`` under run seed ``seed``.

    Uses SHA-256, never Python's salted ``hash()``, so it is the same in every process.
    """
    digest = hashlib.sha256(f"mt-model:{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_std_for(name: str, config: GPTConfig) -> float | None:
    """Std of the normal init for ``name``; ``None`` for constant-initialised parameters.

    Raises ``ValueError`` for a name that is not a GPT parameter, so a renamed module can
    never silently fall back to some default init.
    """
    if _ONES.search(name) or _ZEROS.search(name):
        return None
    std = float(config.init_std)
    if _OUTPUT_PROJ.search(name):
        # Residual-branch outputs are summed n_layers * 2 times; scaling keeps the
        # residual stream's variance independent of depth (GPT-2, Megatron).
        return std / math.sqrt(2.0 * config.n_layers) if config.scaled_output_init else std
    if _NORMAL.search(name):
        return std
    raise ValueError(f"init_parameter: {name!r} is not a known GPT parameter name")


def init_parameter(
    name: str,
    shape: Sequence[int] | torch.Size,
    config: GPTConfig,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Initial value of the *full* (unsharded) parameter ``name``: a new CPU tensor.

    Pure: depends only on the arguments. LayerNorm weights are 1, all biases 0, every other
    weight normal(0, init_std), with attn.proj / mlp.proj weights using
    ``init_std / sqrt(2 * n_layers)`` when ``config.scaled_output_init``.
    """
    shape = torch.Size(shape)
    if _ONES.search(name):
        return torch.ones(shape, dtype=dtype)
    std = init_std_for(name, config)
    if std is None:
        return torch.zeros(shape, dtype=dtype)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(parameter_seed(seed, name))
    values = torch.empty(shape, dtype=torch.float32)
    values.normal_(mean=0.0, std=std, generator=generator)
    return values.to(dtype)


@torch.no_grad()
def init_gpt_(model: nn.Module, seed: int, config: GPTConfig | None = None) -> nn.Module:
    """Initialise every parameter of ``model`` in place with :func:`init_parameter`.

    ``config`` defaults to ``model.config``. Works on any device (including a model built on
    the meta device and then materialised with ``model.to_empty(device=...)``) and any dtype.
    Tied parameters are initialised once. Returns ``model`` for chaining.
    """
    config = config if config is not None else getattr(model, "config", None)
    if not isinstance(config, GPTConfig):
        raise TypeError("init_gpt_ needs a GPTConfig: pass config= or give the model .config")
    for name, param in model.named_parameters():
        if param.is_meta:
            raise ValueError(
                f"init_gpt_: parameter {name!r} is on the meta device; "
                "call model.to_empty(device=...) first"
            )
        values = init_parameter(name, param.shape, config, seed)
        param.copy_(values.to(device=param.device, dtype=param.dtype))
    return model
