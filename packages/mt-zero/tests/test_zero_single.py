"""ZeroOptimizer in one process (``dp_group=None``): the sharding machinery without
communication must train bit-for-bit like plain torch, and its bookkeeping must hold."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mt_zero import (
    ZeroConfig,
    ZeroOptimizer,
    assign_units,
    consolidate,
    decay_param_groups,
    default_units,
    load_consolidated,
    optimizer_shard_state,
)
from mt_zero.testing import TinyLM, make_batches, reference_train

BATCHES = make_batches(4, batch=4, seq=5, vocab=32)


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _make(stage: int, precision: str = "fp32", **cfg: object) -> tuple[TinyLM, ZeroOptimizer]:
    model = TinyLM()
    opt = ZeroOptimizer(
        model, lambda g: torch.optim.AdamW(g, lr=1e-2), None,
        ZeroConfig(stage=stage, precision=precision, bucket_numel=300, **cfg),
        param_groups=decay_param_groups(model.named_parameters(), 0.1))
    return model, opt


def _train(model: TinyLM, opt: ZeroOptimizer, batches: list) -> list[float]:
    losses = []
    for idx, targets in batches:
        loss = model(idx, targets)
        opt.backward(loss)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_single_process_matches_reference_exactly(stage: int, precision: str) -> None:
    ref_losses, ref_params = reference_train(TinyLM(), BATCHES, precision, 1e-2, 0.1)
    model, opt = _make(stage, precision)
    assert _train(model, opt, BATCHES) == ref_losses
    params = opt.full_parameters()
    for name, want in ref_params.items():
        assert torch.equal(params[name], want), name
    # The model's compute parameters are the master weights rounded to the compute dtype.
    with opt.gathered():
        for name, p in model.named_parameters():
            assert p.dtype == (torch.float32 if precision == "fp32" else torch.bfloat16)
            assert torch.equal(p, params[name].to(p.dtype)), name


def test_stage3_units_and_tied_embedding() -> None:
    model = TinyLM(layers=2)
    units = default_units(model)
    assert units == [model, model.blocks[0], model.blocks[1]]
    params = list(model.parameters())
    owners = assign_units(model, units, params)
    names = [n for n, _ in model.named_parameters()]
    assert {n: o for n, o in zip(names, owners)}["embed.weight"] == 0
    assert {n: o for n, o in zip(names, owners)}["blocks.1.fc1.weight"] == 2
    # A weight shared by two sibling units belongs to their common ancestor.
    model.blocks[1].fc1.weight = model.blocks[0].fc1.weight
    owners = assign_units(model, units, list(model.parameters()))
    shared = [n for n, _ in model.named_parameters()].index("blocks.0.fc1.weight")
    assert owners[shared] == 0
    with pytest.raises(ValueError, match="units\\[0\\]"):
        assign_units(model, units[1:], params)


def test_stage3_frees_parameters_between_uses() -> None:
    model, opt = _make(3)
    assert all(not b.gathered for b in opt.buckets)
    seen = []
    hook = model.blocks[1].register_forward_pre_hook(  # runs after the gathering pre-hook
        lambda m, a: seen.append([b.gathered for b in opt.buckets]))
    loss = model(*BATCHES[0])
    hook.remove()
    # When block 1 started: the root (embedding, final norm) and block 1 were present,
    # block 0 had been freed. Launch order is reverse model order: block 1, block 0, root.
    block1, block0, root = opt.buckets
    assert block1.names[0].startswith("blocks.1") and block0.names[0].startswith("blocks.0")
    assert "embed.weight" in root.names
    assert seen == [[True, False, True]]
    assert all(not b.gathered for b in opt.buckets)  # all freed after forward
    opt.backward(loss)
    assert all(not b.gathered for b in opt.buckets)  # and again after backward
    assert all(p.grad is None for p in model.parameters())  # reduced into the shard
    assert opt.step().grad_norm > 0


@pytest.mark.parametrize("main_grads", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_accumulation_in_fp32_main_grads_or_bf16(stage: int, main_grads: bool) -> None:
    """Four micro-batches per step: with main gradients every micro-batch's bf16 gradient is
    summed in fp32, without them in bf16, exactly as the reference does each."""
    micro = 4
    want = reference_train(TinyLM(), BATCHES, "bf16", 1e-2, 0.1, micro_batches=micro,
                           main_grads=main_grads)
    other = reference_train(TinyLM(), BATCHES, "bf16", 1e-2, 0.1, micro_batches=micro,
                            main_grads=not main_grads)
    model, opt = _make(stage, "bf16", main_grads=main_grads)
    losses = []
    for idx, targets in BATCHES:
        total = 0.0
        for i, (x, y) in enumerate(zip(idx.chunk(micro), targets.chunk(micro))):
            with opt.no_sync() if i < micro - 1 else contextlib.nullcontext():
                part = model(x, y) / micro
                opt.backward(part)
            total += part.detach()
        if stage < 2:  # the full gradient, in fp32 or in bf16
            assert opt.memory().grads == sum(p.numel() for p in model.parameters()) * (
                4 if main_grads else 2)
        opt.step()
        losses.append(float(total))
    assert losses == want[0]
    params = opt.full_parameters()
    for name, ref in want[1].items():
        assert torch.equal(params[name], ref), (name, stage, main_grads)
    # The two ways of summing differ: the test can tell one from the other.
    assert any(not torch.equal(params[n], other[1][n]) for n in params)


def test_no_sync_accumulation_and_foreign_grads() -> None:
    ref_losses, ref_params = reference_train(TinyLM(), BATCHES, "fp32", 1e-2, 0.1)
    for stage in (0, 1, 2, 3):
        model, opt = _make(stage)
        for idx, targets in BATCHES:
            with opt.no_sync():
                opt.backward(model(idx[:2], targets[:2]) / 2)
            if stage < 2:
                # A user zeroing .grad to None between micro-batches must not lose the first.
                saved = {n: p.grad.clone() for n, p in model.named_parameters()}
                model.zero_grad(set_to_none=True)
                for n, p in model.named_parameters():
                    p.grad = saved[n]
            opt.backward(model(idx[2:], targets[2:]) / 2)
            opt.step()
        for name, want in ref_params.items():
            got = opt.full_parameters()[name]
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (stage, name)


def test_checkpoint_round_trip_across_stages() -> None:
    ref_losses, ref_params = reference_train(TinyLM(), BATCHES, "bf16", 1e-2, 0.1)
    model, opt = _make(3, "bf16")
    first = _train(model, opt, BATCHES[:2])
    full = consolidate([optimizer_shard_state(opt)])
    model2, opt2 = _make(0, "bf16")
    load_consolidated(opt2, full)
    assert first + _train(model2, opt2, BATCHES[2:]) == ref_losses
    for name, want in ref_params.items():
        assert torch.equal(opt2.full_parameters()[name], want), name
    full["shapes"]["embed.weight"] = (1, 2)
    with pytest.raises(ValueError, match="embed.weight"):
        load_consolidated(opt2, full)
    with pytest.raises(ValueError, match="incomplete"):
        shard = optimizer_shard_state(opt2)
        shard["pieces"], shard["master"], shard["state"] = (
            shard["pieces"][1:], shard["master"][1:], shard["state"][1:])
        consolidate([shard])


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_buckets_launch_while_backward_runs(stage: int) -> None:
    model, opt = _make(stage)
    assert len(opt.buckets) >= 3
    launched_before_embedding_grad = []
    # The embedding is used first in forward, so its gradient is among the last computed;
    # by then the buckets of the blocks must already be reducing (overlap).
    model.embed.weight.register_hook(
        lambda g: launched_before_embedding_grad.append(opt.grad_sync.launched))
    with opt.no_sync():
        opt.backward(model(*BATCHES[0]))
    assert launched_before_embedding_grad == [0]  # nothing communicated under no_sync
    opt.backward(model(*BATCHES[0]))
    assert launched_before_embedding_grad[1] >= 1
    assert opt.grad_sync.launched == 0  # all finished and reset at the end of backward


def test_param_groups_must_cover_trainable_parameters() -> None:
    model = TinyLM()
    groups = decay_param_groups(model.named_parameters(), 0.1)[:1]
    with pytest.raises(ValueError, match="ln_f.weight"):
        ZeroOptimizer(model, lambda g: torch.optim.AdamW(g), None, param_groups=groups)


def test_split_consolidated_is_the_inverse_of_consolidate() -> None:
    """A converter's shards for another DP size and stage consolidate back to the same
    state, bit for bit (and the one-process optimizer's own state goes through it)."""
    from mt_zero import split_consolidated

    model = TinyLM()
    opt = ZeroOptimizer(model, lambda g: torch.optim.AdamW(g, lr=1e-2), None,
                        ZeroConfig(stage=1),
                        param_groups=decay_param_groups(model.named_parameters(), 0.1))
    idx, targets = make_batches(1, batch=4, seq=6, vocab=32)[0]
    opt.backward(model(idx, targets))
    opt.step()
    full = consolidate([optimizer_shard_state(opt)])
    for dp, stage in ((1, 0), (3, 1), (4, 2), (2, 0)):
        shards = split_consolidated(full, dp, stage)
        assert [s["dp_rank"] for s in shards] == list(range(dp))
        again = consolidate(shards)
        assert again["group_of"] == full["group_of"] and again["scaler"] == full["scaler"]
        for name, tensor in full["master"].items():
            assert torch.equal(again["master"][name], tensor), (dp, stage, name)
            for key, value in full["state"][name]["sharded"].items():
                assert torch.equal(again["state"][name]["sharded"][key], value), (name, key)
            assert again["state"][name]["replicated"].keys() == \
                full["state"][name]["replicated"].keys()
