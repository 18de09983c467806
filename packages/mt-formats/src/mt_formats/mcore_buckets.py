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
Read for runs of one model-parallel rank (TP 1 x PP 1, any data-parallel degree: the bucket
tensors are whole); more are refused in one line.
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

__all__ = ["BUCKET_STATE", "LAYER_ORDERS", "BucketState", "bucket_slots", "model_params"]

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
_FIRST = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_LAST = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")

#: A parameter: its stored key and layer (-1: not stacked).
Param = tuple[str, int]


def model_params(shapes: Mapping[str, tuple[int, ...]], order: Sequence[str]
                 ) -> list[tuple[Param, int]]:
    """GPTModel's parameters at TP 1 x PP 1 in registration order, with their sizes, from
    the stored shapes (``decoder.layers.*`` stacked over the layers) and a layer ``order``."""
    params = [((key, -1), math.prod(shapes[key])) for key in _FIRST if key in shapes]
    layers = shapes[_LAYERS + _PROJ + "weight"][0]
    for layer in range(layers):
        params += [((_LAYERS + leaf, layer), math.prod(shapes[_LAYERS + leaf][1:]))
                   for leaf in order if _LAYERS + leaf in shapes]
    return params + [((key, -1), math.prod(shapes[key])) for key in _LAST if key in shapes]


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
    optimizer's param groups) and :meth:`read`, once :meth:`locate` has found the layout."""

    def __init__(self, folder: DCPFolder, shapes: Mapping[str, tuple[int, ...]],
                 hint: str) -> None:
        self._folder, self._shapes = folder, shapes
        self._where = folder.root / METADATA_FILE
        keys: dict[tuple[str, int], str] = {}
        ranks, buffers = set(), set()
        for key in folder.tensors:
            if not key.startswith(BUCKET_STATE):
                continue
            match = _BUCKET.match(key)
            if match is None or match[5] not in STATES:
                raise ConvertError(f"{self._where}: {key!r} is not a bucket of megatron-core's "
                                   f"distributed optimizer state ({', '.join(STATES)}); {hint}")
            ranks.add(int(match[1]))
            buffers.add((match[2], match[3]))
            keys[match[5], int(match[4])] = key
        if ranks != {0}:
            raise ConvertError(
                f"{self._where}: the distributed optimizer's buckets of {len(ranks)} "
                f"model-parallel ranks (dp_group_idx {sorted(ranks)}): mt reads this layout "
                f"from runs of TP 1 x PP 1; {hint}")
        if len(buffers) != 1:
            raise ConvertError(f"{self._where}: the distributed optimizer's state is in "
                               f"{len(buffers)} gradient buffers {sorted(buffers)}; mt reads "
                               f"one (a model of one dtype); {hint}")
        self.sizes = self._sizes()
        expected = {(state, bucket) for state in STATES for bucket in range(len(self.sizes))}
        if set(keys) != expected:
            wrong = sorted(set(keys) ^ expected)[0]
            raise ConvertError(f"{self._where}: {len(self.sizes)} buckets recorded in "
                               "per_bucket_numel_unpadded, but state "
                               f"{wrong[0]!r} of bucket {wrong[1]} is "
                               f"{'absent' if wrong not in keys else 'stored'}")
        for (_, bucket), key in keys.items():
            stored = tuple(folder.tensors[key].size)
            if stored != (self.sizes[bucket],):
                raise ConvertError(f"{self._where}: {key!r} has shape {list(stored)}; "
                                   f"per_bucket_numel_unpadded records {self.sizes[bucket]}")
            folder.check(key)
        self._keys = keys
        groups = _unwrapped(self._object("optimizer"))
        if not isinstance(groups, dict) or not isinstance(groups.get("param_groups"), list):
            raise ConvertError(f"{self._where}: {BUCKET_STATE}dp_group_idx_0.optimizer holds "
                               "no param_groups")
        self.groups: list[dict[str, Any]] = groups["param_groups"]
        self._slots: dict[Param, Slot] = {}
        self.spec = ""

    def _object(self, name: str) -> Any:
        prefix = f"{BUCKET_STATE}dp_group_idx_0.{name}"
        found = [key for key in self._folder.objects if key.partition("/")[0] == prefix]
        if len(found) != 1:
            raise ConvertError(f"{self._where}: holds the distributed optimizer's buckets but "
                               f"{len(found)} entries {prefix!r}, not one")
        return self._folder.load_object(found[0])

    def _sizes(self) -> list[int]:
        """The buckets' sizes (``per_bucket_numel_unpadded``: per buffer, per dtype pair)."""
        value = _unwrapped(self._object("per_bucket_numel_unpadded"))
        buffers = value if isinstance(value, list) and len(value) == 1 else None
        sizes = list(buffers[0].values()) if buffers and isinstance(buffers[0], dict) else []
        if len(sizes) != 1 or not isinstance(sizes[0], list) or not sizes[0] or not all(
                type(size) is int and size > 0 for size in sizes[0]):
            raise ConvertError(f"{self._where}: per_bucket_numel_unpadded is {value!r}, not "
                               "one buffer's list of bucket sizes")
        return sizes[0]

    def locate(self, weight: Callable[[str, int], torch.Tensor]) -> None:
        """Find the layout (see the module docstring); ``weight(key, layer)`` reads a stored
        weight."""
        verdicts: dict[str, str] = {}
        fitting: dict[str, dict[Param, Slot]] = {}
        for name, order in LAYER_ORDERS.items():
            slots = bucket_slots(model_params(self._shapes, order), self.sizes)
            if slots is None:
                verdicts[name] = "does not fill them"
            elif not all(self._rounds_to(slots, param, weight(*param))
                         for param in slots if param[1] <= 0):
                verdicts[name] = "fills them, but its main parameters do not round to the weights"
            else:
                verdicts[name], fitting[name] = "fits", slots
        if len(fitting) != 1:
            tried = "; ".join(f"{name}: {verdict}" for name, verdict in verdicts.items())
            raise ConvertError(
                f"{self._where}: the distributed optimizer's buckets (sizes {self.sizes}) fit "
                f"{'none' if not fitting else 'more than one'} of the layer orders mt knows "
                f"({tried}); give --drop-optimizer to convert the weights alone")
        (self.spec, self._slots), = fitting.items()

    def _rounds_to(self, slots: Mapping[Param, Slot], param: Param,
                   weight: torch.Tensor) -> bool:
        main = self._range("param", slots[param], weight)
        return torch.equal(main.to(weight.dtype), weight)

    def _range(self, state: str, slot: Slot, like: torch.Tensor) -> torch.Tensor:
        flat = self._folder.load_range(self._keys[state, slot.bucket], slot.start, like.numel())
        return flat.reshape(like.shape)

    def read(self, param: Param, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The states of ``param`` (shaped as its stored ``weight``, one layer of it), the
        main parameter checked to round to the weight."""
        slot = self._slots[param]
        states = {state: self._range(state, slot, weight) for state in STATES}
        if not torch.equal(states["param"].to(weight.dtype), weight):
            key, layer = param
            raise ConvertError(
                f"{self._where}: the main parameter of {key!r}"
                f"{f' layer {layer}' if layer >= 0 else ''} in bucket {slot.bucket} (from "
                f"element {slot.start}, the {self.spec} layer order) does not round to its "
                "stored weight: the buckets are not laid out as mt derived")
        return states

