"""Resharding without training runs: optimizer state of a GPT cut for TP 2 and merged back
is the original, bit for bit; weights of (stage, TP) parts merge to the full model."""

from __future__ import annotations

import torch
from torch import nn

from mt_checkpoint import canonical_optimizer, local_optimizer, merge_model
from mt_model import GPT, parameter_stages, preset
from mt_tensor_parallel import GPT_PLAN, padded_vocab_size, param_styles, shard_tensor
from mt_zero import (
    ZeroConfig,
    ZeroOptimizer,
    consolidate,
    decay_param_groups,
    optimizer_shard_state,
)

CONFIG = preset("tiny").replace(n_layers=2, vocab_size=1001)  # odd vocabulary: padding


def _optimizer_of(tensors: dict[str, torch.Tensor]) -> ZeroOptimizer:
    """A one-process ZeRO optimizer over parameters named and shaped as ``tensors``, with
    some Adam state (one step of a fixed gradient)."""
    holder = nn.Module()
    for i, value in enumerate(tensors.values()):
        holder.register_parameter(f"p{i}", nn.Parameter(value.clone()))
    named = dict(zip(tensors, holder.parameters()))

    class Named(nn.Module):  # parameter names with dots, as the GPT's
        def named_parameters(self, *args: object, **kwargs: object):  # type: ignore[override]
            return iter(named.items())

        def parameters(self, *args: object, **kwargs: object):  # type: ignore[override]
            return iter(named.values())

    model = Named()
    opt = ZeroOptimizer(model, lambda g: torch.optim.AdamW(g, lr=1e-3), None,
                        ZeroConfig(stage=1), param_groups=decay_param_groups(named.items(), 0.1))
    for p in named.values():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    return opt


def test_tp_cut_and_merge_round_trip_the_optimizer_state() -> None:
    full = dict(GPT(CONFIG).named_parameters())
    names = list(full)
    styles = param_styles(names, GPT_PLAN)
    tp = 2
    # What two TP ranks of one stage would hold: their slices, each its own optimizer.
    shards_by_tp = [[optimizer_shard_state(_optimizer_of({
        n: shard_tensor(styles[n], t.detach(), rank, tp) for n, t in full.items()}))]
        for rank in range(tp)]
    canonical = canonical_optimizer(shards_by_tp, names, styles, CONFIG.vocab_size)
    for name, tensor in full.items():
        assert canonical["master"][name].shape == tensor.shape, name  # padding dropped
    for rank in range(tp):  # cut again for each TP rank: the very state it came from
        local = local_optimizer(canonical, names, styles, rank, tp)
        want = consolidate(shards_by_tp[rank])
        rows = padded_vocab_size(CONFIG.vocab_size, tp) // tp
        real = max(0, min(rows, CONFIG.vocab_size - rank * rows))  # padding rows: none
        for name in names:
            for key in ("master", "exp_avg", "exp_avg_sq"):
                got = local["master"][name] if key == "master" else \
                    local["state"][name]["sharded"][key]
                expected = want["master"][name] if key == "master" else \
                    want["state"][name]["sharded"][key]
                if styles[name] == "vocab":  # padding is dropped on merge, zero on a cut
                    assert torch.equal(got[:real], expected[:real]), (name, key)
                    assert torch.all(got[real:] == 0), (name, key)
                else:
                    assert torch.equal(got, expected), (name, key)
        assert local["param_groups"] == canonical["param_groups"]
    one = local_optimizer(canonical, names, styles, 0, 1)  # and for one process: full shapes
    assert all(one["master"][n].shape == full[n].shape for n in names)


def test_merge_model_joins_stages_and_tp_slices() -> None:
    model = GPT(CONFIG)
    full = {n: p.detach() for n, p in model.named_parameters()}
    styles = param_styles(list(full), GPT_PLAN)
    stage_layers = [range(0, 1), range(1, 2)]
    parts = {(stage, rank): {n: shard_tensor(styles[n], t, rank, 2) for n, t in full.items()
                             if stage in parameter_stages(n, stage_layers)}
             for stage in range(2) for rank in range(2)}
    merged = merge_model(parts, styles, CONFIG.vocab_size)
    assert merged.keys() == full.keys()
    assert all(torch.equal(merged[n], full[n]) for n in full)
