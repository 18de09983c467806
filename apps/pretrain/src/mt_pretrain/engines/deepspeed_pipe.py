"""`--engine deepspeed` with pipeline stages: mt's stage inside DeepSpeed's ``PipelineModule``.

The layers DeepSpeed runs are mt's own modules, already tensor-parallel (mt's TP layers over
mt's TP group) and initialized by mt's per-parameter init by name, so the weights are those
of the one-process model whatever the layout. The layer list is

    [embed (tied "embed"), blocks.0 .. blocks.{L-1}, final norms..., head (tied "embed")]

and the partition is mt's stage plan (first stage: embedding + its blocks; last stage: its
blocks + final norm + head), set explicitly instead of DeepSpeed's own partitioners. Layers
of other stages are never built here (placeholders without parameters). The tied embedding
is DeepSpeed's ``TiedLayerSpec``: on the first stage the tied module is mt's ``embed``
(tokens + positions), on the last stage mt's copy of ``embed.tokens``, tied through
``tokens.weight``; DeepSpeed all-reduces its gradient over the first/last stage pair (mt's
embedding group) and counts it once in the gradient norm.

DeepSpeed builds its process groups from :func:`mt_zero.deepspeed_mpu.pipe_topology`, whose
rank order is mt's; :func:`build_pipeline_engine` checks the groups match mt's rank for rank.
Tensor-sliced parameters are marked ``model_parallel`` so DeepSpeed's ZeRO-1 gradient norm
counts them on every TP rank and replicated ones on TP rank 0 only.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from mt_dist import ParallelGroups
from mt_pipeline import ModelLayout, PipelineStage
from mt_pretrain.config.resolve import RunPlan
from mt_pretrain.data.inputs import to_batch
from mt_zero.deepspeed_mpu import grid_mismatches, pipe_topology

__all__ = ["build_pipeline_module", "deepspeed_names", "layer_parts", "micro_batches"]

TIE_KEY = "embed"


class _Shared(nn.Module):
    """Hands an already built (mt-initialized) module to DeepSpeed's ``TiedLayerSpec``,
    which only knows how to build modules from a class and arguments."""

    def __init__(self, inner: nn.Module | None) -> None:
        super().__init__()
        if inner is None:
            raise RuntimeError("a tied layer of another pipeline stage was built here")
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _OtherStage(nn.Module):
    """Stands for a layer that lives on another pipeline stage (never called here)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a layer of another pipeline stage was called")


def _head(head: nn.Module, weight: str, tied: _Shared, hidden: torch.Tensor) -> torch.Tensor:
    """mt's (possibly vocab-parallel) head with this stage's copy of the tied weight."""
    return head(hidden, tied.inner.get_parameter(weight))


def layer_parts(plan: RunPlan, layout: ModelLayout) -> list[int]:
    """DeepSpeed's ``parts`` (layer index where each stage starts, then the layer count) for
    the layer list above and mt's stage plan (one chunk per stage)."""
    stages = plan.stages.stages
    if any(len(s.chunks) != 1 for s in stages):
        raise ValueError("DeepSpeed pipelines take one model chunk per stage (no virtual "
                         "stages)")
    total = 1 + plan.gpt.n_layers + len(layout.final) + 1
    return [0, *(1 + s.chunks[0][0] for s in stages[1:]), total]


def deepspeed_names(names: Iterable[str], n_layers: int, layout: ModelLayout) -> dict[str, str]:
    """The name DeepSpeed's ``PipelineModule`` gives each of mt's parameters ``names`` (of
    every stage; the layer list above): ``embed.X`` -> ``tied_modules.embed.inner.X``,
    ``blocks.i.X`` -> ``{i + 1}.X``, the k-th final module's ``X`` -> ``{n_layers + 1 + k}.X``
    (the head holds only the tied weight)."""
    out = {}
    for name in names:
        module, _, rest = name.partition(".")
        if module == layout.embed:
            out[name] = f"tied_modules.{TIE_KEY}.inner.{rest}"
        elif module == layout.layers:
            index, _, leaf = rest.partition(".")
            out[name] = f"{int(index) + 1}.{leaf}"
        elif module in layout.final:
            out[name] = f"{n_layers + 1 + layout.final.index(module)}.{rest}"
        else:
            raise ValueError(f"{name}: no layer of the DeepSpeed pipeline holds it")
    return out


def _module_class() -> Any:
    """``PipelineModule`` taking its partition as ``partition_method="parts:0,3,5"``."""
    from deepspeed.pipe import PipelineModule  # pants: no-infer-dep (optional)

    class MtPipelineModule(PipelineModule):  # type: ignore[misc]
        def _partition_layers(self, method: str = "uniform") -> None:
            if not method.startswith("parts:"):
                super()._partition_layers(method)
                return
            self.parts = [int(v) for v in method.split(":", 1)[1].split(",")]
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

        def _synchronize_tied_weights(self) -> None:
            # DeepSpeed broadcasts the tied weight in place; outside no_grad autograd
            # records the broadcast on the leaf parameter and warns in every backward.
            with torch.no_grad():
                super()._synchronize_tied_weights()

    return MtPipelineModule


def build_pipeline_module(stage: PipelineStage, plan: RunPlan, groups: ParallelGroups,
                          styles: dict[str, str]) -> nn.Module:
    """DeepSpeed ``PipelineModule`` holding exactly this rank's mt modules (collective)."""
    from deepspeed.pipe import TiedLayerSpec  # pants: no-infer-dep (optional)

    layout = stage.layout
    parts = layer_parts(plan, layout)
    if layout.tied_weight is None or not layout.tied_weight.startswith(layout.embed + "."):
        raise ValueError(f"the DeepSpeed pipeline ties the head to a weight inside "
                         f"{layout.embed!r}, got tied_weight {layout.tied_weight!r}")
    weight = layout.tied_weight[len(layout.embed) + 1:]  # "tokens.weight" inside embed
    first, last = groups.is_first_stage, groups.is_last_stage
    embed = stage.get_submodule(layout.embed) if first or last else None
    blocks = stage.get_submodule(layout.layers)
    layers: list[Any] = [TiedLayerSpec(TIE_KEY, _Shared, embed if first else None,
                                       tied_weight_attr=["inner." + weight])]
    for i in range(plan.gpt.n_layers):
        layers.append(blocks[str(i)] if str(i) in blocks else _OtherStage())
    for name in layout.final:
        layers.append(stage.get_submodule(name) if last else _OtherStage())
    head = stage.get_submodule(layout.head) if last and layout.head else None
    layers.append(TiedLayerSpec(TIE_KEY, _Shared, embed if last else None,
                                forward_fn=partial(_head, head, weight),
                                tied_weight_attr=["inner." + weight]))
    if len(layers) != parts[-1]:
        raise RuntimeError(f"{len(layers)} pipeline layers but the partition {parts} "
                           f"covers {parts[-1]}")
    for name, param in stage.named_parameters():
        # DeepSpeed's norm: sliced parameters count on every TP rank, the rest on TP rank 0.
        param.model_parallel = styles.get(name, "replicate") != "replicate"  # type: ignore
    loss = stage.get_submodule(layout.loss) if last else None
    module = _module_class()(
        layers=layers, topology=pipe_topology(plan.topology), loss_fn=loss,
        partition_method="parts:" + ",".join(str(p) for p in parts))
    problems = grid_mismatches(module.mpu(), groups)
    if problems:
        raise RuntimeError("DeepSpeed's pipeline groups differ from mt's: " + "; ".join(problems))
    mine = {id(p): name for name, p in stage.named_parameters()}
    theirs = {id(p): name for name, p in module.named_parameters()}
    if mine.keys() != theirs.keys():
        raise RuntimeError(f"DeepSpeed's stage holds {len(theirs)} parameters, mt's stage "
                           f"{len(mine)}; they must be the same tensors")
    named = deepspeed_names(mine.values(), plan.gpt.n_layers, layout)
    wrong = [(n, theirs[i]) for i, n in mine.items() if named[n] != theirs[i]]
    if wrong:  # checkpoints record DeepSpeed's names; converters map them by this rule
        ours, ds_name = wrong[0]
        raise RuntimeError(f"DeepSpeed names {ours!r} {ds_name!r}, not {named[ours]!r}")
    return module


def micro_batches(micro: list[Any], device: torch.device) -> list[tuple[torch.Tensor,
                                                                        torch.Tensor]]:
    """(inputs, labels) per micro-batch, as DeepSpeed's ``train_batch`` reads them."""
    out = []
    for array in micro:
        batch = to_batch([array]).to(device)
        out.append((batch[:, :-1], batch[:, 1:]))
    return out
