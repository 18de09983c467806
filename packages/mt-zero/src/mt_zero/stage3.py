"""ZeRO stage 3: gather a unit's parameters just before it runs, free them right after.

A *unit* is a module (the model itself is always the root unit); it owns the parameters in
its subtree that no inner unit owns. Module hooks drive the life cycle:

- forward pre-hook: gather the unit (waiting for a prefetch if one is in flight) and start
  gathering the next unit of the recorded forward order;
- forward hook: free the unit and, if its outputs need gradients, hook them so that the
  unit is gathered again when the gradient for its outputs arrives (pre-backward), with the
  unit before it prefetched;
- once backward produced all gradients of the unit (see :class:`~mt_zero.grad_sync.GradSync`)
  its parameters are freed again.

Parameters are freed by resizing the flat buffer's storage to zero, so every view (the
parameters, tensors autograd saved for backward) stays valid and is refilled in place by
the next gather. Only torch's public module and tensor hooks are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mt_zero.buckets import FlatBucket

__all__ = ["ParamGatherer", "assign_units", "default_units"]


def default_units(model: nn.Module) -> list[nn.Module]:
    """The root plus every module held in an ``nn.ModuleList`` (e.g. transformer blocks)."""
    units: list[nn.Module] = [model]
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            units.extend(m for m in module if m not in units)
    return units


def assign_units(
    model: nn.Module, units: Sequence[nn.Module], params: Sequence[nn.Parameter]
) -> list[int]:
    """For each parameter, the index in ``units`` of the unit that owns it.

    The owner is the smallest unit whose subtree contains every module that holds the
    parameter: a parameter shared by two sibling units (tied weights) goes to a common
    ancestor, so it is present whenever either runs. ``units[0]`` must be ``model``.
    """
    if not units or units[0] is not model:
        raise ValueError("units[0] must be the model itself (the root unit)")
    holders: dict[int, list[nn.Module]] = {id(p): [] for p in params}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in holders:
                holders[id(p)].append(module)
    subtrees = [{id(m) for m in unit.modules()} for unit in units]
    owners = []
    for p in params:
        held_by = holders[id(p)]
        best, best_size = 0, len(subtrees[0])
        for i, tree in enumerate(subtrees):
            if all(id(m) in tree for m in held_by) and len(tree) < best_size:
                best, best_size = i, len(tree)
        owners.append(best)
    return owners


class ParamGatherer:
    """Installs the stage-3 gather/free hooks on ``units``.

    Args:
        units: the modules (root first) whose buckets are in ``buckets``.
        buckets: ``buckets[i]`` holds the parameters owned by ``units[i]`` (``None`` if it
            owns none: its hooks are not installed).
        prefetch: start gathering the next unit (forward) or previous unit (backward)
            while the current one computes, using the order recorded in the first forward.
    """

    def __init__(
        self,
        units: Sequence[nn.Module],
        buckets: Sequence[FlatBucket | None],
        prefetch: bool = True,
    ) -> None:
        self.prefetch = prefetch
        self._buckets = [b for b in buckets if b is not None]
        self._order: list[FlatBucket] = []  # forward order, recorded once
        self._recording = True
        self._handles = []
        for unit, bucket in zip(units, buckets):
            if bucket is None:
                continue
            self._handles.append(unit.register_forward_pre_hook(self._pre_forward_hook(bucket)))
            self._handles.append(unit.register_forward_hook(self._post_forward_hook(bucket)))
        self._root = units[0]

    def remove_hooks(self) -> None:
        """Detach from the modules."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def free_all(self) -> None:
        """Release every gathered unit (e.g. before the optimizer step)."""
        for bucket in self._buckets:
            bucket.free()

    def gather_all(self) -> None:
        """Materialize every unit (collective): for evaluation or inspection outside hooks."""
        for bucket in self._buckets:
            bucket.start_gather()
        for bucket in self._buckets:
            bucket.wait_gather()

    def on_backward_done(self, bucket: FlatBucket) -> None:
        """Backward produced all of ``bucket``'s gradients: its parameters may go."""
        bucket.free()

    # ------------------------------------------------------------------------------ hooks
    def _neighbour(self, bucket: FlatBucket, step: int) -> FlatBucket | None:
        if not self.prefetch or self._recording or bucket not in self._order:
            return None
        i = self._order.index(bucket) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    def _pre_forward_hook(self, bucket: FlatBucket) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            if self._recording and bucket not in self._order:
                self._order.append(bucket)
            bucket.wait_gather()
            nxt = self._neighbour(bucket, +1)
            if nxt is not None:
                nxt.start_gather()

        return hook

    def _post_forward_hook(self, bucket: FlatBucket) -> Any:
        def hook(module: nn.Module, _args: Any, output: Any) -> None:
            bucket.free()
            if module is self._root:
                self._recording = False
            if torch.is_grad_enabled():
                for tensor in _tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._pre_backward_hook(bucket))

        return hook

    def _pre_backward_hook(self, bucket: FlatBucket) -> Any:
        def hook(_grad: torch.Tensor) -> None:
            bucket.wait_gather()
            prev = self._neighbour(bucket, -1)
            if prev is not None:
                prev.start_gather()

        return hook


def _tensors(value: Any) -> list[torch.Tensor]:
    """Tensors inside a (nested) tuple / list / dict output."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
