"""Full activation checkpointing, one layer at a time.

With checkpointing a layer keeps only its input during forward and recomputes its inner
activations in backward (``torch.utils.checkpoint`` in its non-reentrant form, which works
with inputs that do not require grad, keyword arguments and nested autograd functions).
The RNG state of the default generator is restored for the recomputation, so dropout masks
match; generators owned by other code (e.g. a tensor-parallel RNG tracker) are not.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

__all__ = ["run_layers"]


def run_layers(layers: Iterable[nn.Module], x: torch.Tensor, checkpoint: bool) -> torch.Tensor:
    """Apply ``layers`` in order to ``x``; with ``checkpoint``, each layer is recomputed in
    backward (only when autograd is recording; under ``no_grad`` it just runs)."""
    recompute = checkpoint and torch.is_grad_enabled()
    for layer in layers:
        if recompute:
            x = _checkpoint(layer, x, use_reentrant=False)
        else:
            x = layer(x)
    return x
