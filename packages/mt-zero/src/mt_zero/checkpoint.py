"""Optimizer checkpoints that move between data-parallel sizes and ZeRO stages.

Each rank saves its own shard (:func:`optimizer_shard_state`): for every master piece, the
parameter name, the piece's offset and length inside the flattened parameter, its fp32
master values and its optimizer state, plus every parameter's full shape. That is enough to
rebuild full per-parameter tensors offline (:func:`consolidate`, a pure function over the
shards of all ranks) and to cut them again for any other layout
(:func:`load_consolidated`, which each rank of the new layout calls with the same full
state).

Optimizer state tensors shaped like the piece (Adam's moments) are sharded; anything else
(Adam's ``step`` counter) is replicated and taken from the first piece that has it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mt_zero.optimizer import ZeroOptimizer
from mt_zero.param_groups import decays
from mt_zero.partition import partition

__all__ = ["consolidate", "initial_state", "load_consolidated", "optimizer_shard_state",
           "split_consolidated"]

SHARD_FORMAT = "mt-zero-shard/1"
FULL_FORMAT = "mt-zero-full/1"


def _optimizer_index(opt: ZeroOptimizer) -> dict[int, int]:
    """Position of every master tensor in the inner optimizer's state_dict numbering."""
    flat = [p for group in opt.optimizer.param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(flat)}


def optimizer_shard_state(opt: ZeroOptimizer) -> dict[str, Any]:
    """This rank's shard of the optimizer: master weights, optimizer state, loss scale.

    Local (no communication); tensors are copies.
    """
    inner = opt.optimizer.state_dict()
    index = _optimizer_index(opt)
    pieces, master, state = [], [], []
    for mp in opt.pieces:
        pieces.append({"name": mp.name, "offset": mp.param_offset, "length": mp.length,
                       "group": mp.group})
        master.append(mp.tensor.detach().clone())
        saved = inner["state"].get(index[id(mp.tensor)], {})
        state.append({k: v.clone() if isinstance(v, torch.Tensor) else v
                      for k, v in saved.items()})
    return {
        "format": SHARD_FORMAT,
        "stage": opt.config.stage,
        "dp_size": opt.dp_size,
        "dp_rank": opt.dp_rank,
        "shapes": opt.shapes,
        "param_groups": [{k: v for k, v in g.items() if k != "params"}
                         for g in inner["param_groups"]],
        "pieces": pieces,
        "master": master,
        "state": state,
        "scaler": None if opt.scaler is None else opt.scaler.state_dict(),
    }


def consolidate(shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merge the shards of all ranks into full per-parameter tensors keyed by name.

    Returns ``{"format", "shapes", "param_groups", "group_of", "master": {name: fp32
    tensor}, "state": {name: {"sharded": {key: tensor}, "replicated": {key: value}}},
    "scaler"}``. Raises ``ValueError`` if a shard is missing (elements left uncovered).
    """
    if not shards:
        raise ValueError("consolidate needs at least one shard")
    bad = [s.get("format") for s in shards if s.get("format") != SHARD_FORMAT]
    if bad:
        raise ValueError(f"expected shards in format {SHARD_FORMAT!r}, got {bad}")
    shapes: dict[str, tuple[int, ...]] = dict(shards[0]["shapes"])
    numel = {n: int(torch.Size(s).numel()) for n, s in shapes.items()}
    master = {n: torch.zeros(numel[n], dtype=torch.float32) for n in shapes}
    covered = {n: torch.zeros(numel[n], dtype=torch.bool) for n in shapes}
    sharded: dict[str, dict[str, torch.Tensor]] = {n: {} for n in shapes}
    replicated: dict[str, dict[str, Any]] = {n: {} for n in shapes}
    group_of: dict[str, int] = {}
    for shard in shards:
        for piece, values, state in zip(shard["pieces"], shard["master"], shard["state"]):
            name, lo = piece["name"], piece["offset"]
            hi = lo + piece["length"]
            master[name][lo:hi] = values
            covered[name][lo:hi] = True
            group_of[name] = piece["group"]
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == (piece["length"],):
                    full = sharded[name].setdefault(
                        key, torch.zeros(numel[name], dtype=value.dtype))
                    full[lo:hi] = value
                else:
                    replicated[name].setdefault(key, value)
    holes = [n for n, c in covered.items() if not bool(c.all())]
    if holes:
        raise ValueError(
            f"shards from {len(shards)} ranks leave parameters incomplete: {holes} "
            "(are all ranks' shards present?)")
    return {
        "format": FULL_FORMAT,
        "shapes": shapes,
        "param_groups": shards[0]["param_groups"],
        "group_of": group_of,
        "master": {n: t.view(shapes[n]) for n, t in master.items()},
        "state": {n: {"sharded": {k: t.view(shapes[n]) for k, t in sharded[n].items()},
                      "replicated": replicated[n]} for n in shapes},
        "scaler": shards[0]["scaler"],
    }


def initial_state(weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The consolidated state (:func:`consolidate`'s form) of a torch AdamW over ``weights``
    that has not stepped yet: fp32 masters, no moments, matrices in parameter group 0 (weight
    decay) and the rest in group 1 (:func:`~mt_zero.decays`). A run that loads it sets its
    own learning rate, weight decay, betas and eps; converters write it so that training
    starts from given weights."""
    dummy = [torch.zeros(1), torch.zeros(1)]
    adamw = torch.optim.AdamW([{"params": [dummy[0]], "weight_decay": 0.1},
                               {"params": [dummy[1]], "weight_decay": 0.0}], lr=0.0)
    master = {n: t.detach().to(torch.float32).clone() for n, t in weights.items()}
    return {
        "format": FULL_FORMAT,
        "shapes": {n: tuple(t.shape) for n, t in master.items()},
        "param_groups": [{k: v for k, v in group.items() if k != "params"}
                         for group in adamw.state_dict()["param_groups"]],
        "group_of": {n: 0 if decays(t) else 1 for n, t in master.items()},
        "master": master,
        "state": {n: {"sharded": {}, "replicated": {}} for n in master},
        "scaler": None,
    }


def split_consolidated(full: dict[str, Any], dp_size: int, stage: int) -> list[dict[str, Any]]:
    """The shards ``dp_size`` ranks at ZeRO ``stage`` would save for ``full`` state (the
    inverse of :func:`consolidate`, without an optimizer): one flat buffer over the
    parameters in ``full``'s order, partitioned as :func:`~mt_zero.partition` splits it
    (stage 0: every rank holds everything). Converters write checkpoints of another layout
    with it; :func:`consolidate` of the result is ``full`` again."""
    if full.get("format") != FULL_FORMAT:
        raise ValueError(f"expected state in format {FULL_FORMAT!r}, got {full.get('format')!r}")
    names = list(full["master"])
    layout = partition([full["master"][n].numel() for n in names], dp_size if stage else 1)
    shards = []
    for dp_rank in range(dp_size):
        pieces, master, state = [], [], []
        for piece in layout.pieces(dp_rank if stage else 0):
            name = names[piece.param_index]
            lo, hi = piece.param_offset, piece.param_offset + piece.length
            pieces.append({"name": name, "offset": lo, "length": piece.length,
                           "group": full["group_of"][name]})
            master.append(full["master"][name].reshape(-1)[lo:hi].clone())
            saved = full["state"][name]
            part = {k: t.reshape(-1)[lo:hi].clone() for k, t in saved["sharded"].items()}
            part.update({k: v.clone() if isinstance(v, torch.Tensor) else v
                         for k, v in saved["replicated"].items()})
            state.append(part)
        shards.append({"format": SHARD_FORMAT, "stage": stage, "dp_size": dp_size,
                       "dp_rank": dp_rank, "shapes": {n: tuple(full["master"][n].shape)
                                                      for n in names},
                       "param_groups": full["param_groups"], "pieces": pieces,
                       "master": master, "state": state, "scaler": full["scaler"]})
    return shards


def load_consolidated(opt: ZeroOptimizer, full: dict[str, Any]) -> None:
    """Load a :func:`consolidate` d state into ``opt`` at its own DP size and ZeRO stage.

    Every rank of the data-parallel group calls this with the same ``full`` state (it
    re-publishes the parameters, a collective). Hyperparameters of the parameter groups
    (learning rate, weight decay, ...) come from the checkpoint, as with
    ``torch.optim.Optimizer.load_state_dict``.
    """
    if full.get("format") != FULL_FORMAT:
        raise ValueError(f"expected a state in format {FULL_FORMAT!r}, got {full.get('format')!r}")
    mine, theirs = opt.shapes, {n: tuple(s) for n, s in full["shapes"].items()}
    if mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))
        raise ValueError(f"checkpoint parameters differ from the model's: {diff}")
    groups = opt.optimizer.param_groups
    if len(groups) != len(full["param_groups"]):
        raise ValueError(f"checkpoint has {len(full['param_groups'])} parameter groups, "
                         f"the optimizer {len(groups)}")
    index = _optimizer_index(opt)
    state: dict[int, dict[str, Any]] = {}
    with torch.no_grad():
        for mp in opt.pieces:
            lo, hi = mp.param_offset, mp.param_offset + mp.length
            mp.tensor.copy_(full["master"][mp.name].reshape(-1)[lo:hi])
            saved = full["state"][mp.name]
            piece_state = {k: t.reshape(-1)[lo:hi].clone() for k, t in saved["sharded"].items()}
            piece_state.update({k: v.clone() if isinstance(v, torch.Tensor) else v
                                for k, v in saved["replicated"].items()})
            if piece_state:
                state[index[id(mp.tensor)]] = piece_state
    numbering, start = [], 0
    for g in groups:
        numbering.append(list(range(start, start + len(g["params"]))))
        start += len(g["params"])
    opt.optimizer.load_state_dict({
        "state": state,
        "param_groups": [{**saved, "params": ids}
                         for saved, ids in zip(full["param_groups"], numbering)],
    })
    if opt.scaler is not None and full.get("scaler") is not None:
        opt.scaler = opt.scaler.load_state_dict(full["scaler"])
    opt.zero_grad()
    opt.publish()
