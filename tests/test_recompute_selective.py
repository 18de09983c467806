"""Selective recomputation (mt-pipeline's ``run_layers``) on mt-model's real blocks: the same
bits as keeping everything, in less memory, and no matmul run twice."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mt_model import GPT, preset
from mt_pipeline import run_layers
from mt_pipeline.checkpointing import recompute_mode


def _loss_and_grads(model: GPT, idx: torch.Tensor, mode: str) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    x = run_layers(list(model.blocks), model.embed(idx), mode)
    logits = model.head(model.ln_f(x), model.embed.tokens.weight
                        if model.config.tied_embeddings else None)
    loss = model.loss_fn(logits, idx.roll(-1, 1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["tiny", "llama-test"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_gives_the_same_bits_as_keeping_everything(name: str,
                                                              dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = GPT(preset(name)).to(dtype)
    idx = torch.randint(0, model.config.vocab_size, (2, 32))
    loss, grads = _loss_and_grads(model, idx, "none")
    for mode in ("selective", "full"):
        other_loss, other = _loss_and_grads(model, idx, mode)
        assert torch.equal(other_loss, loss), mode
        for n, g in grads.items():
            assert torch.equal(other[n], g), (name, dtype, mode, n)


@pytest.mark.parametrize("name", ["tiny", "llama-test"])
def test_with_dropout_the_attention_core_is_recomputed_with_the_same_masks(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention dropout: the unfused kernel keeps [b, n, s, s] tensors, so selective
    recomputation runs the core again in backward; its masks are the forward's."""
    config = preset(name).replace(dropout=0.1, attention_dropout=0.1)
    model = GPT(config).train()
    idx = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    sdpa, cores = F.scaled_dot_product_attention, []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        cores.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    runs = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(7)
        cores.clear()
        runs[mode] = _loss_and_grads(model, idx, mode)
        assert len(cores) == config.n_layers * (1 if mode == "none" else 2), mode
    loss, grads = runs["none"]
    for mode in ("selective", "full"):
        assert torch.equal(runs[mode][0], loss), mode
        for n, g in grads.items():
            assert torch.equal(runs[mode][1][n], g), (name, mode, n)
    # Without dropout the core keeps little (a fused kernel): it is not run again.
    assert not any(getattr(m, "selective_checkpoint", False) for m in model.eval().modules())


def test_selective_runs_no_matmul_twice_and_recomputes_the_cheap_modules() -> None:
    model = GPT(preset("tiny"))
    idx = torch.randint(0, 1000, (2, 16))
    calls: dict[str, int] = {}

    def count(kind: str):
        def hook(*_args: object) -> None:
            calls[kind] = calls.get(kind, 0) + 1
        return hook

    for module in model.blocks.modules():
        kind = ("linear" if isinstance(module, nn.Linear) else
                "norm" if isinstance(module, nn.LayerNorm) else
                "act" if isinstance(module, nn.GELU) else None)
        if kind is not None:
            module.register_forward_hook(count(kind))
    counts = {}
    for mode in ("none", "selective", "full"):
        calls.clear()
        _loss_and_grads(model, idx, mode)
        counts[mode] = dict(calls)
    layers = model.config.n_layers
    assert counts["none"] == {"linear": 4 * layers, "norm": 2 * layers, "act": layers}
    # Selective: the norms and the GeLU once more in backward, every matmul once.
    assert counts["selective"] == {"linear": 4 * layers, "norm": 4 * layers, "act": 2 * layers}
    # Full: everything twice, but the last matmul of each layer (torch's non-reentrant
    # checkpoint stops its recomputation once backward has what it needs).
    assert counts["full"] == {"linear": 7 * layers, "norm": 4 * layers, "act": 2 * layers}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _mmap_large_blocks() -> None:
    """glibc: blocks above 64 KiB from mmap, always (the threshold otherwise grows after
    each free, and freed memory stays resident in the heap), so resident memory follows what
    is held."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    assert libc.mallopt(-3, 64 << 10) == 1  # M_MMAP_THRESHOLD


def test_selective_keeps_less_than_everything_and_more_than_full() -> None:
    """Bytes held between forward and backward (resident memory; glibc returns these large
    blocks to the system when freed): GPT-2 layers keep 32 sbh 16-bit bytes without
    recomputation, 20 with selective (mt-plan's figures), the layer inputs with full."""
    _mmap_large_blocks()
    torch.manual_seed(0)
    config = preset("tiny").replace(hidden=256, n_heads=4, seq_len=512, n_layers=4)
    model = GPT(config).to(torch.bfloat16)
    idx = torch.randint(0, config.vocab_size, (4, 512))
    held = {}
    for mode in ("none", "selective", "full"):
        for _ in range(2):  # the second time, the allocator is warm
            gc.collect()
            before = _rss()
            x = run_layers(list(model.blocks), model.embed(idx), mode)
            held[mode] = _rss() - before
            x.float().sum().backward()
            del x
            model.zero_grad(set_to_none=True)
    sbh = 4 * 512 * 256
    per_layer = {mode: held[mode] / config.n_layers / sbh for mode in held}
    # 32 sbh and 20 sbh (2 bytes each), within the embedding's and the allocator's share.
    assert 28 < per_layer["none"] < 38, per_layer
    assert 17 < per_layer["selective"] < 24, per_layer
    assert per_layer["full"] < 6, per_layer


def _sequence_parallel_modes() -> dict[str, tuple[int, torch.Tensor, dict]]:
    """On a TP + SP rank: per mode, the sequence-parallel norms' forward calls, the output
    and every gradient of the blocks."""
    from mt_tensor_parallel import GPT_PLAN, SequenceParallelLayerNorm, apply_tensor_parallel

    model = apply_tensor_parallel(GPT(preset("tiny"), seed=0), dist.group.WORLD, GPT_PLAN,
                                  sequence_parallel=True)
    calls = [0]

    def count(*_args: object) -> None:
        calls[0] += 1

    for module in model.blocks.modules():
        if isinstance(module, SequenceParallelLayerNorm):
            module.register_forward_hook(count)
    idx = torch.randint(0, model.config.vocab_size, (2, 32),
                        generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in ("none", "selective"):
        calls[0] = 0
        model.zero_grad(set_to_none=True)
        x = run_layers(list(model.blocks), model.embed(idx), mode)
        x.pow(2).sum().backward()
        out[mode] = (calls[0], x.detach(),
                     {n: p.grad.clone() for n, p in model.blocks.named_parameters()})
    return out


def test_selective_recomputes_the_sequence_parallel_norms() -> None:
    """Under TP 2 + SP the column layers keep their input's sequence slice, which is the
    norm's output: selective recomputation makes it again in backward instead of keeping it
    (each norm runs twice), with the same bits."""
    from mt_dist.testing import run_distributed

    layers = preset("tiny").n_layers
    for rank, modes in enumerate(run_distributed(_sequence_parallel_modes, 2, timeout=120)):
        (calls, x, grads), (sel_calls, sel_x, sel_grads) = modes["none"], modes["selective"]
        assert calls == 2 * layers and sel_calls == 4 * layers, (rank, calls, sel_calls)
        assert torch.equal(sel_x, x), rank
        assert all(torch.equal(sel_grads[n], g) for n, g in grads.items()), rank


def test_recompute_modes() -> None:
    assert [recompute_mode(m) for m in (True, False, "selective")] == [
        "full", "none", "selective"]
    with pytest.raises(ValueError, match="'some' is not one of none, selective, full"):
        recompute_mode("some")
