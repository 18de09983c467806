"""Activation recomputation, one layer at a time: full or selective.

**Full**: a layer keeps only its input during forward and recomputes its inner activations
in backward (``torch.utils.checkpoint`` in its non-reentrant form, which works with inputs
that do not require grad, keyword arguments and nested autograd functions).

**Selective**: every matrix product and the attention core keep what they save, and the
outputs of the cheap, memory-heavy modules (:data:`RECOMPUTED`: the norms and the activation
functions) are not kept: where autograd saves one (the next matmul's input, a product's
operand) it saves how to make it again instead, the module and its input, which something
else keeps anyway (the module's own backward saves it). Backward recomputes the output
when it needs it, with the same kernel on the same input: the same bits. A GPT-2 layer keeps
20 of its 32 ``sbh`` 16-bit bytes (norm outputs 2 + 2, the GeLU output 8 recomputed; see
mt-plan), and no matmul runs twice. A tensor made from such an output by another op (the
gathered input of a grouped-query key/value projection replicated over a sequence-parallel
TP group) is kept as it is. A module whose
``selective_checkpoint`` attribute is true when the layer runs (mt-model's attention core
with attention dropout, where the unfused kernel keeps [b, n, s, s] scores, probabilities
and mask) is recomputed whole, as full recomputation would: only its inputs are kept, and
its dropout masks are drawn again from the same generator state.

Dropout masks in the recomputation: torch restores its default generator (CPU, and CUDA) for
the recomputation, but not generators owned by other code (a tensor-parallel RNG tracker's
streams). ``enter(i)``, called at the start of layer ``i`` inside the recomputed function,
closes that gap: when it re-seeds every generator from the layer's identity (as
``mt_tensor_parallel.KeyedRNG.enter`` does), the recomputation draws exactly the masks of the
forward, whatever generators the layer uses. Selective recomputation runs a random op again
only inside a ``selective_checkpoint`` module: ``torch.utils.checkpoint`` restores the
default generator's state around it (attention dropout draws from that generator).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

__all__ = ["RECOMPUTE_MODES", "RECOMPUTED", "recompute_mode", "run_layers"]

#: What a layer keeps for backward: everything, all but the cheap modules' outputs, its input.
RECOMPUTE_MODES = ("none", "selective", "full")
#: The modules whose outputs selective recomputation makes again in backward, with any
#: module whose ``recompute_output`` attribute is true (mt-tensor-parallel's
#: sequence-parallel norms). Each one's backward keeps its input, so a recipe holds nothing
#: that is not kept anyway (ReLU and Tanh keep their output: not here).
RECOMPUTED: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm, nn.GELU, nn.SiLU)


def recompute_mode(checkpoint: bool | str) -> str:
    """A mode of :data:`RECOMPUTE_MODES` from a mode or a flag (True: full, False: none)."""
    mode = ("full" if checkpoint else "none") if isinstance(checkpoint, bool) else checkpoint
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute {checkpoint!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    return mode


def _entered(layer: nn.Module, enter: Callable[[int], None], index: int,
             x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` preceded by ``enter(index)``: one function for the checkpoint."""
    enter(index)
    return layer(x)


class _Recipe:
    """How to make a saved tensor again: ``module(input)``, viewed as the saved tensor was."""

    __slots__ = ("module", "input", "size", "stride", "offset")

    def __init__(self, module: nn.Module, inp: torch.Tensor, saved: torch.Tensor,
                 out: torch.Tensor) -> None:
        self.module, self.input = module, inp
        self.size, self.stride = saved.size(), saved.stride()
        self.offset = saved.storage_offset() - out.storage_offset()

    def make(self) -> torch.Tensor:
        with torch.no_grad():
            out = self.module(self.input)
        return out.as_strided(self.size, self.stride, out.storage_offset() + self.offset)


class _Selective:
    """While a layer runs forward: note its cheap modules' outputs, and save a
    :class:`_Recipe` in place of any tensor autograd saves that is (a view of) one."""

    def __init__(self, layer: nn.Module) -> None:
        self.modules = [m for m in layer.modules() if isinstance(m, RECOMPUTED)
                        or getattr(m, "recompute_output", False)]
        self.checkpointed = [m for m in layer.modules()
                             if getattr(m, "selective_checkpoint", False)]
        # storage pointer -> (module, input, weak output, version): the weak reference tells
        # a live output from a freed one whose memory a later tensor reuses; the version, an
        # output changed in place since (its recipe would give the old values).
        self.outputs: dict[int, tuple[nn.Module, torch.Tensor, Any, int]] = {}

    def _note(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if (len(args) == 1 and isinstance(args[0], torch.Tensor)
                and isinstance(out, torch.Tensor) and out.is_contiguous()):
            self.outputs[out.untyped_storage().data_ptr()] = (
                module, args[0], weakref.ref(out), out._version)

    def pack(self, saved: torch.Tensor) -> Any:
        if saved.layout != torch.strided or saved.device.type == "meta":
            return saved
        entry = self.outputs.get(saved.untyped_storage().data_ptr())
        if entry is None:
            return saved
        module, inp, ref, version = entry
        out = ref()
        if (out is None or out._version != version or out.dtype != saved.dtype
                or out.untyped_storage().data_ptr() != saved.untyped_storage().data_ptr()):
            return saved
        return _Recipe(module, inp, saved, out)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.make() if isinstance(packed, _Recipe) else packed

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        handles = [m.register_forward_hook(self._note) for m in self.modules]
        for module in self.checkpointed:  # an instance attribute, removed below
            module.forward = partial(_checkpoint, type(module).forward.__get__(module),
                                     use_reentrant=False)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return fn(x)
        finally:
            for handle in handles:
                handle.remove()
            for module in self.checkpointed:
                del module.forward
            self.outputs.clear()


def run_layers(layers: Sequence[nn.Module], x: torch.Tensor, checkpoint: bool | str,
               enter: Callable[[int], None] | None = None) -> torch.Tensor:
    """Apply ``layers`` in order to ``x``. ``checkpoint``: a mode of
    :data:`RECOMPUTE_MODES` (True: full, False: none); recomputation happens only when
    autograd is recording (under ``no_grad`` the layers just run).

    ``enter(i)``, if given, runs before layer ``i`` (its position in ``layers``), in the
    forward and again in the layer's full recomputation.
    """
    mode = recompute_mode(checkpoint) if torch.is_grad_enabled() else "none"
    for i, layer in enumerate(layers):
        fn: Callable[[torch.Tensor], torch.Tensor] = layer
        if enter is not None:
            if mode == "full":
                x = _checkpoint(partial(_entered, layer, enter, i), x, use_reentrant=False)
                continue
            enter(i)
        if mode == "full":
            x = _checkpoint(layer, x, use_reentrant=False)
        elif mode == "selective":
            x = _Selective(layer).run(fn, x)
        else:
            x = fn(x)
    return x
