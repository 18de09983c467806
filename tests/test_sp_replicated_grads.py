"""Replicated gradients under sequence parallelism summed once per step, in one bucket
(mt_tensor_parallel.defer_replicated_grads + ZeroOptimizer(partial_params=...)), on 4 gloo
ranks (TP 2 with SP x DP 2), ZeRO 0 and 3, 3 micro-batches per step: the same losses, grad
norms and weights as the per-backward all-reduce (copy_to_tp) within fp32 round-off, and
counted by mt_dist.trace: 3 x (the partial parameters) all-reduces over TP per step fewer,
plus the step's one. An optimizer not told about deferred parameters refuses to start.
The same through DeepSpeed's engine (mt_zero.deepspeed_engine.sum_partial_grads_at_boundary)
at ZeRO 1-3, in fp32 and bf16."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import pytest
import torch

from mt_dist import Topology, build_groups
from mt_dist.testing import run_distributed
from mt_dist.trace import CollectiveTrace
from mt_model import GPT, preset
from mt_tensor_parallel import (
    GPT_PLAN,
    apply_tensor_parallel,
    defer_replicated_grads,
    param_styles,
)
from mt_zero import ZeroConfig, ZeroOptimizer, counts_once

MICRO, STEPS, SEQ = 3, 2, 32


def _tokens(vocab: int, step: int, micro: int, replica: int) -> torch.Tensor:
    """The micro-batch of a data-parallel replica (TP ranks share it): 2 x (SEQ + 1)."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + replica)
    return torch.randint(0, vocab, (2, SEQ + 1), generator=generator)


def _tp_all_reduces(trace: CollectiveTrace) -> int:
    """All-reduces over TP since the last take."""
    return sum(r.kind == "all_reduce" and r.group == "tp" for r in trace.take())


def _train(stage: int, deferred: bool) -> dict[str, Any]:
    groups = build_groups(Topology(tp=2, dp=2))
    config = preset("tiny")
    model = apply_tensor_parallel(GPT(config, seed=0), groups.tp, GPT_PLAN,
                                  sequence_parallel=True)
    styles = param_styles(dict(model.named_parameters()), GPT_PLAN)
    partial = defer_replicated_grads(model) if deferred else []
    opt = ZeroOptimizer(
        # SGD: the weights move by the gradients themselves, so round-off stays round-off
        # (Adam turns a near-zero gradient's last bit into a step of lr).
        model, lambda g: torch.optim.SGD(g, lr=0.5), groups.dp, ZeroConfig(stage=stage),
        norm_groups=[groups.tp], partial_params=[p for _, p in partial],
        partial_group=groups.tp,
        count_in_norm=counts_once(groups.tp_rank,
                                  tp_replicated=lambda n, _p: styles[n] == "replicate"))
    losses, norms, tp_reduces = [], [], []
    with CollectiveTrace({groups.tp: "tp", groups.dp: "dp"}) as trace:
        for step in range(STEPS):
            total = 0.0
            for micro in range(MICRO):
                tokens = _tokens(config.vocab_size, step, micro, groups.dp_rank)
                with opt.no_sync() if micro < MICRO - 1 else torch.enable_grad():
                    loss = model.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
                    opt.backward(loss / MICRO)
                total += loss.item() / MICRO
            norms.append(opt.step().grad_norm)
            losses.append(total)
            tp_reduces.append(_tp_all_reduces(trace))
    with opt.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "tp_reduces": tp_reduces, "weights": weights,
            "partial": [n for n, _ in partial]}


def _both(stage: int) -> dict[str, Any]:
    return {"backward": _train(stage, False), "step": _train(stage, True)}


@pytest.mark.parametrize("stage", [0, 3])
def test_replicated_grads_summed_once_per_step_train_the_same(stage: int) -> None:
    for rank, run in enumerate(run_distributed(_both, 4, stage)):
        before, after = run["backward"], run["step"]
        partial = after["partial"]
        # tiny GPT: per block 2 LayerNorms (weight, bias) and 2 row-parallel biases; ln_f's
        # weight and bias; the position rows.
        layers = preset("tiny").n_layers
        assert len(partial) == 6 * layers + 3, partial
        assert "embed.positions.weight" in partial and before["partial"] == []
        fewer = [b - a for b, a in zip(before["tp_reduces"], after["tp_reduces"])]
        assert fewer == [MICRO * len(partial) - 1] * STEPS, (rank, before["tp_reduces"],
                                                             after["tp_reduces"])
        torch.testing.assert_close(after["losses"], before["losses"], rtol=1e-6, atol=0)
        torch.testing.assert_close(after["norms"], before["norms"], rtol=1e-5, atol=0)
        for name, weight in before["weights"].items():
            torch.testing.assert_close(after["weights"][name], weight, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


def _unsummed(_: None) -> str:
    groups = build_groups(Topology(tp=2))
    model = apply_tensor_parallel(GPT(preset("tiny"), seed=0), groups.tp, GPT_PLAN,
                                  sequence_parallel=True)
    defer_replicated_grads(model)
    try:
        ZeroOptimizer(model, lambda g: torch.optim.AdamW(g), None)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_an_optimizer_not_told_of_deferred_gradients_refuses() -> None:
    for message in run_distributed(_unsummed, 2, None):
        assert "embed.positions.weight: its module leaves the sum of its gradient" in message


def _train_deepspeed(stage: int, precision: str, main_grads: bool, mode: str
                     ) -> dict[str, Any]:
    """The same model, data and SGD through DeepSpeed's engine (mt's groups as its mpu), the
    replicated gradients summed per use (``mode`` "use"), once per step at DeepSpeed's
    accumulation boundary ("step"), or never (the control, "none")."""
    import deepspeed

    from mt_zero.deepspeed_engine import (
        deepspeed_config,
        initialize_deepspeed,
        sum_partial_grads_at_boundary,
    )
    from mt_zero.deepspeed_mpu import GroupsMpu

    groups = build_groups(Topology(tp=2, dp=2))
    config = preset("tiny")
    model = apply_tensor_parallel(GPT(config, seed=0), groups.tp, GPT_PLAN,
                                  sequence_parallel=True)
    styles = param_styles(dict(model.named_parameters()), GPT_PLAN)
    for name, param in model.named_parameters():  # DeepSpeed's norm: sliced ones per TP rank
        param.model_parallel = styles[name] != "replicate"  # type: ignore[attr-defined]
    partial = defer_replicated_grads(model) if mode != "use" else []
    engine = initialize_deepspeed(
        model, torch.optim.SGD(model.parameters(), lr=0.5),
        deepspeed_config(ZeroConfig(stage=stage, precision=precision, clip_grad=1e9,
                                    main_grads=main_grads), 2, MICRO, 2),
        mpu=GroupsMpu(groups))
    if mode == "step":
        sum_partial_grads_at_boundary(engine, [p for _, p in partial], groups.tp)
    losses, norms, tp_reduces = [], [], []
    with CollectiveTrace({groups.tp: "tp", groups.dp: "dp"}) as trace:
        for step in range(STEPS):
            total = 0.0
            for micro in range(MICRO):
                tokens = _tokens(config.vocab_size, step, micro, groups.dp_rank)
                loss = model.loss_fn(engine(tokens[:, :-1]), tokens[:, 1:])
                engine.backward(loss / MICRO, scale_wrt_gas=False)
                engine.step()
                total += loss.item() / MICRO
            norms.append(float(engine.get_global_grad_norm()))
            losses.append(total)
            tp_reduces.append(_tp_all_reduces(trace))
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "tp_reduces": tp_reduces, "weights": weights,
            "partial": [n for n, _ in partial]}


def _import_deepspeed() -> None:
    """Skip without DeepSpeed; else import it here, before the ranks are forked, with the
    Muon optimizer module its ``initialize`` imports (it loads inductor: seconds a process),
    as ``mt pretrain --nproc`` does for CPU ranks (not where CUDA is built: the import could
    initialize CUDA before the fork)."""
    pytest.importorskip("deepspeed")
    if not torch.backends.cuda.is_built():
        with contextlib.suppress(ImportError):
            importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")


def _deepspeed_runs(extensions: str, cases: list[tuple[int, str, bool, list[str]]]
                    ) -> list[dict[str, Any]]:
    import os

    import torch.distributed as dist

    from mt_zero.deepspeed_engine import deepspeed_environ

    os.environ.update(deepspeed_environ(dist.get_rank(), dist.get_world_size(),
                                        dist.get_rank()))
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions
    return [{mode: _train_deepspeed(stage, precision, main_grads, mode) for mode in modes}
            for stage, precision, main_grads, modes in cases]


def _check_fewer_reduces(rank: int, before: dict[str, Any], after: dict[str, Any]) -> None:
    assert len(after["partial"]) == 6 * preset("tiny").n_layers + 3
    fewer = [b - a for b, a in zip(before["tp_reduces"], after["tp_reduces"])]
    assert fewer == [MICRO * len(after["partial"]) - 1] * STEPS, (
        rank, before["tp_reduces"], after["tp_reduces"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_sums_replicated_grads_once_per_step(stage: int, tmp_path: Any) -> None:
    """DeepSpeed's engine, TP 2 + SP x DP 2, 3 micro-batches, fp32: the partial gradients
    summed once per step at DeepSpeed's accumulation boundary (before its data-parallel
    reduction at ZeRO 1, on each rank's partition after it at ZeRO 2 and 3) train as the
    per-use sums within fp32 round-off, with 3 x (the partial parameters) - 1 fewer TP
    all-reduces per step."""
    _import_deepspeed()
    runs = run_distributed(_deepspeed_runs, 4, str(tmp_path),
                           [(stage, "fp32", True, ["use", "step"])], timeout=300.0)
    for rank, [run] in enumerate(runs):
        before, after = run["use"], run["step"]
        _check_fewer_reduces(rank, before, after)
        torch.testing.assert_close(after["losses"], before["losses"], rtol=1e-6, atol=0)
        torch.testing.assert_close(after["norms"], before["norms"], rtol=1e-5, atol=0)
        for name, weight in before["weights"].items():
            torch.testing.assert_close(after["weights"][name], weight, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


def _relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_deepspeed_sums_replicated_grads_once_per_step_in_bf16(tmp_path: Any) -> None:
    """bf16, where DeepSpeed accumulates each micro-batch's gradients elsewhere than
    ``param.grad``: into ``param.grad_accum`` in fp32 (ZeRO 1 with mt's fp32 main
    gradients), a compact fp32 partition (ZeRO 2), fp32 partitions (ZeRO 3), and, without
    main gradients, its bf16 optimizer's fp32 copies (ZeRO 0). The per-use run all-reduces each
    micro-batch's bf16 gradients over TP, rounding the sum to bf16; the once-per-step run
    sums the fp32 accumulations. So the two agree to that rounding, not to fp32 round-off.
    The first step's loss is the same (same weights, same data) and its norm differs by
    the rounding alone (measured 9e-6 relative at ZeRO 1-3, 5e-5 at ZeRO 0; asserted
    1e-3). After it: each weight
    tensor within torch's bf16 tolerance, 1.6e-2, in relative L2 (measured 6e-3, the
    biases, which start at zero and so are their updates alone); the second step, computed
    from those weights, its loss within 3e-4 (measured 5e-5) and its norm within 1e-3
    (measured 1e-4). The control (the partial gradients never summed) misses the per-use
    run's first norm by 2e-2 and its biases by 0.76: the checks tell the two apart."""
    _import_deepspeed()
    runs = run_distributed(_deepspeed_runs, 4, str(tmp_path),
                           [(1, "bf16", True, ["use", "step", "none"]),
                            (2, "bf16", True, ["use", "step"]), (3, "bf16", True, ["use", "step"]),
                            (0, "bf16", False, ["use", "step"])], timeout=300.0)
    for rank, stages in enumerate(runs):
        for stage, run in zip((1, 2, 3, 0), stages):
            before, after = run["use"], run["step"]
            _check_fewer_reduces(rank, before, after)
            assert after["losses"][0] == before["losses"][0]
            torch.testing.assert_close(after["losses"][1:], before["losses"][1:], rtol=3e-4,
                                       atol=0)
            torch.testing.assert_close(after["norms"][0], before["norms"][0], rtol=1e-3, atol=0)
            torch.testing.assert_close(after["norms"][1:], before["norms"][1:], rtol=1e-3,
                                       atol=0)
            for name, weight in before["weights"].items():
                assert weight.dtype == torch.bfloat16
                assert _relative_l2(after["weights"][name], weight) < 1.6e-2, (rank, stage, name)
        control, before = stages[0]["none"], stages[0]["use"]
        assert abs(control["norms"][0] / before["norms"][0] - 1) > 1e-3 * 10
        assert max(_relative_l2(control["weights"][n], w)
                   for n, w in before["weights"].items()) > 1.6e-2 * 10


def _refused_offload(extensions: str) -> str:
    """What summing once per step says on a DeepSpeed engine with CPU offload."""
    import os

    import torch.distributed as dist

    from mt_zero.deepspeed_engine import (
        deepspeed_config,
        deepspeed_environ,
        initialize_deepspeed,
        sum_partial_grads_at_boundary,
    )
    from mt_zero.deepspeed_mpu import GroupsMpu

    os.environ.update(deepspeed_environ(dist.get_rank(), dist.get_world_size(),
                                        dist.get_rank()))
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions
    groups = build_groups(Topology(tp=2, dp=2))
    model = apply_tensor_parallel(GPT(preset("tiny"), seed=0), groups.tp, GPT_PLAN,
                                  sequence_parallel=True)
    engine = initialize_deepspeed(
        model, torch.optim.SGD(model.parameters(), lr=0.5),
        deepspeed_config(ZeroConfig(stage=2), 2, MICRO, 2, offload=True),
        mpu=GroupsMpu(groups))
    try:
        sum_partial_grads_at_boundary(engine, [p for _, p in defer_replicated_grads(model)],
                                      groups.tp)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_deepspeed_with_cpu_offload_refuses_the_once_per_step_sum(tmp_path: Any) -> None:
    _import_deepspeed()
    for message in run_distributed(_refused_offload, 4, str(tmp_path), timeout=300.0):
        assert message.startswith("DeepSpeed's CPU offload moves every micro-batch's"), message
