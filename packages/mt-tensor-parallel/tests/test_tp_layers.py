"""Parallel layers against their single-process references (nn.Linear, nn.Embedding,
nn.LayerNorm, F.cross_entropy) on 2 and 4 gloo ranks: outputs and every gradient.

Each rank builds the same full reference and its own parallel layer, runs both, and returns
``(check name, got, want)`` triples; the parent asserts. float64 makes the comparison tight.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mt_dist.testing import run_distributed
from mt_tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
    VocabParallelHead,
    padded_vocab_size,
    shard_tensor,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)
from mt_tensor_parallel.mappings import copy_to_tp, gather_from_sequence

DTYPE = torch.float64
B, S, H, VOCAB = 2, 8, 16, 1001
Check = tuple[str, torch.Tensor, torch.Tensor]


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _linear(seed: int, fan_in: int, fan_out: int) -> nn.Linear:
    layer = nn.Linear(fan_in, fan_out, dtype=DTYPE)
    with torch.no_grad():
        layer.weight.copy_(_rand(seed, fan_out, fan_in))
        layer.bias.copy_(_rand(seed + 1, fan_out))
    return layer


def _last(style: str, t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Shard the last dim of ``t`` with a parameter style (which cuts dim 0)."""
    return shard_tensor(style, t.movedim(-1, 0), rank, n).movedim(0, -1)


def _seq(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    return t.chunk(n, dim=1)[rank]


def _column_checks(group: dist.ProcessGroup, rank: int, n: int) -> list[Check]:
    checks: list[Check] = []
    for qkv, sp, gather in [(False, False, False), (True, False, False), (True, True, False),
                            (False, False, True)]:
        name = f"column(qkv={qkv}, sp={sp}, gather={gather})"
        style = "column_qkv" if qkv else "column"
        ref = _linear(1, H, 24)
        layer = ColumnParallelLinear.from_linear(ref, group, fused_chunks=3 if qkv else 1,
                                                 sequence_parallel=sp, gather_output=gather)
        x_full, g_full = _rand(3, B, S, H).requires_grad_(), _rand(4, B, S, 24)
        ref(x_full).backward(g_full)
        x = (_seq(x_full, rank, n) if sp else x_full).detach().requires_grad_()
        out = layer(x)
        out.backward(g_full if gather else _last(style, g_full, rank, n))
        want_out = ref(x_full).detach()
        checks += [
            (f"{name} out", out, want_out if gather else _last(style, want_out, rank, n)),
            (f"{name} dx", x.grad, _seq(x_full.grad, rank, n) if sp else x_full.grad),
            (f"{name} dW", layer.weight.grad, shard_tensor(style, ref.weight.grad, rank, n)),
            (f"{name} db", layer.bias.grad, shard_tensor(style, ref.bias.grad, rank, n)),
        ]
    return checks


def _row_checks(group: dist.ProcessGroup, rank: int, n: int) -> list[Check]:
    checks: list[Check] = []
    for parallel_in, sp in [(True, False), (True, True), (False, False)]:
        name = f"row(input_is_parallel={parallel_in}, sp={sp})"
        ref = _linear(5, 24, H)
        layer = RowParallelLinear.from_linear(ref, group, input_is_parallel=parallel_in,
                                              sequence_parallel=sp)
        x_full, g_full = _rand(7, B, S, 24).requires_grad_(), _rand(8, B, S, H)
        want_out = ref(x_full)
        want_out.backward(g_full)
        x = (_last("column", x_full, rank, n) if parallel_in else x_full)
        x = x.detach().requires_grad_()
        out = layer(x)
        out.backward(_seq(g_full, rank, n) if sp else g_full)
        want_dx = _last("column", x_full.grad, rank, n) if parallel_in else x_full.grad
        checks += [
            (f"{name} out", out, _seq(want_out, rank, n) if sp else want_out),
            (f"{name} dx", x.grad, want_dx),
            (f"{name} dW", layer.weight.grad, shard_tensor("row", ref.weight.grad, rank, n)),
            (f"{name} db", layer.bias.grad, ref.bias.grad),
        ]
    return checks


def _ids() -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(9))
    ids[0, 0], ids[1, -1] = 0, VOCAB - 1  # both ends of the vocabulary
    return ids


def _embedding_checks(group: dist.ProcessGroup, rank: int, n: int) -> list[Check]:
    checks: list[Check] = []
    for reduce in ("all", "sequence"):
        ref = nn.Embedding(VOCAB, H, dtype=DTYPE)
        with torch.no_grad():
            ref.weight.copy_(_rand(10, VOCAB, H))
        layer = VocabParallelEmbedding.from_embedding(ref, group, reduce=reduce)
        ids, g_full = _ids(), _rand(11, B, S, H)
        want = ref(ids)
        want.backward(g_full)
        out = layer(ids)
        out.backward(_seq(g_full, rank, n) if reduce == "sequence" else g_full)
        checks += [
            (f"embedding({reduce}) out", out, _seq(want, rank, n) if reduce == "sequence"
             else want),
            (f"embedding({reduce}) dW", layer.weight.grad,
             shard_tensor("vocab", ref.weight.grad, rank, n)),
        ]
    return checks


def _cross_entropy_checks(group: dist.ProcessGroup, rank: int, n: int) -> list[Check]:
    padded = padded_vocab_size(VOCAB, n)
    logits = 3 * _rand(12, B, S, VOCAB)
    targets = _ids()
    targets[0, 3] = -100  # ignored token
    logits.requires_grad_()
    want = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    want.backward()
    # Padding columns get large garbage values: they must be excluded from the softmax.
    garbage = torch.full((B, S, padded - VOCAB), 30.0, dtype=DTYPE)
    full = torch.cat([logits.detach(), garbage], dim=-1)
    local = _last("column", full, rank, n).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, group, VOCAB)
    loss.backward()
    want_grad = torch.cat([logits.grad, torch.zeros_like(garbage)], dim=-1)
    per_token = vocab_parallel_cross_entropy(local, targets, group, VOCAB, reduction="none")
    want_per_token = F.cross_entropy(logits.detach().reshape(-1, VOCAB), targets.reshape(-1),
                                     reduction="none").view(B, S)
    return [("cross_entropy loss", loss, want.detach()),
            ("cross_entropy dlogits", local.grad, _last("column", want_grad, rank, n)),
            ("cross_entropy per token", per_token, want_per_token)]


def _head_loss_checks(group: dist.ProcessGroup, rank: int, n: int) -> list[Check]:
    """Tied head + cross entropy, replicated and sequence-parallel hidden states."""
    checks: list[Check] = []
    for sp in (False, True):
        weight_full = _rand(13, VOCAB, H).requires_grad_()
        hidden_full = _rand(14, B, S, H).requires_grad_()
        targets = _ids()
        want = F.cross_entropy(F.linear(hidden_full, weight_full).reshape(-1, VOCAB),
                               targets.reshape(-1))
        want.backward()
        weight = shard_tensor("vocab", weight_full.detach(), rank, n).requires_grad_()
        hidden = (_seq(hidden_full, rank, n) if sp else hidden_full).detach().requires_grad_()
        loss = vocab_parallel_cross_entropy(VocabParallelHead(group, sp)(hidden, weight),
                                            targets, group, VOCAB)
        loss.backward()
        checks += [
            (f"head(sp={sp}) loss", loss, want.detach()),
            (f"head(sp={sp}) dhidden", hidden.grad,
             _seq(hidden_full.grad, rank, n) if sp else hidden_full.grad),
            (f"head(sp={sp}) dW", weight.grad,
             shard_tensor("vocab", weight_full.grad, rank, n)),
        ]
    return checks


def _fused_head_loss_checks(group: dist.ProcessGroup, rank: int, n: int) -> list[Check]:
    """The head and the cross entropy in one, 5 tokens a chunk (never the logits): the
    same loss and gradients, replicated and sequence-parallel hidden states."""
    checks: list[Check] = []
    for sp in (False, True):
        weight_full = _rand(13, VOCAB, H).requires_grad_()
        hidden_full = _rand(14, B, S, H).requires_grad_()
        targets = _ids()
        targets[1, 2] = -100
        want = F.cross_entropy(F.linear(hidden_full, weight_full).reshape(-1, VOCAB),
                               targets.reshape(-1))
        want.backward()
        weight = shard_tensor("vocab", weight_full.detach(), rank, n).requires_grad_()
        hidden = (_seq(hidden_full, rank, n) if sp else hidden_full).detach().requires_grad_()
        loss = vocab_parallel_linear_cross_entropy(hidden, weight, targets, group, VOCAB,
                                                   sequence_parallel=sp, chunk=5)
        loss.backward()
        checks += [
            (f"fused head(sp={sp}) loss", loss, want.detach()),
            (f"fused head(sp={sp}) dhidden", hidden.grad,
             _seq(hidden_full.grad, rank, n) if sp else hidden_full.grad),
            (f"fused head(sp={sp}) dW", weight.grad,
             shard_tensor("vocab", weight_full.grad, rank, n)),
        ]
    return checks


def _norm_checks(group: dist.ProcessGroup, rank: int, n: int) -> list[Check]:
    ref = nn.LayerNorm(H, dtype=DTYPE)
    with torch.no_grad():
        ref.weight.copy_(_rand(15, H))
        ref.bias.copy_(_rand(16, H))
    layer = SequenceParallelLayerNorm.from_layernorm(ref, group)
    x_full, g_full = _rand(17, B, S, H).requires_grad_(), _rand(18, B, S, H)
    want = ref(x_full)
    want.backward(g_full)
    x = _seq(x_full, rank, n).detach().requires_grad_()
    out = layer(x)
    out.backward(_seq(g_full, rank, n))
    return [("sp_norm out", out, _seq(want, rank, n)),
            ("sp_norm dx", x.grad, _seq(x_full.grad, rank, n)),
            ("sp_norm dweight", layer.weight.grad, ref.weight.grad),
            ("sp_norm dbias", layer.bias.grad, ref.bias.grad)]


def _all_checks() -> list[Check]:
    group, rank, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    checks: list[Check] = []
    for make in (_column_checks, _row_checks, _embedding_checks, _cross_entropy_checks,
                 _head_loss_checks, _fused_head_loss_checks, _norm_checks):
        checks += [(name, got.detach(), want.detach()) for name, got, want in
                   make(group, rank, n)]
    return checks


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_layers_match_single_process(tp: int) -> None:
    results = run_distributed(_all_checks, tp, timeout=120)
    assert len(results[0]) == 51
    for rank, checks in enumerate(results):
        for name, got, want in checks:
            assert got.shape == want.shape, f"{name} rank {rank}: {got.shape} != {want.shape}"
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12,
                                       msg=lambda m, n=name, r=rank: f"{n} rank {r}: {m}")


#: Whichever of these torch offers: mt_dist.collectives takes the first it finds.
COLLECTIVES = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor",
               "all_gather_single", "all_gather_into_tensor")


class _Order(TorchDispatchMode):
    """Records the matrix products run while active, beside the collectives' launches and
    waits that :func:`_column_overlap` marks in the same list."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten.mm.default:
            self.events.append("mm")
        return func(*args, **(kwargs or {}))


def _column_overlap() -> list[tuple[str, bool, list[str], int]]:
    """Per case: whether the layer's output and gradients equal, bit for bit, those of the
    composition it replaces (the input's mapping, then ``F.linear`` under autograd), the
    order of the backward's matrix products and its collectives' launches and waits, and
    the elements of the activations the layer keeps for its backward."""
    group, rank, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    events: list[str] = []

    class Work:
        def __init__(self, work: dist.Work) -> None:
            self.work = work

        def wait(self) -> bool:
            events.append("wait")
            return self.work.wait()

    def marked(collective):  # noqa: ANN001, ANN202
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            work = collective(*args, **kwargs)
            if kwargs.get("async_op"):
                events.append("launch")
                return Work(work)
            events.append("blocking")
            return work
        return launch

    results = []
    for sp in (False, True):
        for bias in (True, False):
            ref = _linear(1, H, 24)
            layer = ColumnParallelLinear.from_linear(ref, group, sequence_parallel=sp)
            if not bias:
                layer.bias = None
            x_full, g_full = _rand(3, B, S, H), _rand(4, B, S, 24)
            x = (_seq(x_full, rank, n) if sp else x_full).requires_grad_()
            g = _last("column", g_full, rank, n)
            weight = layer.weight.detach().clone().requires_grad_()
            b = None if layer.bias is None else layer.bias.detach().clone().requires_grad_()
            x_ref = x.detach().clone().requires_grad_()
            gathered = gather_from_sequence(x_ref, group) if sp else copy_to_tp(x_ref, group)
            want = F.linear(gathered, weight, b)
            want.backward(g)
            kept: list[int] = []

            def pack(t: torch.Tensor, kept: list[int] = kept) -> torch.Tensor:
                if not isinstance(t, nn.Parameter):
                    kept.append(t.numel())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = layer(x)
            names = [name for name in COLLECTIVES if hasattr(dist, name)]
            originals = {name: getattr(dist, name) for name in names}
            for name in names:
                setattr(dist, name, marked(originals[name]))
            events.clear()
            try:
                with _Order(events):
                    out.backward(g)
            finally:
                for name in names:
                    setattr(dist, name, originals[name])
            same = [torch.equal(out, want), torch.equal(x.grad, x_ref.grad),
                    torch.equal(layer.weight.grad, weight.grad)]
            if bias:
                same.append(torch.equal(layer.bias.grad, b.grad))
            results.append((f"sp={sp} bias={bias}", all(same), list(events), sum(kept)))
    return results


def test_column_backward_runs_its_collective_under_the_weight_gradient() -> None:
    """The input gradient's all-reduce (reduce-scatter under SP) is launched after its own
    matrix product and waited for after the weight gradient's; under SP the layer keeps its
    input's sequence slice, not the gathered input, and gathers it again while the input
    gradient's product runs. The results are those of the plain composition, bit for bit."""
    n = 2
    for rank, cases in enumerate(run_distributed(_column_overlap, n, timeout=120)):
        assert len(cases) == 4
        for name, same, order, kept in cases:
            assert same, f"{name} rank {rank}: differs from the composition it replaces"
            if name.startswith("sp=True"):
                want = ["launch", "mm", "wait", "launch", "mm", "wait"]
                assert kept == B * S // n * H, f"{name} rank {rank}: keeps {kept} elements"
            else:
                want = ["mm", "launch", "mm", "wait"]
                assert kept == B * S * H, f"{name} rank {rank}: keeps {kept} elements"
            assert order == want, f"{name} rank {rank}: {order}"


def test_tp_layers_without_group_equal_references() -> None:
    ref = _linear(1, H, 24)
    x = _rand(3, B, S, H)
    torch.testing.assert_close(ColumnParallelLinear.from_linear(ref, None)(x), ref(x))
    torch.testing.assert_close(RowParallelLinear.from_linear(ref, None)(x), ref(x))
    emb = nn.Embedding(VOCAB, H, dtype=DTYPE)
    layer = VocabParallelEmbedding.from_embedding(emb, None)
    assert layer.weight.shape == (1024, H) and layer.weight[VOCAB:].eq(0).all()
    torch.testing.assert_close(layer(_ids()), emb(_ids()))


def test_tp_layer_argument_errors() -> None:
    with pytest.raises(ValueError, match="out_features 10 is not divisible by fused_chunks 3"):
        ColumnParallelLinear(4, 10, None, fused_chunks=3)
    with pytest.raises(ValueError, match="gather_output needs"):
        ColumnParallelLinear(4, 12, None, fused_chunks=3, gather_output=True)
    with pytest.raises(ValueError, match="reduce must be"):
        VocabParallelEmbedding(10, 4, None, reduce="max")
