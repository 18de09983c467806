"""Full activation checkpointing, one layer at a time.

With checkpointing a layer keeps only its input during forward and recomputes its inner
activations in backward (``torch.utils.checkpoint`` in its non-reentrant form, which works
with inputs that do not require grad, keyword arguments and nested autograd functions).

Dropout masks in the recomputation: torch restores its default generator (CPU, and CUDA) for
the recomputation, but not generators owned by other code (a tensor-parallel RNG tracker's
streams). ``enter(i)``, called at the start of layer ``i`` inside the recomputed function,
closes that gap: when it re-seeds every generator from the layer's identity (as
``mt_tensor_parallel.KeyedRNG.enter`` does), the recomputation draws exactly the masks of the
forward, whatever generators the layer uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

__all__ = ["run_layers"]


def _entered(layer: nn.Module, enter: Callable[[int], None], index: int,
             x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` preceded by ``enter(index)``: one function for the checkpoint."""
    enter(index)
    return layer(x)


def run_layers(layers: Sequence[nn.Module], x: torch.Tensor, checkpoint: bool,
               enter: Callable[[int], None] | None = None) -> torch.Tensor:
    """Apply ``layers`` in order to ``x``; with ``checkpoint``, each layer is recomputed in
    backward (only when autograd is recording; under ``no_grad`` it just runs).

    ``enter(i)``, if given, runs before layer ``i`` (its position in ``layers``), in the
    forward and again in the layer's recomputation.
    """
    recompute = checkpoint and torch.is_grad_enabled()
    for i, layer in enumerate(layers):
        if enter is not None:
            if recompute:
                x = _checkpoint(partial(_entered, layer, enter, i), x, use_reentrant=False)
                continue
            enter(i)
        x = _checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
    return x
