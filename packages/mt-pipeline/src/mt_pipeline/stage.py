"""One pipeline stage of a GPT-like model: its slice of layers, plus the ends it owns.

mt-pipeline does not import any model package. A model only has to follow a *layout*
(:class:`ModelLayout`, defaults = ``mt_model.GPT``'s module names): an input module
(token ids -> hidden), a container of layers (hidden -> hidden), final modules (hidden ->
hidden), a head (``head(hidden, tied_weight)`` -> logits) and a loss module
(``loss(logits, targets)`` -> scalar). :func:`build_stage` picks this stage's modules out
of a full (or meta, or tensor-parallel) model; the stage keeps the model's parameter names
(``blocks.5.attn.qkv.weight`` stays ``blocks.5.attn.qkv.weight``), so per-parameter init,
checkpoints and gradient checks address parameters exactly as in the unsplit model.

Tied embeddings: the first stage owns the input embedding, the last stage holds its own
copy of the module that owns the tied weight (same name, same initial values) for the head;
:meth:`PipelineStage.tied_parameters` lists the copy to sum over the embedding group.

Randomness: with a :class:`RegionRNG` (``build_stage(..., rng=...)``) and a micro-batch
``key`` passed to :meth:`PipelineStage.forward_chunk`, the stage calls ``rng.enter(key,
region)`` before the embedding (region 0) and before layer ``i`` (region ``i + 1``, ``i``
the layer's index in the whole model), also inside activation-checkpoint recomputation. An
rng that re-seeds its generators there makes dropout masks a function of (micro-batch,
layer): the same on any number of stages and replayed exactly by recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from mt_pipeline.checkpointing import run_layers
from mt_pipeline.partition import PartitionError, StagePlan

__all__ = ["DecodeCache", "ModelLayout", "PipelineStage", "RegionRNG", "build_stage"]


class DecodeCache(Protocol):
    """The key/value cache of a decoded batch, as a stage uses it (``mt_model.KVCache``)."""

    def positions(self, new: int, device: torch.device) -> torch.Tensor:
        """[b, new] positions of the next tokens."""

    def layer(self, index: int) -> Any:
        """What layer ``index`` of the whole model is called with."""

    def advance(self, new: int) -> None:
        """Mark the new tokens as cached (after every layer of this stage ran)."""


class RegionRNG(Protocol):
    """Seeds the random generators for one region of one micro-batch."""

    def enter(self, key: int, region: int) -> None:
        """Called before ``region`` (0: embedding, i + 1: layer i) of micro-batch ``key``."""


def _check_name(field: str, name: str) -> None:
    if not name or any(not part.isidentifier() for part in name.split(".")):
        raise ValueError(f"ModelLayout.{field} must be a dotted module path, got {name!r}")


@dataclass(frozen=True)
class ModelLayout:
    """Where a GPT-like model keeps its parts (module paths; defaults match ``mt_model.GPT``).

    Attributes:
        embed: input module, token ids [b, s] -> hidden [b, s, h] (first virtual stage).
        layers: an ``nn.ModuleList``/``Sequential`` of hidden -> hidden layers.
        final: modules applied in order after the last layer (e.g. the final LayerNorm).
        head: output module; called ``head(x, tied_weight)`` when ``tied_weight`` is set,
            else ``head(x)``; None means the final modules already give the logits.
        tied_weight: parameter path of the weight shared by ``embed`` and ``head``.
        loss: loss module, ``loss(logits, targets)`` -> scalar mean loss.
        fused_loss: compute the head and the loss in one where the loss module can
            (``loss.head_loss(head, hidden, targets, tied_weight)``: chunk by chunk, without
            the logits); else, and always for evaluation's logits, the head then the loss.
    """

    embed: str = "embed"
    layers: str = "blocks"
    final: tuple[str, ...] = ("ln_f",)
    head: str | None = "head"
    tied_weight: str | None = "embed.tokens.weight"
    loss: str = "loss_fn"
    fused_loss: bool = False

    def __post_init__(self) -> None:
        for field, name in (("embed", self.embed), ("layers", self.layers), ("loss", self.loss)):
            _check_name(field, name)
        for name in self.final:
            _check_name("final", name)
        if self.head is not None:
            _check_name("head", self.head)
        if self.tied_weight is not None:
            _check_name("tied_weight", self.tied_weight)
            if "." not in self.tied_weight:
                raise ValueError(
                    f"ModelLayout.tied_weight must name a parameter inside a module "
                    f"(e.g. 'embed.tokens.weight'), got {self.tied_weight!r}"
                )
            if self.head is None:
                raise ValueError("ModelLayout.tied_weight needs a head that takes the weight")

    @property
    def tied_module(self) -> str | None:
        """Path of the module owning the tied weight (e.g. ``embed.tokens``)."""
        return None if self.tied_weight is None else self.tied_weight.rsplit(".", 1)[0]


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` at dotted ``path`` under ``root``, creating plain containers."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        child = node._modules.get(name)
        if child is None:
            child = nn.Module()
            node.add_module(name, child)
        node = child
    if leaf in node._modules:
        raise ValueError(f"module path {path!r} is placed twice on this stage")
    node.add_module(leaf, module)


class PipelineStage(nn.Module):
    """The modules of one pipeline stage, run chunk by chunk by the executor.

    Local chunk ``c`` holds the layers ``plan.chunks[c]`` (virtual stage ``c * p + stage``).
    The first virtual stage starts with the embedding; the last ends with the final modules
    and the head and also owns the loss. Parameter names are those of the full model.
    """

    def __init__(self, model: nn.Module, plan: StagePlan, layout: ModelLayout,
                 rng: RegionRNG | None = None) -> None:
        super().__init__()
        self.plan, self.layout = plan, layout
        # Not a submodule: it holds generator states, not parameters.
        object.__setattr__(self, "rng", rng)
        layers = model.get_submodule(layout.layers)
        for start, stop in plan.chunks:
            if stop > len(layers):
                raise PartitionError(
                    f"stage {plan.stage} needs layers [{start}, {stop}) but "
                    f"{layout.layers!r} has {len(layers)}"
                )
        # Layers keyed by their global index keep full-model names: "blocks.5....".
        _place(self, layout.layers, nn.ModuleDict({str(i): layers[i] for i in plan.layers}))
        if plan.has_embedding:
            _place(self, layout.embed, model.get_submodule(layout.embed))
        if plan.has_head:
            for name in layout.final:
                _place(self, name, model.get_submodule(name))
            if layout.head is not None:
                _place(self, layout.head, model.get_submodule(layout.head))
            _place(self, layout.loss, model.get_submodule(layout.loss))
            tied = layout.tied_module
            if tied is not None and not plan.has_embedding:
                # The last stage's own copy of the tied weight (the caller's model object is
                # per process, so this is already a separate tensor from stage 0's).
                _place(self, tied, model.get_submodule(tied))

    @property
    def stage_index(self) -> int:
        """Pipeline stage index of this stage."""
        return self.plan.stage

    @property
    def num_chunks(self) -> int:
        """Number of local model chunks (virtual stages per stage)."""
        return len(self.plan.chunks)

    def is_first_chunk(self, chunk: int) -> bool:
        """True if local ``chunk`` is the first virtual stage (takes token ids)."""
        return self.plan.has_embedding and chunk == 0

    def is_last_chunk(self, chunk: int) -> bool:
        """True if local ``chunk`` is the last virtual stage (gives logits; owns the loss)."""
        return self.plan.has_head and chunk == self.num_chunks - 1

    def chunk_layers(self, chunk: int) -> list[nn.Module]:
        """The layers of local ``chunk`` in order."""
        start, stop = self.plan.chunks[chunk]
        layers = self.get_submodule(self.layout.layers)
        return [layers[str(i)] for i in range(start, stop)]

    def forward_chunk(self, chunk: int, x: torch.Tensor, checkpoint: bool | str = False,
                      key: int | None = None, head: bool = True) -> torch.Tensor:
        """Run local ``chunk`` on ``x`` (token ids for the first virtual stage, else hidden).

        Returns hidden states, or logits on the last virtual stage. ``checkpoint``: what each
        layer recomputes in backward instead of keeping (``"full"`` or True: everything,
        ``"selective"``: the norms' and activation functions' outputs, ``"none"`` or False;
        :func:`~mt_pipeline.checkpointing.run_layers`). ``key`` names the
        micro-batch for the stage's :class:`RegionRNG` (ignored without one). ``head=False``
        returns the last virtual stage's final hidden states (see :meth:`apply_head`).
        """
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk {chunk} outside 0..{self.num_chunks - 1}")
        rng = self.rng if key is not None else None
        if self.is_first_chunk(chunk):
            if rng is not None:
                rng.enter(key, 0)  # type: ignore[arg-type]
            x = self.get_submodule(self.layout.embed)(x)
        enter = None
        if rng is not None:
            first = self.plan.chunks[chunk][0]

            def enter(i: int) -> None:
                rng.enter(key, first + i + 1)  # type: ignore[arg-type, union-attr]
        x = run_layers(self.chunk_layers(chunk), x, checkpoint, enter)
        if self.is_last_chunk(chunk):
            for name in self.layout.final:
                x = self.get_submodule(name)(x)
            if head:
                x = self.apply_head(x)
        return x

    def apply_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head on final hidden states (the last virtual stage's): logits. Given
        only some positions' hidden states, it computes only their logits (evaluation
        scores a few tokens of each sequence; without sequence parallelism)."""
        if self.layout.head is None:
            return hidden
        module = self.get_submodule(self.layout.head)
        tied = self.layout.tied_weight
        return module(hidden, self.get_parameter(tied)) if tied is not None else module(hidden)

    def decode(self, x: torch.Tensor, cache: DecodeCache, last: bool = False) -> torch.Tensor:
        """One step of incremental decoding through this stage: ``x`` holds the next tokens
        of every row of a decoded batch (token ids on the first stage, else hidden states);
        they attend to the rows' cached keys and values and join them. Layer ``i`` (its index
        in the whole model) reads ``cache.layer(i)``; the input module is given the tokens'
        ``cache.positions``. Returns hidden states, or logits on the last stage (of the last
        position only with ``last``). One chunk per stage (decoding passes every token
        through each stage once)."""
        if self.num_chunks != 1:
            raise ValueError(f"decoding runs one chunk per stage, this stage has "
                             f"{self.num_chunks}")
        new = x.shape[1]
        if self.plan.has_embedding:
            x = self.get_submodule(self.layout.embed)(x, cache.positions(new, x.device))
        for i, layer in zip(range(*self.plan.chunks[0]), self.chunk_layers(0), strict=True):
            x = layer(x, cache.layer(i))
        cache.advance(new)
        if self.plan.has_head:
            x = x[:, -1:] if last else x
            for name in self.layout.final:
                x = self.get_submodule(name)(x)
            x = self.apply_head(x)
        return x

    def forward(self, x: torch.Tensor, chunk: int = 0, key: int | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Same as :meth:`forward_chunk` without recomputation; with ``targets`` (the last
        virtual stage) the loss, as :meth:`forward_loss`: in one call of the module, so that
        its hooks (ZeRO-3 gathering the head's weight) cover the head and the loss too."""
        if targets is not None:
            return self.forward_loss(chunk, x, targets, key=key)
        return self.forward_chunk(chunk, x, key=key)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's loss on the last stage."""
        if not self.plan.has_head:
            raise RuntimeError(f"stage {self.plan.stage} has no head, hence no loss")
        return self.get_submodule(self.layout.loss)(logits, targets)

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of the last virtual stage's final hidden states: the head and the loss in
        one (``ModelLayout.fused_loss`` and a loss module with ``head_loss``), else the loss
        of the head's logits."""
        module = self.get_submodule(self.layout.loss)
        fused = getattr(module, "head_loss", None)
        if not (self.layout.fused_loss and fused is not None and self.layout.head is not None):
            return self.loss(self.apply_head(hidden), targets)
        if not self.plan.has_head:
            raise RuntimeError(f"stage {self.plan.stage} has no head, hence no loss")
        tied = self.layout.tied_weight
        return fused(self.get_submodule(self.layout.head), hidden, targets,
                     self.get_parameter(tied) if tied is not None else None)

    def forward_loss(self, chunk: int, x: torch.Tensor, targets: torch.Tensor,
                     checkpoint: bool | str = False, key: int | None = None) -> torch.Tensor:
        """The loss of the last virtual stage's ``chunk`` on ``x``: one function, so that a
        compiler sees the head and the loss together (the logits need not be kept)."""
        return self.head_loss(self.forward_chunk(chunk, x, checkpoint, key, head=False),
                              targets)

    def tied_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients are summed over the embedding group: the tied weight
        on the first and on the last stage when they are different stages, else none."""
        tied = self.layout.tied_weight
        if tied is None or self.plan.has_embedding == self.plan.has_head:
            return []
        return [self.get_parameter(tied)]


def build_stage(
    model: nn.Module, plan: StagePlan, layout: ModelLayout | None = None,
    rng: RegionRNG | None = None,
) -> PipelineStage:
    """The :class:`PipelineStage` of ``plan`` made of ``model``'s modules (by reference).

    ``model`` may be a real model, a meta one (materialise the stage afterwards with
    ``to_empty`` and initialise each parameter by its full-model name) or one already made
    tensor-parallel. Modules of other stages stay in ``model``; drop it after building.
    ``rng`` seeds dropout per (micro-batch, region) when forward is given a ``key``.
    """
    return PipelineStage(model, plan, layout or ModelLayout(), rng)

