"""Megatron-core's distributed optimizer state in its ``dp_reshardable`` layout, the one
Megatron-LM saves by default since megatron-core 0.14: per gradient bucket and state, one
flat tensor (``optimizer.distributed.dp_group_idx_<model-parallel rank>.gbuf_idx_<buffer>
.dtype_(<param dtype>, <grad dtype>).bucket_idx_<b>.<param|exp_avg|exp_avg_sq>``: the
bucket as megatron-core's DistributedDataParallel lays it out, less the padding at its end),
and beside them, as pickled plain values, each bucket's size (``per_bucket_numel_unpadded``)
and the optimizer's param groups (``optimizer``).

The folder does not say where a parameter lies in its bucket: megatron-core derives that from
the model, and so does mt (:func:`bucket_slots`): the parameters in the reverse of the order
the model registers them, each starting at a multiple of 64 elements, a bucket ending where
its recorded size is reached. The order within a layer depends on the layer spec
(:data:`LAYER_ORDERS`). A candidate must fill the recorded sizes exactly, and its main
parameters must round to the stored weights (megatron-core copies them into the model after
every step) for the first layer and the tensors outside the layers; exactly one candidate
may pass. Every other tensor's main parameter is checked against its weight when read.
Parallelism: model-parallel rank ``pp_rank * TP + tp_rank`` holds its TP shards of its
stages' parameters, laid out the same way from the shards' sizes; a state is the join of the
TP ranks' shards (:data:`_SPLIT`: rows or columns, a gated MLP's gate and up halves each
cut), a replicated tensor's the first rank's. With interleaved (virtual) pipeline stages a
rank holds several model chunks, each in a buffer of its own: buffer ``c`` of pipeline rank
``p`` is virtual stage ``c * PP + p``. A stage registers the embeddings (the first), its
contiguous run of layers, the final norm and the output layer (the last); with tied
embeddings over several stages the last stage holds a copy of the word embeddings as its
output layer, and both copies lie in buckets of their own (megatron-core's
``shared_embedding``); the first stage's is read. How many layers each stage holds is found
from the sizes (a stage's buckets fill for one count only). TP and PP come from the run's
Megatron-LM args, else every split of the model-parallel ranks is tried. Read at any TP, PP,
virtual stages and data-parallel degree (the bucket tensors are whole over DP), for a model
of one dtype (one buffer per model chunk).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mt_formats.dcp import DCPFolder
from mt_formats.dcp_files import METADATA_FILE
from mt_formats.errors import ConvertError

__all__ = ["BUCKET_STATE", "LAYER_ORDERS", "BucketState", "bucket_slots", "join",
           "model_params", "shard"]

#: The prefix of the distributed optimizer's per-bucket keys.
BUCKET_STATE = "optimizer.distributed."
STATES = ("param", "exp_avg", "exp_avg_sq")
#: Where a parameter starts in its bucket: a multiple of this many elements.
ALIGN = 64
_BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(\w+)$")
_LAYERS = "decoder.layers."
_QKV, _PROJ = "self_attention.linear_qkv.", "self_attention.linear_proj."
_FC1, _FC2 = "mlp.linear_fc1.", "mlp.linear_fc2."
_NORM, _LINEAR = ("layer_norm_weight", "layer_norm_bias"), ("weight", "bias")


def _order(*modules: tuple[str, tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(module + leaf for module, leaves in modules for leaf in leaves)


#: A layer's parameters (their keys below ``decoder.layers.``) in the order megatron-core's
#: layer specs register them: the local spec's norms are modules of their own ahead of the
#: attention and the MLP (saved under the fused names); Transformer Engine's are fused into
#: ``linear_qkv`` and ``linear_fc1``, whose ``LayerNormLinear`` registers them before its
#: weight (the last candidate: after it). The attention registers its output projection
#: before ``linear_qkv``.
LAYER_ORDERS: dict[str, tuple[str, ...]] = {
    "local": _order((_QKV, _NORM), (_PROJ, _LINEAR), (_QKV, _LINEAR), (_FC1, _NORM),
                    (_FC1, _LINEAR), (_FC2, _LINEAR)),
    "transformer_engine": _order((_PROJ, _LINEAR), (_QKV, _NORM + _LINEAR),
                                 (_FC1, _NORM + _LINEAR), (_FC2, _LINEAR)),
    "transformer_engine, norms last": _order((_PROJ, _LINEAR), (_QKV, _LINEAR + _NORM),
                                             (_FC1, _LINEAR + _NORM), (_FC2, _LINEAR)),
}
#: How tensor parallelism cuts a tensor (its key, below ``decoder.layers.`` for a layer's):
#: along rows (0) or columns (1); absent: replicated. A gated MLP's ``linear_fc1`` rows are
#: [gate; up], each half cut (:func:`shard`).
_SPLIT = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0,
          _QKV + "weight": 0, _QKV + "bias": 0, _PROJ + "weight": 1, _FC1 + "weight": 0,
          _FC1 + "bias": 0, _FC2 + "weight": 1}
_FIRST = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_LAST = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")

#: A parameter: its stored key and layer (-1: not stacked).
Param = tuple[str, int]
#: The last stage's output layer where it is a copy of the first stage's word embeddings
#: (tied embeddings over several stages): not stored, cut as the embeddings are.
_COPY: Param = ("output_layer.weight (a copy of embedding.word_embeddings.weight)", -1)
_SPLIT[_COPY[0]] = 0


def _axis(key: str) -> int | None:
    return _SPLIT.get(key.removeprefix(_LAYERS))


def shard(key: str, tensor: torch.Tensor, rank: int, tp: int, gated: bool) -> torch.Tensor:
    """TP rank ``rank``'s shard of stored tensor ``key`` (one layer of it)."""
    axis = _axis(key)
    if axis is None or tp == 1:
        return tensor
    if gated and key.endswith((_FC1 + "weight", _FC1 + "bias")):
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return tensor.chunk(tp, dim=axis)[rank]


def join(key: str, shards: Sequence[torch.Tensor], gated: bool) -> torch.Tensor:
    """Stored tensor ``key`` (one layer of it) from its TP shards (:func:`shard`'s inverse;
    a replicated tensor's first copy)."""
    axis = _axis(key)
    if axis is None or len(shards) == 1:
        return shards[0]
    if gated and key.endswith((_FC1 + "weight", _FC1 + "bias")):
        halves = [piece.chunk(2) for piece in shards]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves])
    return torch.cat(list(shards), dim=axis)


def _local(key: str, shape: tuple[int, ...], tp: int) -> int | None:
    """Elements of a TP rank's shard of a tensor of ``shape`` (None: it does not divide)."""
    axis = _axis(key)
    if axis is None:
        return math.prod(shape)
    if shape[axis] % tp:
        return None
    return math.prod(shape) // tp


@dataclass(frozen=True)
class Stage:
    """A pipeline stage's place: its layers ``first_layer`` to ``first_layer + layers - 1``;
    ``first`` / ``last``: it holds the embeddings / the final norm and output layer."""

    first_layer: int
    layers: int
    first: bool
    last: bool


def model_params(shapes: Mapping[str, tuple[int, ...]], order: Sequence[str], tp: int = 1,
                 stage: Stage | None = None) -> list[tuple[Param, int, bool]] | None:
    """GPTModel's parameters on one TP rank of ``tp`` of ``stage`` (default: the whole
    model) in registration order, with their shards' sizes and whether the parameter lies in
    a bucket of its own (a shared embedding), from the stored shapes (``decoder.layers.*``
    stacked over the layers) and a layer ``order``; None where a tensor does not divide by
    ``tp``."""
    total = shapes[_LAYERS + _PROJ + "weight"][0]
    stage = stage or Stage(0, total, True, True)
    shared = "output_layer.weight" not in shapes and not (stage.first and stage.last)
    found: list[tuple[Param, int | None, bool]] = []
    if stage.first:
        found += [((key, -1), _local(key, shapes[key], tp), shared and key == _FIRST[0])
                  for key in _FIRST if key in shapes]
    for layer in range(stage.first_layer, stage.first_layer + stage.layers):
        found += [((_LAYERS + leaf, layer), _local(_LAYERS + leaf, shapes[_LAYERS + leaf][1:],
                                                    tp), False)
                  for leaf in order if _LAYERS + leaf in shapes]
    if stage.last:
        found += [((key, -1), _local(key, shapes[key], tp), False)
                  for key in _LAST if key in shapes]
        if shared:
            found.append((_COPY, _local(_FIRST[0], shapes[_FIRST[0]], tp), True))
    params = [(param, numel, alone) for param, numel, alone in found if numel is not None]
    return params if len(params) == len(found) else None


@dataclass(frozen=True)
class Slot:
    """Where a parameter lies: its bucket and first element there."""

    bucket: int
    start: int


def bucket_slots(params: Sequence[tuple[Param, int, bool]], sizes: Sequence[int]
                 ) -> dict[Param, Slot] | None:
    """Each parameter's slot when megatron-core lays out ``params`` (registration order,
    with sizes and whether each lies in a bucket of its own) in buckets of ``sizes``
    elements (unpadded): in reverse order, each at the next multiple of :data:`ALIGN`, a
    bucket closing where its size is reached, or before and after a parameter of its own
    (the bucket before it then ends at its aligned start); None where they do not fill the
    buckets exactly."""
    slots: dict[Param, Slot] = {}
    bucket, offset = 0, 0
    for param, numel, alone in reversed(params):
        if bucket == len(sizes):
            return None
        start = -(-offset // ALIGN) * ALIGN
        if alone and offset:
            if start != sizes[bucket]:
                return None
            bucket, start = bucket + 1, 0
            if bucket == len(sizes):
                return None
        end = start + numel
        if end > sizes[bucket] or (alone and end != sizes[bucket]):
            return None
        slots[param] = Slot(bucket, start)
        bucket, offset = (bucket + 1, 0) if end == sizes[bucket] else (bucket, end)
    return slots if bucket == len(sizes) else None


def stage_slots(shapes: Mapping[str, tuple[int, ...]], order: Sequence[str],
                sizes: Sequence[Sequence[Sequence[int]]]) -> list[list[dict[Param, Slot]]] | str:
    """Each stage's TP ranks' slots for ``order`` (``sizes[stage][tp_rank]``: that rank's
    bucket sizes for the stage), each stage holding the one count of layers whose parameters
    fill its ranks' buckets; or why not."""
    total = shapes[_LAYERS + _PROJ + "weight"][0]
    stages, tp = len(sizes), len(sizes[0])
    slots: list[list[dict[Param, Slot]]] = []
    taken = 0
    for index in range(stages):
        last = index == stages - 1
        counts = [total - taken] if last else range(total - taken + 1)
        fitting = []
        for count in counts:
            stage = Stage(taken, count, index == 0, last)
            params = model_params(shapes, order, tp, stage)
            if params is None:
                return f"does not divide by TP {tp}"
            if sum(numel for _, numel, _ in params) > sum(sizes[index][0]):
                break  # more layers only add
            found = [bucket_slots(params, sizes[index][rank]) for rank in range(tp)]
            if all(found):
                fitting.append((count, [slot for slot in found if slot is not None]))
        if len(fitting) != 1:
            return (f"{'no' if not fitting else 'more than one'} count of layers fills "
                    f"{'its' if stages == 1 else f'stage {index}' + chr(39) + 's'} buckets")
        count, found_slots = fitting[0]
        slots.append(found_slots)
        taken += count
    return slots


#: The most partial layouts of a coalesced buffer followed at once (each step doubles them
#: at most; the rounding check prunes all but one in a trained model).
_WIDEST = 16


def coalesced_starts(params: Sequence[tuple[Param, int, bool]], total: int,
                     rounds: Callable[[Param, int], bool]) -> list[dict[Param, int]]:
    """Each parameter's first element in a legacy ``distrib_optim.pt`` buffer, which holds
    megatron-core's buckets' unpadded contents one after another (``total`` elements) and no
    bucket sizes: ``params`` (registration order, sizes, whether each lies in a bucket of its
    own) in reverse order, each at the next multiple of :data:`ALIGN` from its bucket's
    start; a bucket may end after any parameter (the next then starts where it ended) and
    ends around a parameter of its own (before it, at its aligned start). Of the layouts
    whose every main parameter ``rounds(param, start)`` to its weight and that fill
    ``total`` exactly: none, the one, or two of them (ambiguous; also where more than
    :data:`_WIDEST` partial layouts pass at once)."""
    # Where the next parameter may go depends only on where the last one started (after it
    # the offset from its bucket's start is its size mod ALIGN, or 0 after one of its own):
    # the frontier maps that start to the starts so far; two paths to one start, two
    # layouts.
    frontier: dict[int, tuple[int, int, dict[Param, int]]] = {-1: (0, 0, {})}
    for param, numel, alone in reversed(params):
        grown: dict[int, tuple[int, int, dict[Param, int]]] = {}
        for offset, phase, starts in frontier.values():
            aligned = offset + (-phase) % ALIGN
            options = [aligned] if alone or not phase else [aligned, offset]
            for start in options:
                if start + numel > total or not rounds(param, start):
                    continue
                if start in grown:  # reached by another layout as well
                    return [grown[start][2], {**starts, param: start}]
                grown[start] = (start + numel, 0 if alone else numel % ALIGN,
                                {**starts, param: start})
        if len(grown) > _WIDEST:
            return [layout for _, _, layout in list(grown.values())[:2]]
        frontier = grown
    return [starts for offset, _, starts in frontier.values() if offset == total]


def _probes(slots: Mapping[Param, Slot]) -> list[Param]:
    """The parameters of a stage (one rank's ``slots``) whose main parameters are checked
    against the weights when its layout is chosen: those outside the layers and its first
    layer's."""
    layers = [layer for _, layer in slots if layer >= 0]
    return [param for param in slots if param[1] < 0 or param[1] == min(layers, default=-1)]


def _splits(ranks: int, chunks: int, args: Any) -> list[tuple[int, int]]:
    """The (TP, PP) splits of ``ranks`` model-parallel ranks that the run's Megatron-LM
    ``args`` allow (each size they record), TP first; several model ``chunks`` per rank
    need several stages."""
    tp = getattr(args, "tensor_model_parallel_size", None)
    pp = getattr(args, "pipeline_model_parallel_size", None)
    return [(size, ranks // size) for size in range(1, ranks + 1) if ranks % size == 0
            and tp in (None, size) and pp in (None, ranks // size)
            and (chunks == 1 or ranks // size > 1)]


def _place(stage: int, tp_rank: int, tp: int, pp: int) -> tuple[int, int]:
    """The model-parallel rank and buffer holding TP rank ``tp_rank``'s shards of (virtual)
    ``stage`` at TP ``tp`` x PP ``pp``."""
    return stage % pp * tp + tp_rank, stage // pp


def _unwrapped(value: Any) -> Any:
    """A megatron-core ``ShardedObject``'s value (saved as a one-element list)."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


class BucketState:
    """A folder's ``dp_reshardable`` state (see the module docstring): ``groups`` (the
    optimizer's param groups) and :meth:`read`, once :meth:`locate` has found the layout.
    ``gated``: the model's MLP is gated (``linear_fc1`` rows [gate; up]); ``args``: the
    run's Megatron-LM args, where the folder has them."""

    def __init__(self, folder: DCPFolder, shapes: Mapping[str, tuple[int, ...]],
                 gated: bool, hint: str, args: Any = None) -> None:
        self._folder, self._shapes, self._gated = folder, shapes, gated
        self._where = folder.root / METADATA_FILE
        keys: dict[tuple[int, int, str, int], str] = {}
        dtypes: dict[tuple[int, int], set[str]] = {}
        for key in folder.tensors:
            if not key.startswith(BUCKET_STATE):
                continue
            match = _BUCKET.match(key)
            if match is None or match[5] not in STATES:
                raise ConvertError(f"{self._where}: {key!r} is not a bucket of megatron-core's "
                                   f"distributed optimizer state ({', '.join(STATES)}); {hint}")
            rank, chunk = int(match[1]), int(match[2])
            dtypes.setdefault((rank, chunk), set()).add(match[3])
            keys[rank, chunk, match[5], int(match[4])] = key
        ranks = sorted({rank for rank, _ in dtypes})
        if ranks != list(range(len(ranks))):
            raise ConvertError(f"{self._where}: the distributed optimizer's buckets are of "
                               f"model-parallel ranks {ranks}, not 0 to {len(ranks) - 1}; {hint}")
        pairs = sorted({pair for found in dtypes.values() for pair in found})
        if len(pairs) > 1:
            raise ConvertError(f"{self._where}: the distributed optimizer's buffers are of "
                               f"{len(pairs)} dtype pairs {pairs}; mt reads a model of one "
                               f"dtype (a buffer per model chunk); {hint}")
        self.chunks = 1 + max(chunk for _, chunk in dtypes)
        for rank in ranks:
            chunks = sorted(chunk for found, chunk in dtypes if found == rank)
            if chunks != list(range(self.chunks)):
                raise ConvertError(
                    f"{self._where}: the distributed optimizer's buffers of dp_group_idx "
                    f"{rank} are {chunks}, not 0 to {self.chunks - 1} as on the others (a "
                    f"buffer per model chunk); {hint}")
        virtual = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
        if args is not None and virtual != self.chunks:
            raise ConvertError(
                f"{self._where}: the run's args record {virtual!r} model chunk(s) per pipeline "
                f"rank (virtual_pipeline_model_parallel_size), but each rank holds "
                f"{self.chunks} buffer(s) of the distributed optimizer's state (a buffer per "
                f"model chunk); {hint}")
        self.splits = _splits(len(ranks), self.chunks, args)
        if not self.splits and args is None:
            raise ConvertError(
                f"{self._where}: each of the {len(ranks)} model-parallel rank(s) holds "
                f"{self.chunks} buffers of the distributed optimizer's state, one per model "
                f"chunk of interleaved pipeline stages, which need several pipeline ranks; "
                f"{hint}")
        if not self.splits:
            raise ConvertError(
                f"{self._where}: the distributed optimizer's buckets are of {len(ranks)} "
                f"model-parallel ranks, but the run's args record tensor_model_parallel_size "
                f"{getattr(args, 'tensor_model_parallel_size', None)!r} and "
                f"pipeline_model_parallel_size "
                f"{getattr(args, 'pipeline_model_parallel_size', None)!r}; {hint}")
        self.sizes = [[self._sizes(rank, chunk) for chunk in range(self.chunks)]
                      for rank in ranks]
        expected = {(rank, chunk, state, bucket) for rank in ranks
                    for chunk in range(self.chunks) for state in STATES
                    for bucket in range(len(self.sizes[rank][chunk]))}
        if set(keys) != expected:
            odd = sorted(set(keys) ^ expected)[0]
            rank, chunk, state, bucket = odd
            raise ConvertError(f"{self._where}: per_bucket_numel_unpadded of dp_group_idx "
                               f"{rank} records {len(self.sizes[rank][chunk])} buckets in "
                               f"buffer {chunk}, but state {state!r} of bucket {bucket} is "
                               f"{'stored' if odd in keys else 'absent'}")
        for (rank, chunk, _, bucket), key in keys.items():
            stored = tuple(folder.tensors[key].size)
            if stored != (self.sizes[rank][chunk][bucket],):
                raise ConvertError(f"{self._where}: {key!r} has shape {list(stored)}; "
                                   "per_bucket_numel_unpadded records "
                                   f"{self.sizes[rank][chunk][bucket]}")
            folder.check(key)
        self._keys = keys
        groups = _unwrapped(self._object(0, "optimizer"))
        if not isinstance(groups, dict) or not isinstance(groups.get("param_groups"), list):
            raise ConvertError(f"{self._where}: {BUCKET_STATE}dp_group_idx_0.optimizer holds "
                               "no param_groups")
        self.groups: list[dict[str, Any]] = groups["param_groups"]
        for rank in ranks[1:]:  # every model-parallel rank's optimizer took the same steps
            other = _unwrapped(self._object(rank, "optimizer"))
            other = other.get("param_groups") if isinstance(other, dict) else None
            steps = {repr(group.get("step")) for group in other or []
                     if isinstance(group, dict)}
            first = {repr(group.get("step")) for group in self.groups if isinstance(group, dict)}
            if steps != first:
                raise ConvertError(f"{self._where}: {BUCKET_STATE}dp_group_idx_{rank}.optimizer "
                                   f"records steps {sorted(steps)}, dp_group_idx_0's "
                                   f"{sorted(first)}: not one run's state; {hint}")
        self.tp = self.pp = 1
        self._slots: list[list[dict[Param, Slot]]] = []  # per stage, per TP rank
        self._stage: dict[Param, int] = {}
        self.spec = ""

    def _object(self, rank: int, name: str) -> Any:
        prefix = f"{BUCKET_STATE}dp_group_idx_{rank}.{name}"
        found = [key for key in self._folder.objects if key.partition("/")[0] == prefix]
        if len(found) != 1:
            raise ConvertError(f"{self._where}: holds the distributed optimizer's buckets but "
                               f"{len(found)} entries {prefix!r}, not one")
        return self._folder.load_object(found[0])

    def _sizes(self, rank: int, chunk: int) -> list[int]:
        """Model-parallel ``rank``'s bucket sizes in buffer ``chunk``
        (``per_bucket_numel_unpadded``: per buffer, per dtype pair)."""
        value = _unwrapped(self._object(rank, "per_bucket_numel_unpadded"))
        buffers = value if isinstance(value, list) and len(value) == self.chunks else None
        sizes = list(buffers[chunk].values()) if buffers and isinstance(
            buffers[chunk], dict) else []
        if len(sizes) != 1 or not isinstance(sizes[0], list) or not sizes[0] or not all(
                type(size) is int and size > 0 for size in sizes[0]):
            raise ConvertError(f"{self._where}: per_bucket_numel_unpadded of dp_group_idx "
                               f"{rank} is {value!r}, not {self.chunks} buffer(s)' list of "
                               "bucket sizes")
        return sizes[0]

    def locate(self, weight: Callable[[str, int], torch.Tensor]) -> None:
        """Find the layout (see the module docstring); ``weight(key, layer)`` reads a stored
        weight (one layer of it)."""
        verdicts: dict[str, str] = {}
        fitting: dict[str, tuple[int, int, list[list[dict[Param, Slot]]]]] = {}
        for name, order in LAYER_ORDERS.items():
            for tp, pp in self.splits:
                label = name if tp * pp == 1 else f"{name} at TP {tp} x PP {pp}"
                sizes = [[self.sizes[rank][chunk] for rank, chunk in
                          (_place(stage, tp_rank, tp, pp) for tp_rank in range(tp))]
                         for stage in range(pp * self.chunks)]
                found = stage_slots(self._shapes, order, sizes)
                if isinstance(found, str):
                    verdicts[label] = found
                elif not all(self._rounds_to(found[stage], stage, tp, pp, param, weight)
                             for stage in range(len(found))
                             for param in _probes(found[stage][0])):
                    verdicts[label] = ("fills them, but its main parameters do not round to "
                                       "the weights")
                else:
                    verdicts[label], fitting[label] = "fits", (tp, pp, found)
        if len(fitting) != 1:
            tried = "; ".join(f"{name}: {verdict}" for name, verdict in verdicts.items())
            sizes = self.sizes[0][0] if len(self.sizes) == self.chunks == 1 else self.sizes
            ranks = f", {len(self.sizes)} model-parallel ranks" if len(self.sizes) > 1 else ""
            raise ConvertError(
                f"{self._where}: the distributed optimizer's buckets (sizes {sizes}{ranks}) "
                f"fit {'none' if not fitting else 'more than one'} of the layer orders mt "
                f"knows ({tried}); give --drop-optimizer to convert the weights alone")
        (self.spec, (self.tp, self.pp, self._slots)), = fitting.items()
        self._stage = {param: stage for stage, found in enumerate(self._slots)
                       for param in found[0]}

    def _states(self, slots: Sequence[Mapping[Param, Slot]], stage: int, pp: int,
                param: Param, weight: torch.Tensor, states: Sequence[str]
                ) -> dict[str, list[torch.Tensor]]:
        """Each TP rank's shard of each of ``states`` of ``param`` (shaped as its shard of
        ``weight``) from ``stage``'s TP ranks' ``slots``."""
        out: dict[str, list[torch.Tensor]] = {state: [] for state in states}
        for tp_rank, found in enumerate(slots):
            like = shard(param[0], weight, tp_rank, len(slots), self._gated)
            rank, chunk = _place(stage, tp_rank, len(slots), pp)
            slot = found[param]
            for state in states:
                flat = self._folder.load_range(self._keys[rank, chunk, state, slot.bucket],
                                               slot.start, like.numel())
                out[state].append(flat.reshape(like.shape))
        return out

    def _rounds_to(self, slots: Sequence[Mapping[Param, Slot]], stage: int, tp: int, pp: int,
                   param: Param, weight: Callable[[str, int], torch.Tensor]) -> bool:
        """The main parameter of ``param`` rounds to its weight on each of ``stage``'s TP
        ranks (``slots``; the last stage's copy of the embeddings to the embeddings)."""
        stored = weight(*((_FIRST[0], -1) if param == _COPY else param))
        mains = self._states(slots, stage, pp, param, stored, ("param",))["param"]
        return all(torch.equal(main.to(stored.dtype),
                               shard(param[0], stored, rank, tp, self._gated))
                   for rank, main in enumerate(mains))

    def read(self, param: Param, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The states of ``param`` (shaped as its stored ``weight``, one layer of it), the
        main parameter checked to round to the weight on every TP rank of its stage."""
        stage = self._stage[param]
        shards = self._states(self._slots[stage], stage, self.pp, param, weight, STATES)
        for tp_rank, main in enumerate(shards["param"]):
            if not torch.equal(main.to(weight.dtype),
                               shard(param[0], weight, tp_rank, self.tp, self._gated)):
                key, layer = param
                slot = self._slots[stage][tp_rank][param]
                rank, chunk = _place(stage, tp_rank, self.tp, self.pp)
                raise ConvertError(
                    f"{self._where}: the main parameter of {key!r}"
                    f"{f' layer {layer}' if layer >= 0 else ''} in bucket {slot.bucket} of "
                    f"dp_group_idx {rank} buffer {chunk} (from element {slot.start}, the "
                    f"{self.spec} layer order) does not round to its stored weight: the "
                    "buckets are not laid out as mt derived")
        return {state: join(param[0], pieces, self._gated) for state, pieces in shards.items()}
