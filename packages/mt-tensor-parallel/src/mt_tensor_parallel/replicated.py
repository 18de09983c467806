"""Replicated parameters with partial gradients: summed in every backward, or once per step.

Some replicated parameters meet only this rank's share of the work, so each rank's gradient
is a partial sum over the tensor-parallel group: the LayerNorm / RMSNorm weights and the
row-parallel bias under sequence parallelism (this rank's sequence slice), the position rows
under sequence parallelism, a replicated key/value projection (this rank's head). By default
the modules use them through :func:`~mt_tensor_parallel.copy_to_tp`, which all-reduces the
gradient in every micro-batch's backward: one small collective per parameter per
micro-batch (in a TP 4 + SP run of the correctness contract, 1,080 of its 2,759
collectives).

:func:`defer_replicated_grads` switches the modules to use those parameters as they are and
returns them: the partial gradients accumulate locally over the micro-batches, and whoever
steps the optimizer sums them over the group once per step, in one bucket (mt-zero's
``ZeroOptimizer(partial_params=..., partial_group=...)``), as Megatron-LM does.
"""

from __future__ import annotations

from torch import nn

__all__ = ["defer_replicated_grads", "partial_grad_params"]


def partial_grad_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters of ``model`` whose gradient on this rank is a partial sum
    over the tensor-parallel group (by name, each parameter once, in module order)."""
    found: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        names = getattr(module, "partial_grad_names", None)
        for name in names() if callable(names) else ():
            param = module.get_parameter(name)
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                found.append((f"{prefix}.{name}" if prefix else name, param))
    return found


def defer_replicated_grads(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Use every partially-summed replicated parameter of ``model`` without a per-backward
    all-reduce; returns them (:func:`partial_grad_params`): the caller must sum their
    gradients over the tensor-parallel group before every optimizer step."""
    for module in model.modules():
        names = getattr(module, "partial_grad_names", None)
        if callable(names) and names():
            module.defer_grad_reduce = True
    return partial_grad_params(model)
