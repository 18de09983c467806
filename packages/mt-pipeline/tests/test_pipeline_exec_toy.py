"""The executor on real gloo process groups, with a toy GPT-like model (torch + mt_dist only).

Every configuration is compared with the same model run in one process on the same batch:
the mean loss and every parameter's gradient must agree within fp32 round-off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mt_dist import Topology, build_groups
from mt_dist.testing import run_distributed
from mt_pipeline import (
    PartitionError,
    PipelineConfig,
    PipelineExecutor,
    ScheduleError,
    StageComm,
    build_stage,
    explicit_partition,
    measured_timeline,
    plan_pipeline,
    simulate,
)
from mt_pipeline.schedules import Backward, Exchange, Forward

VOCAB, HIDDEN, SEQ, LAYERS, BATCH = 48, 16, 8, 8, 8
TIMEOUT = 90.0


class ToyEmbed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx)


class ToyLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Mixes positions (cumsum) so a wrong micro-batch or token order changes the loss.
        return x + torch.tanh(self.fc(self.ln(x))).cumsum(dim=1) / SEQ


class ToyHead(nn.Module):
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


class ToyLoss(nn.Module):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class ToyLM(nn.Module):
    """Same module names as mt_model.GPT (embed.tokens tied with the head)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = ToyEmbed()
        self.blocks = nn.ModuleList(ToyLayer() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = ToyHead()
        self.loss_fn = ToyLoss()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.loss_fn(self.head(self.ln_f(x), self.embed.tokens.weight), targets)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 round-off tolerance (torch.testing.assert_close would import DTensor: ~2 s)."""
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    error = (actual - expected).abs().max().item()
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-6), f"{what}: max error {error}"


def toy_batch(replica: int = 0, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference(replica: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    model = ToyLM()
    idx, targets = toy_batch(replica)
    loss = model(idx, targets)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _run_configs(topology: Topology, configs: list[tuple[PipelineConfig, tuple[int, ...] | None]]
                 ) -> list[dict]:
    """One rank: run every (config, explicit layer counts) once; return loss and grads."""
    groups = build_groups(topology)
    comm = StageComm.from_groups(groups)
    out = []
    for config, counts in configs:
        p = topology.pp
        if counts is None:
            plan = plan_pipeline(config, LAYERS, p)
        else:
            plan = explicit_partition(counts, p, config.virtual_stages)
        stage = build_stage(ToyLM(), plan.stages[comm.stage])
        executor = PipelineExecutor(stage, config, comm,
                                    (BATCH // config.num_micro_batches, SEQ, HIDDEN))
        idx, targets = toy_batch(groups.dp_rank)
        result = executor.run(idx if comm.is_first else None,
                              targets if comm.is_last else None, record=True)
        out.append({
            "loss": result.loss,
            "micro_losses": result.micro_batch_losses,
            "grads": {n: p.grad.clone() for n, p in stage.named_parameters()},
            "computes": sum(isinstance(e.instruction, (Forward, Backward))
                            for e in result.events),
            "replica": groups.dp_rank,
            "events": result.events,
            "peak": (result.peak_in_flight,
                     simulate(config.schedule_for(p)).peak_in_flight[comm.stage]),
        })
    return out


def _check(results: list[list[dict]], configs_of: list[PipelineConfig], dp: int = 1) -> None:
    num_configs = len(configs_of)
    m_of = [config.num_micro_batches for config in configs_of]
    refs = [reference(r) for r in range(dp)]
    for c in range(num_configs):
        seen: dict[tuple[int, str], int] = {}
        for rank_results in results:
            got = rank_results[c]
            ref_loss, ref_grads = refs[got["replica"]]
            # The loss is broadcast from the last stage to every stage.
            assert got["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
            for name, grad in got["grads"].items():
                assert_close(grad, ref_grads[name], f"config {c} {name}")
                seen[(got["replica"], name)] = seen.get((got["replica"], name), 0) + 1
        # Every parameter was checked in every replica; the tied weight on two stages.
        for r in range(dp):
            for name in refs[r][1]:
                assert seen[(r, name)] >= 1, name
        assert sum(1 for (_, n), k in seen.items() if n == "embed.tokens.weight" and k == 2) == dp
        for rank_results in results:
            got_peak, simulated_peak = rank_results[c]["peak"]
            assert got_peak == simulated_peak >= 1
        # The recorded timelines, packed like a simulation (what benchmarks/pp.py reports).
        if dp == 1:
            config = configs_of[c]
            timeline = measured_timeline([rr[c]["events"] for rr in results],
                                         config.virtual_stages, config.num_micro_batches)
            simulated = simulate(config.schedule_for(len(results)))
            assert timeline.peak_in_flight == simulated.peak_in_flight
            assert all(b >= 0 for b in timeline.bubble_time)
            assert min(e.start for ev in timeline.events for e in ev) == 0.0
        total = sum(rr[c]["computes"] for rr in results)
        assert total > 0 and total % (2 * m_of[c]) == 0


def test_exec_two_stages_all_schedules_match_one_process() -> None:
    configs = [
        (PipelineConfig("gpipe", 1), None),
        (PipelineConfig("gpipe", 4), None),
        (PipelineConfig("1f1b", 8), None),
        (PipelineConfig("1f1b", 4, activation_checkpointing=True), None),
        (PipelineConfig("interleaved", 4, 2), None),
        (PipelineConfig("interleaved", 8, 2, activation_checkpointing=True), None),
        # Uneven explicit split, one chunk with no layer at all.
        (PipelineConfig("1f1b", 2), (7, 1)),
        (PipelineConfig("interleaved", 2, 2), (3, 0, 4, 1)),
    ]
    results = run_distributed(_run_configs, 2, Topology(pp=2), configs, timeout=TIMEOUT)
    _check(results, [c for c, _ in configs])


def test_exec_pipeline_with_data_parallel_replicas() -> None:
    # pp=2 x dp=2: stage ranks are (0, 2) and (1, 3), so peers are not rank +- 1.
    configs = [(PipelineConfig("1f1b", 4), None), (PipelineConfig("interleaved", 2, 2), None)]
    results = run_distributed(_run_configs, 4, Topology(pp=2, dp=2), configs, timeout=TIMEOUT)
    _check(results, [c for c, _ in configs], dp=2)


def _train(topology: Topology, config: PipelineConfig, steps: int) -> list[float]:
    groups = build_groups(topology)
    comm = StageComm.from_groups(groups)
    stage = build_stage(ToyLM(), plan_pipeline(config, LAYERS, topology.pp).stages[comm.stage])
    executor = PipelineExecutor(stage, config, comm,
                                (BATCH // config.num_micro_batches, SEQ, HIDDEN))
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        idx, targets = toy_batch(0, step)
        result = executor.train_step(optimizer, idx if comm.is_first else None,
                                     targets if comm.is_last else None)
        losses.append(result.loss)
    # Both copies of the tied weight stayed identical through the optimizer steps.
    tied = stage.get_parameter("embed.tokens.weight").detach().clone()
    return [*losses, tied]


def test_exec_training_curve_matches_one_process() -> None:
    steps = 10
    model = ToyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    expected = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = model(*toy_batch(0, step))
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    config = PipelineConfig("interleaved", 4, 2)
    results = run_distributed(_train, 2, Topology(pp=2), config, steps, timeout=TIMEOUT)
    for rank_result in results:
        assert rank_result[:steps] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert_close(rank_result[steps], model.embed.tokens.weight.detach(), "tied weight")
    assert expected[-1] < expected[0]


def test_exec_bad_configurations_fail_before_communication() -> None:
    with pytest.raises(PartitionError, match=r"num_layers \(8\).*num_stages \(3\)"):
        plan_pipeline(PipelineConfig("1f1b", 4), 8, 3)
    with pytest.raises(ScheduleError, match=r"num_micro_batches \(3\).*num_stages \(2\)"):
        plan_pipeline(PipelineConfig("interleaved", 3, 2), 8, 2)
    with pytest.raises(ScheduleError, match=r"num_micro_batches \(1\).*num_stages \(4\)"):
        plan_pipeline(PipelineConfig("interleaved", 1, 2), 8, 4)
    with pytest.raises(ScheduleError, match="one chunk per stage, got virtual_stages 2"):
        PipelineConfig("1f1b", 4, 2)
    # The executor validates (p, m, v) from its own arguments, with no process group at all.
    plan = plan_pipeline(PipelineConfig("interleaved", 4, 2), 8, 2)
    stage = build_stage(ToyLM(), plan.stages[0])
    comm = StageComm(stage=0, stage_ranks=(0, 1))
    with pytest.raises(ScheduleError, match=r"num_micro_batches \(3\).*num_stages \(2\)"):
        PipelineExecutor(stage, PipelineConfig("interleaved", 3, 2), comm, (2, SEQ, HIDDEN))
    with pytest.raises(ValueError, match="virtual_stages=1"):
        PipelineExecutor(stage, PipelineConfig("1f1b", 4), comm, (2, SEQ, HIDDEN))


def test_exec_stage_keeps_full_model_names_and_single_stage_runs() -> None:
    config = PipelineConfig("1f1b", 4)
    plan = plan_pipeline(PipelineConfig("interleaved", 4, 2), LAYERS, 2)
    last = build_stage(ToyLM(), plan.stages[1])
    names = {n for n, _ in last.named_parameters()}
    assert "blocks.2.fc.weight" in names and "blocks.7.fc.weight" in names
    assert "blocks.0.fc.weight" not in names and "embed.tokens.weight" in names
    assert [p.shape for p in last.tied_parameters()] == [torch.Size([VOCAB, HIDDEN])]
    # One stage: the executor needs no communication; tied weight is a single parameter.
    single = build_stage(ToyLM(), plan_pipeline(config, LAYERS, 1).stages[0])
    assert single.tied_parameters() == []
    executor = PipelineExecutor(single, config, StageComm(0, (0,)), (2, SEQ, HIDDEN),
                                broadcast_loss=False)
    result = executor.run(*toy_batch(), record=True)
    ref_loss, ref_grads = reference()
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    assert len(result.micro_batch_losses) == 4
    for name, param in single.named_parameters():
        assert_close(param.grad, ref_grads[name], name)
    # The recorded timeline is ordered and has one event per instruction.
    assert len(result.events) == len(executor.instructions)
    assert all(a.end <= b.start for a, b in zip(result.events, result.events[1:]))
    assert sum(isinstance(e.instruction, Exchange) for e in result.events) == 0
    assert simulate(config.schedule_for(1)).bubble_fraction == (0.0,)


def _saved_tensors(stage: torch.nn.Module, idx: torch.Tensor, checkpoint: bool) -> int:
    count = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage.forward_chunk(0, idx, checkpoint=checkpoint)
    return count


def test_exec_checkpointing_keeps_only_layer_inputs() -> None:
    stage = build_stage(ToyLM(), plan_pipeline(PipelineConfig("1f1b", 1), LAYERS, 1).stages[0])
    idx, _ = toy_batch()
    plain = _saved_tensors(stage, idx, checkpoint=False)
    checkpointed = _saved_tensors(stage, idx, checkpoint=True)
    # Without checkpointing every layer saves several tensors (LayerNorm stats, Linear
    # input, tanh output, ...); with it each layer keeps only its input for recomputation.
    assert 3 * checkpointed < plain  # measured here: 16 vs 72


def _forward_only(v: int) -> list[float]:
    """Every micro-batch's loss from forward_losses at 4 stages x v chunks (last stage)."""
    from mt_pipeline import forward_losses

    groups = build_groups(Topology(pp=4))
    comm = StageComm.from_groups(groups)
    plan = plan_pipeline(PipelineConfig("interleaved" if v > 1 else "1f1b", 4, v), LAYERS, 4)
    stage = build_stage(ToyLM(), plan.stages[comm.stage])
    idx, targets = toy_batch()
    losses = forward_losses(stage, comm, 4, list(idx.chunk(4)) if comm.is_first else None,
                            list(targets.chunk(4)) if comm.is_last else None,
                            (BATCH // 4, SEQ, HIDDEN), torch.float32, "cpu")
    return [float(x) for x in losses]


def test_forward_only_pass_matches_one_process() -> None:
    """Validation's forward-only pass: 4 stages, with 1 and 2 chunks per stage; the last
    stage gets each micro-batch's loss, the others none."""
    idx, targets = toy_batch()
    model = ToyLM()
    with torch.no_grad():
        want = [float(model(x, y)) for x, y in zip(idx.chunk(4), targets.chunk(4))]
    for v in (1, 2):
        results = run_distributed(_forward_only, 4, v, timeout=TIMEOUT)
        assert results[:3] == [[], [], []]
        assert torch.allclose(torch.tensor(results[3]), torch.tensor(want), rtol=1e-5,
                              atol=1e-6), (v, results[3], want)
