"""Move model and optimizer state between (TP, PP, DP) layouts (pure tensor maths, one
process).

A checkpoint holds, per rank, the ZeRO optimizer shard of that rank's pipeline stage in
its tensor-parallel slicing. :func:`canonical_optimizer` rebuilds the unsharded fp32 master
weights and Adam moments of a set of parameter names (consolidating DP shards with mt_zero,
merging TP slices with mt_tensor_parallel); :func:`local_optimizer` cuts them for one rank
of another layout, in the format ``mt_zero.load_consolidated`` takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from mt_tensor_parallel import merge_shards, shard_tensor
from mt_zero import consolidate

__all__ = ["canonical_optimizer", "cut", "local_optimizer", "merge_model"]

FULL_FORMAT = "mt-zero-full/1"


def _merge(style: str, parts: Sequence[torch.Tensor], vocab_size: int) -> torch.Tensor:
    if len(parts) == 1:
        part = parts[0]
        # tp == 1 keeps the real vocabulary; nothing to merge.
        return part
    return merge_shards(style, list(parts), vocab_size=vocab_size)


def cut(style: str, tensor: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s slice of a full tensor (a copy; tp == 1 keeps the real
    vocabulary, as mt pretrain does)."""
    return tensor.clone() if tp == 1 else shard_tensor(style, tensor, tp_rank, tp)


def canonical_optimizer(shards_by_tp: Sequence[Sequence[dict[str, Any]]], names: Iterable[str],
                        styles: Mapping[str, str], vocab_size: int) -> dict[str, Any]:
    """Unsharded optimizer state of ``names`` from one pipeline stage's shards.

    ``shards_by_tp[t]`` are the ``mt_zero.optimizer_shard_state`` shards of every DP rank of TP
    rank ``t``. Returns ``{"master": {name: t}, "sharded": {name: {key: t}},
    "replicated": {name: {key: v}}, "param_groups", "group_of", "scaler"}``.
    """
    fulls = [consolidate(list(shards)) for shards in shards_by_tp]
    out: dict[str, Any] = {"master": {}, "sharded": {}, "replicated": {},
                           "param_groups": fulls[0]["param_groups"],
                           "group_of": fulls[0]["group_of"], "scaler": fulls[0]["scaler"]}
    for name in names:
        if name not in fulls[0]["master"]:
            continue
        style = styles[name]
        out["master"][name] = _merge(style, [f["master"][name] for f in fulls], vocab_size)
        keys = fulls[0]["state"][name]["sharded"].keys()
        out["sharded"][name] = {
            key: _merge(style, [f["state"][name]["sharded"][key] for f in fulls], vocab_size)
            for key in keys}
        out["replicated"][name] = dict(fulls[0]["state"][name]["replicated"])
    return out


def local_optimizer(canonical: Mapping[str, Any], names: Sequence[str],
                    styles: Mapping[str, str], tp_rank: int, tp: int) -> dict[str, Any]:
    """One rank's ``mt-zero-full/1`` state (for ``load_consolidated``) from canonical state."""
    missing = [n for n in names if n not in canonical["master"]]
    if missing:
        raise ValueError(f"checkpoint lacks optimizer state for {missing}")
    master = {n: cut(styles[n], canonical["master"][n], tp_rank, tp) for n in names}
    state = {n: {"sharded": {k: cut(styles[n], v, tp_rank, tp)
                             for k, v in canonical["sharded"][n].items()},
                 "replicated": dict(canonical["replicated"][n])} for n in names}
    return {"format": FULL_FORMAT, "shapes": {n: tuple(t.shape) for n, t in master.items()},
            "param_groups": canonical["param_groups"],
            "group_of": {n: canonical["group_of"][n] for n in names},
            "master": master, "state": state, "scaler": canonical["scaler"]}


def merge_model(parts: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
                styles: Mapping[str, str], vocab_size: int,
                order: Callable[[str], Any] | None = None) -> dict[str, torch.Tensor]:
    """Unsharded model weights from ``{(pp, tp): state dict}`` of one DP replica."""
    stages = sorted({pp for pp, _ in parts})
    full: dict[str, torch.Tensor] = {}
    for pp in stages:
        tps = sorted(tp for p, tp in parts if p == pp)
        dicts = [parts[(pp, tp)] for tp in tps]
        for name in dicts[0]:
            if name not in full:
                full[name] = _merge(styles[name], [d[name] for d in dicts], vocab_size)
    return dict(sorted(full.items(), key=lambda kv: order(kv[0]))) if order else full
