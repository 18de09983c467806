"""mt_model's GPT split into pipeline stages by mt_pipeline (optionally sliced by
mt_tensor_parallel inside each stage) computes what the single-process GPT computes.

One ``run_distributed`` call per layout runs every (schedule, micro-batch count) on the ranks
and returns numbers; the parent computes the single-process reference once and compares:

- the mean loss (broadcast to every stage) and EVERY parameter gradient of every stage (the
  tied embedding on the first and the last stage, summed over the embedding group; TP
  shards merged back first) against the one-process GPT on the same global batch:
  fp32, rtol 1e-5 / atol 1e-6;
- 10 AdamW steps give the same loss curve (relative 1e-5);
- PP in {2, 4} x micro-batches in {1, 4, 8} x {gpipe, 1f1b, interleaved v=2} (interleaved
  only where m % p == 0), half of them with per-layer activation checkpointing, and
  PP=2 x TP=2 (with and without sequence parallelism);
- a stage cut from a meta GPT (after TP) and materialised from the per-name init holds
  exactly the weights of the same stage of a real GPT;
- bad stage / micro-batch numbers fail before any process group exists.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mt_dist import Topology, build_groups
from mt_dist.testing import run_distributed
from mt_model import GPT, GPTConfig, init_parameter
from mt_pipeline import (
    PartitionError,
    PipelineConfig,
    PipelineExecutor,
    ScheduleError,
    StageComm,
    build_stage,
    plan_pipeline,
)
from mt_tensor_parallel import (
    GPT_PLAN,
    apply_tensor_parallel,
    merge_state_dicts,
    param_styles,
    shard_tensor,
)

CONFIG = GPTConfig(n_layers=8, hidden=32, n_heads=4, vocab_size=96, seq_len=16)
BATCH, STEPS, LR = 8, 10, 3e-3
RTOL, ATOL = 1e-5, 1e-6
TIMEOUT = 150.0
MICRO_BATCHES = (1, 4, 8)


def make_gpt() -> GPT:
    """mt_model's init plus a fixed perturbation, so biases / LayerNorms are not 0 / 1."""
    model = GPT(CONFIG, seed=0)
    with torch.no_grad():
        for i, (_, param) in enumerate(model.named_parameters()):
            noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(100 + i))
            param.add_(0.02 * noise)
    return model


def make_batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(1000 + step))
    return tokens[:, :-1], tokens[:, 1:]


def matrix(p: int) -> list[PipelineConfig]:
    configs = []
    for m in MICRO_BATCHES:
        configs.append(PipelineConfig("gpipe", m, activation_checkpointing=m == 4))
        configs.append(PipelineConfig("1f1b", m, activation_checkpointing=m != 4))
        if m % p == 0:
            configs.append(PipelineConfig("interleaved", m, 2, activation_checkpointing=m == 8))
    return configs


def _stage_and_executor(topology: Topology, groups: Any, config: PipelineConfig,
                        sequence_parallel: bool) -> tuple[Any, PipelineExecutor]:
    comm = StageComm.from_groups(groups)
    plan = plan_pipeline(config, CONFIG.n_layers, topology.pp)
    model = make_gpt()
    if topology.tp > 1:
        # TP first on the whole model (same path as meta model -> TP -> stage), then split.
        apply_tensor_parallel(model, groups.tp, GPT_PLAN, sequence_parallel=sequence_parallel)
    stage = build_stage(model, plan.stages[comm.stage])
    seq = CONFIG.seq_len // topology.tp if sequence_parallel else CONFIG.seq_len
    shape = (BATCH // config.num_micro_batches, seq, CONFIG.hidden)
    return stage, PipelineExecutor(stage, config, comm, shape)


def _rank_main(topology: Topology, configs: list[PipelineConfig], train: PipelineConfig,
               sequence_parallel: bool = False) -> dict[str, Any]:
    """One rank: gradients of one step per config, then the loss curve of ``train``."""
    groups = build_groups(topology)
    idx, targets = make_batch()
    first, last = groups.is_first_stage, groups.is_last_stage
    steps = []
    for config in configs:
        stage, executor = _stage_and_executor(topology, groups, config, sequence_parallel)
        result = executor.run(idx if first else None, targets if last else None)
        steps.append({"loss": result.loss,
                      "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}})
    stage, executor = _stage_and_executor(topology, groups, train, sequence_parallel)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=LR, weight_decay=0.1)
    curve = []
    for step in range(STEPS):
        idx, targets = make_batch(step)
        curve.append(executor.train_step(optimizer, idx if first else None,
                                         targets if last else None).loss)
    meta_error = _meta_stage_error(topology, groups, sequence_parallel)
    return {"pp": groups.pp_rank, "tp": groups.tp_rank, "steps": steps, "curve": curve,
            "meta_error": meta_error}


def _meta_stage_error(topology: Topology, groups: Any, sequence_parallel: bool) -> float:
    """Design path: GPT on the meta device -> TP -> this stage -> materialise only the
    stage, each parameter from the pure per-name init (sliced for TP). Returns the largest
    difference from the same stage cut out of a real GPT(seed=0)."""
    config = PipelineConfig("interleaved", 4, 2)
    plan = plan_pipeline(config, CONFIG.n_layers, topology.pp).stages[groups.pp_rank]
    with torch.device("meta"):
        meta = GPT(CONFIG)
    full_shapes = {n: p.shape for n, p in meta.named_parameters()}
    real = GPT(CONFIG, seed=0)
    if topology.tp > 1:
        apply_tensor_parallel(meta, groups.tp, GPT_PLAN, sequence_parallel=sequence_parallel)
        apply_tensor_parallel(real, groups.tp, GPT_PLAN, sequence_parallel=sequence_parallel)
    stage = build_stage(meta, plan).to_empty(device="cpu")
    styles = param_styles(full_shapes, GPT_PLAN)
    with torch.no_grad():
        for name, param in stage.named_parameters():
            full = init_parameter(name, full_shapes[name], CONFIG, seed=0)
            if topology.tp > 1:
                full = shard_tensor(styles[name], full, groups.tp_rank, topology.tp)
            param.copy_(full)
    expected = dict(build_stage(real, plan).named_parameters())
    assert set(expected) == {n for n, _ in stage.named_parameters()}
    return max((p - expected[n]).abs().max().item() for n, p in stage.named_parameters())


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    # One thread: on this busy 2-core machine, intra-op threads wait on each other for ~5 ms
    # per op while the rank processes run (each rank also uses one thread).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference()
    finally:
        torch.set_num_threads(threads)


def _reference() -> dict[str, Any]:
    model = make_gpt()
    loss = model(*make_batch())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model = make_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    curve = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_t = model(*make_batch(step))
        loss_t.backward()
        optimizer.step()
        curve.append(loss_t.item())
    return {"loss": loss.item(), "grads": grads, "curve": curve}


def _merged_grads(results: list[dict[str, Any]], index: int, tp: int) -> list[dict]:
    """Per pipeline stage: that step's full (TP-merged) gradients."""
    stages = sorted({r["pp"] for r in results})
    merged = []
    for s in stages:
        shards = sorted((r for r in results if r["pp"] == s), key=lambda r: r["tp"])
        dicts = [r["steps"][index]["grads"] for r in shards]
        merged.append(dicts[0] if tp == 1 else
                      merge_state_dicts(dicts, GPT_PLAN, vocab_size=CONFIG.vocab_size))
    return merged


def _check(results: list[dict[str, Any]], configs: list[PipelineConfig], tp: int,
           reference: dict[str, Any]) -> None:
    ref_grads = reference["grads"]
    for index, config in enumerate(configs):
        for r in results:
            assert r["steps"][index]["loss"] == pytest.approx(reference["loss"], rel=RTOL), config
        checked: dict[str, int] = {}
        for grads in _merged_grads(results, index, tp):
            for name, grad in grads.items():
                expected = ref_grads[name]
                error = (grad - expected).abs().max().item()
                assert torch.allclose(grad, expected, rtol=RTOL, atol=ATOL), (
                    f"{config}: gradient of {name} off by {error}")
                checked[name] = checked.get(name, 0) + 1
        assert set(checked) == set(ref_grads), config
        # The tied embedding lives on the first and the last stage; all else on one.
        assert checked.pop("embed.tokens.weight") == 2
        assert set(checked.values()) == {1}
    for r in results:
        assert r["curve"] == pytest.approx(reference["curve"], rel=RTOL)
        assert r["meta_error"] == 0.0
    assert reference["curve"][-1] < reference["curve"][0]


@pytest.mark.parametrize("pp", [2, 4])
def test_e2e_pp_gpt_schedules_match_one_process(pp: int, reference: dict[str, Any]) -> None:
    configs = matrix(pp)
    assert len(configs) == 8  # 2 x 3 + interleaved for m = 4, 8
    train = PipelineConfig("interleaved", 4, 2) if pp == 2 else PipelineConfig("1f1b", 4)
    results = run_distributed(_rank_main, pp, Topology(pp=pp), configs, train, timeout=TIMEOUT)
    _check(results, configs, 1, reference)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_e2e_pp_gpt_with_tensor_parallel(sequence_parallel: bool,
                                         reference: dict[str, Any]) -> None:
    configs = [PipelineConfig("gpipe", 4), PipelineConfig("1f1b", 8),
               PipelineConfig("interleaved", 4, 2, activation_checkpointing=True)]
    if not sequence_parallel:
        configs += [PipelineConfig("1f1b", 1, activation_checkpointing=True),
                    PipelineConfig("interleaved", 8, 2)]
    train = PipelineConfig("1f1b", 4)
    results = run_distributed(_rank_main, 4, Topology(tp=2, pp=2), configs, train,
                              sequence_parallel, timeout=TIMEOUT)
    _check(results, configs, 2, reference)


def test_e2e_pp_gpt_bad_numbers_fail_early() -> None:
    with pytest.raises(PartitionError, match=r"num_layers \(8\) divisible by num_stages \(3\)"):
        plan_pipeline(PipelineConfig("1f1b", 4), CONFIG.n_layers, 3)
    with pytest.raises(PartitionError, match=r"num_layers \(8\).*num_stages \(4\) x "
                                             r"virtual_stages \(4\) = 16"):
        plan_pipeline(PipelineConfig("interleaved", 4, 4), CONFIG.n_layers, 4)
    with pytest.raises(ScheduleError, match=r"num_micro_batches \(1\).*num_stages \(2\)"):
        plan_pipeline(PipelineConfig("interleaved", 1, 2), CONFIG.n_layers, 2)
    with pytest.raises(ScheduleError, match=r"num_micro_batches \(6\).*num_stages \(4\)"):
        plan_pipeline(PipelineConfig("interleaved", 6, 2), CONFIG.n_layers, 4)
