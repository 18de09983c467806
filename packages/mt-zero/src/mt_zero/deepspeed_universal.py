"""What DeepSpeed's ``ds_to_universal`` needs to merge mt's tensor-parallel slices.

``python -m deepspeed.checkpoint.ds_to_universal`` turns a DeepSpeed checkpoint into one
folder per parameter holding the *whole* tensor. It joins the tensor-parallel slices of a
parameter by the rules the checkpoint's ``universal_checkpoint_info`` gives (the entry
Megatron-DeepSpeed writes into its client state); a parameter no rule names is joined along
dimension 0, which is wrong for every replicated or row-parallel parameter and for fused
blocks. :func:`universal_checkpoint_info` states the rule of each of mt's parameters from
its mt-tensor-parallel shard style, one exact name pattern per parameter:

- ``replicate`` -> replicated (each rank holds the whole tensor; DeepSpeed checks the
  copies are equal and keeps one);
- ``column`` -> joined along dimension 0 (DeepSpeed's default);
- ``row`` -> joined along dimension 1;
- ``column_qkv`` -> three sub-parameters ([q; k; v], each split over the ranks), joined
  block by block;
- ``column_pair`` -> two sub-parameters ([k; v] or SwiGLU's [gate; up]), block by block;
- ``vocab`` -> joined along dimension 0, the padding rows past ``vocab_size`` dropped.

``kv_replicated`` (grouped-query key/value heads copied to several ranks, each rank
holding the heads its query heads need) is no rule DeepSpeed knows: ValueError. Pure (no
DeepSpeed import): the keys are DeepSpeed's own strings
(``deepspeed.checkpoint.constants``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["UNIVERSAL_CHECKPOINT_INFO", "universal_checkpoint_info"]

#: The client-state key ``ds_to_universal`` reads the rules from.
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"

_CATEGORY = {
    "replicate": "tp_replicated_parameter_patterns",
    "row": "parameter_with_row_parallelism_patterns",
    "column_pair": "parameter_with_2_sub_params_cat_dim_0",
    "vocab": "vocabulary_parameter_patterns",
}


def universal_checkpoint_info(styles: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]],
                              vocab_size: int, padded_vocab_size: int) -> dict[str, Any]:
    """The ``universal_checkpoint_info`` of a checkpoint whose parameters (named as
    DeepSpeed records them) have mt-tensor-parallel ``styles``; ``shapes``: each
    parameter's dimensions count (a fused block's rule differs for a weight and a bias)."""
    info: dict[str, Any] = {key: [] for key in _CATEGORY.values()}
    info["parameter_with_sub_params"] = []
    qkv: dict[int, list[str]] = {}
    for name, style in styles.items():
        pattern = re.escape(name) + "$"
        if style in _CATEGORY:
            info[_CATEGORY[style]].append(pattern)
        elif style == "column_qkv":
            qkv.setdefault(len(shapes[name]), []).append(pattern)
        elif style != "column":
            raise ValueError(f"{name}: shard style {style!r} has no DeepSpeed universal "
                             "checkpoint rule (key/value heads replicated over tensor-parallel "
                             "ranks: use a tp that divides n_kv_heads)")
    for dims, patterns in sorted(qkv.items()):
        # Three equal blocks along dimension 0 (DeepSpeed's sub-parameter count form).
        info["parameter_with_sub_params"].append(
            {"patterns": patterns, "shape": (3, *([-1] * (dims - 1))), "partition_dim": 0})
    info["original_vocab_size"] = vocab_size
    info["padded_vocab_size"] = padded_vocab_size
    return info
