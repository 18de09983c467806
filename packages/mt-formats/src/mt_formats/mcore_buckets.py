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
Tensor parallelism: each TP rank's buffers (``dp_group_idx`` = the TP rank when PP is 1)
hold its own shards, laid out the same way from the shards' sizes; a state is the join of
the ranks' shards (:data:`_SPLIT`: rows or columns, a gated MLP's gate and up halves each
cut), a replicated tensor's the first rank's. Read for runs of PP 1 at any TP and any
data-parallel degree (the bucket tensors are whole over DP); a run whose Megatron-LM args
record several pipeline stages is refused in one line (without args, its stages' buckets fit
no layout of one stage, and are refused as such).
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


def model_params(shapes: Mapping[str, tuple[int, ...]], order: Sequence[str], tp: int = 1
                 ) -> list[tuple[Param, int]] | None:
    """GPTModel's parameters on one TP rank of ``tp`` (PP 1) in registration order, with
    their shards' sizes, from the stored shapes (``decoder.layers.*`` stacked over the
    layers) and a layer ``order``; None where a tensor does not divide by ``tp``."""
    found: list[tuple[Param, int | None]] = [
        ((key, -1), _local(key, shapes[key], tp)) for key in _FIRST if key in shapes]
    for layer in range(shapes[_LAYERS + _PROJ + "weight"][0]):
        found += [((_LAYERS + leaf, layer), _local(_LAYERS + leaf, shapes[_LAYERS + leaf][1:],
                                                    tp))
                  for leaf in order if _LAYERS + leaf in shapes]
    found += [((key, -1), _local(key, shapes[key], tp)) for key in _LAST if key in shapes]
    params = [(param, numel) for param, numel in found if numel is not None]
    return params if len(params) == len(found) else None


@dataclass(frozen=True)
class Slot:
    """Where a parameter lies: its bucket and first element there."""

    bucket: int
    start: int


def bucket_slots(params: Sequence[tuple[Param, int]], sizes: Sequence[int]
                 ) -> dict[Param, Slot] | None:
    """Each parameter's slot when megatron-core lays out ``params`` (registration order,
    with sizes) in buckets of ``sizes`` elements (unpadded): in reverse order, each at the
    next multiple of :data:`ALIGN`, a bucket closing where its size is reached; None where
    they do not fill the buckets exactly."""
    slots: dict[Param, Slot] = {}
    bucket, offset = 0, 0
    for param, numel in reversed(params):
        if bucket == len(sizes):
            return None
        start = -(-offset // ALIGN) * ALIGN
        end = start + numel
        if end > sizes[bucket]:
            return None
        slots[param] = Slot(bucket, start)
        bucket, offset = (bucket + 1, 0) if end == sizes[bucket] else (bucket, end)
    return slots if bucket == len(sizes) else None


def _unwrapped(value: Any) -> Any:
    """A megatron-core ``ShardedObject``'s value (saved as a one-element list)."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


class BucketState:
    """A folder's ``dp_reshardable`` state (see the module docstring): ``groups`` (the
    optimizer's param groups) and :meth:`read`, once :meth:`locate` has found the layout.
    ``gated``: the model's MLP is gated (``linear_fc1`` rows [gate; up])."""

    def __init__(self, folder: DCPFolder, shapes: Mapping[str, tuple[int, ...]],
                 gated: bool, hint: str, pipeline: int | None = None) -> None:
        self._folder, self._shapes, self._gated = folder, shapes, gated
        self._where = folder.root / METADATA_FILE
        keys: dict[tuple[int, str, int], str] = {}
        buffers = set()
        for key in folder.tensors:
            if not key.startswith(BUCKET_STATE):
                continue
            match = _BUCKET.match(key)
            if match is None or match[5] not in STATES:
                raise ConvertError(f"{self._where}: {key!r} is not a bucket of megatron-core's "
                                   f"distributed optimizer state ({', '.join(STATES)}); {hint}")
            buffers.add((match[2], match[3]))
            keys[int(match[1]), match[5], int(match[4])] = key
        ranks = sorted({rank for rank, _, _ in keys})
        if ranks != list(range(len(ranks))):
            raise ConvertError(f"{self._where}: the distributed optimizer's buckets are of "
                               f"model-parallel ranks {ranks}, not 0 to {len(ranks) - 1}; {hint}")
        if pipeline is not None and pipeline > 1:
            raise ConvertError(
                f"{self._where}: the distributed optimizer's buckets of a run of "
                f"{pipeline} pipeline stages (pipeline_model_parallel_size in its args): mt "
                f"reads this layout from runs of one stage (any TP); {hint}")
        if len(buffers) != 1:
            raise ConvertError(f"{self._where}: the distributed optimizer's state is in "
                               f"{len(buffers)} gradient buffers {sorted(buffers)}; mt reads "
                               f"one (a model of one dtype); {hint}")
        self.tp = len(ranks)
        self.sizes = [self._sizes(rank) for rank in ranks]
        expected = {(rank, state, bucket) for rank in ranks for state in STATES
                    for bucket in range(len(self.sizes[rank]))}
        if set(keys) != expected:
            rank, state, bucket = sorted(set(keys) ^ expected)[0]
            raise ConvertError(f"{self._where}: per_bucket_numel_unpadded of dp_group_idx "
                               f"{rank} records {len(self.sizes[rank])} buckets, but state "
                               f"{state!r} of bucket {bucket} is "
                               f"{'absent' if (rank, state, bucket) not in keys else 'stored'}")
        for (rank, _, bucket), key in keys.items():
            stored = tuple(folder.tensors[key].size)
            if stored != (self.sizes[rank][bucket],):
                raise ConvertError(f"{self._where}: {key!r} has shape {list(stored)}; "
                                   "per_bucket_numel_unpadded records "
                                   f"{self.sizes[rank][bucket]}")
            folder.check(key)
        self._keys = keys
        groups = _unwrapped(self._object(0, "optimizer"))
        if not isinstance(groups, dict) or not isinstance(groups.get("param_groups"), list):
            raise ConvertError(f"{self._where}: {BUCKET_STATE}dp_group_idx_0.optimizer holds "
                               "no param_groups")
        self.groups: list[dict[str, Any]] = groups["param_groups"]
        self._slots: list[dict[Param, Slot]] = []
        self.spec = ""

    def _object(self, rank: int, name: str) -> Any:
        prefix = f"{BUCKET_STATE}dp_group_idx_{rank}.{name}"
        found = [key for key in self._folder.objects if key.partition("/")[0] == prefix]
        if len(found) != 1:
            raise ConvertError(f"{self._where}: holds the distributed optimizer's buckets but "
                               f"{len(found)} entries {prefix!r}, not one")
        return self._folder.load_object(found[0])

    def _sizes(self, rank: int) -> list[int]:
        """Model-parallel ``rank``'s bucket sizes (``per_bucket_numel_unpadded``: per
        buffer, per dtype pair)."""
        value = _unwrapped(self._object(rank, "per_bucket_numel_unpadded"))
        buffers = value if isinstance(value, list) and len(value) == 1 else None
        sizes = list(buffers[0].values()) if buffers and isinstance(buffers[0], dict) else []
        if len(sizes) != 1 or not isinstance(sizes[0], list) or not sizes[0] or not all(
                type(size) is int and size > 0 for size in sizes[0]):
            raise ConvertError(f"{self._where}: per_bucket_numel_unpadded of dp_group_idx "
                               f"{rank} is {value!r}, not one buffer's list of bucket sizes")
        return sizes[0]

    def locate(self, weight: Callable[[str, int], torch.Tensor]) -> None:
        """Find the layout (see the module docstring); ``weight(key, layer)`` reads a stored
        weight (one layer of it)."""
        verdicts: dict[str, str] = {}
        fitting: dict[str, list[dict[Param, Slot]]] = {}
        for name, order in LAYER_ORDERS.items():
            params = model_params(self._shapes, order, self.tp)
            found = [bucket_slots(params, sizes) if params else None for sizes in self.sizes]
            if not all(found):
                verdicts[name] = "does not fill them"
                continue
            slots = [slot for slot in found if slot is not None]
            if not all(self._rounds_to(slots, param, weight(*param))
                       for param in slots[0] if param[1] <= 0):
                verdicts[name] = "fills them, but its main parameters do not round to the weights"
            else:
                verdicts[name], fitting[name] = "fits", slots
        if len(fitting) != 1:
            tried = "; ".join(f"{name}: {verdict}" for name, verdict in verdicts.items())
            sizes = self.sizes[0] if self.tp == 1 else self.sizes
            raise ConvertError(
                f"{self._where}: the distributed optimizer's buckets (sizes {sizes}"
                f"{f', TP {self.tp}' if self.tp > 1 else ''}) fit "
                f"{'none' if not fitting else 'more than one'} of the layer orders mt knows "
                f"({tried}); give --drop-optimizer to convert the weights alone")
        (self.spec, self._slots), = fitting.items()

    def _states(self, slots: Sequence[Mapping[Param, Slot]], param: Param,
                weight: torch.Tensor, states: Sequence[str]) -> dict[str, list[torch.Tensor]]:
        """Each TP rank's shard of each of ``states`` of ``param`` (shaped as its shard of
        ``weight``)."""
        out: dict[str, list[torch.Tensor]] = {state: [] for state in states}
        for rank, found in enumerate(slots):
            like = shard(param[0], weight, rank, self.tp, self._gated)
            slot = found[param]
            for state in states:
                flat = self._folder.load_range(self._keys[rank, state, slot.bucket],
                                               slot.start, like.numel())
                out[state].append(flat.reshape(like.shape))
        return out

    def _rounds_to(self, slots: Sequence[Mapping[Param, Slot]], param: Param,
                   weight: torch.Tensor) -> bool:
        mains = self._states(slots, param, weight, ("param",))["param"]
        return all(torch.equal(main.to(weight.dtype),
                               shard(param[0], weight, rank, self.tp, self._gated))
                   for rank, main in enumerate(mains))

    def read(self, param: Param, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The states of ``param`` (shaped as its stored ``weight``, one layer of it), the
        main parameter checked to round to the weight on every TP rank."""
        shards = self._states(self._slots, param, weight, STATES)
        for rank, main in enumerate(shards["param"]):
            if not torch.equal(main.to(weight.dtype),
                               shard(param[0], weight, rank, self.tp, self._gated)):
                key, layer = param
                slot = self._slots[rank][param]
                raise ConvertError(
                    f"{self._where}: the main parameter of {key!r}"
                    f"{f' layer {layer}' if layer >= 0 else ''} in bucket {slot.bucket} of "
                    f"dp_group_idx {rank} (from element {slot.start}, the {self.spec} layer "
                    "order) does not round to its stored weight: the buckets are not laid "
                    "out as mt derived")
        return {state: join(param[0], pieces, self._gated) for state, pieces in shards.items()}
