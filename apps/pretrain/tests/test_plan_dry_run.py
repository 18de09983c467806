"""``mt pretrain --dry-run``'s memory line is ``mt plan``'s estimator, never a second model."""

import dataclasses

import pytest

from mt_plan.estimate import estimate
from mt_pretrain.config.load import load_config
from mt_pretrain.config.resolve import memory_estimate, resolve, runtime_spec

CASES = [
    {"tp": 2, "pp": 2, "dp": 2},  # the default 3D demo
    {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 1, "micro_batch_size": 4,
     "global_batch_size": 16},
    {"tp": 1, "pp": 2, "dp": 1, "schedule": "gpipe", "activation_checkpointing": True},
    {"model": "gpt2-small", "seq_len": 128, "tp": 2, "pp": 1, "dp": 2, "zero_stage": 2,
     "precision": "bf16", "global_batch_size": 8},
]


@pytest.mark.parametrize("overrides", CASES)
def test_dry_run_memory_equals_plan_estimate(overrides: dict) -> None:
    config = load_config(None, {**overrides, "device": "cpu"})
    plan = resolve(config, _world(overrides))
    layout, gpu = plan.layout, runtime_spec("cpu")
    stages = [memory_estimate(plan, s, gpu) for s in range(plan.topology.pp)]
    fullest = max(stages, key=lambda parts: parts["total"])
    est = estimate(plan.gpt, layout, dataclasses.replace(gpu, memory_bytes=1e12), 0.5)
    assert fullest["total"] == pytest.approx(est.memory_per_gpu_gb * 1e9, rel=1e-12)
    assert fullest["temporaries"] == pytest.approx(est.memory_temporaries_gb * 1e9,
                                                   rel=1e-12, abs=1e-3)
    assert fullest["params"] == est.parameters_per_gpu
    # gloo (CPU) stages an all-gather's output; NCCL does not: never more memory on CUDA.
    cuda = max(memory_estimate(plan, s, runtime_spec("cuda"))["total"]
               for s in range(plan.topology.pp))
    assert cuda <= fullest["total"]


def _world(overrides: dict) -> int:
    """World size of a case (tp x pp x dp)."""
    return overrides["tp"] * overrides["pp"] * overrides["dp"]


def test_dry_run_warns_when_a_rank_would_not_fit_this_machine(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A layout that cannot fit this machine (--seq-len 100000000: thousands of GiB per
    rank): one warning line with the estimate and this machine's memory; the demo's (KiB)
    gets none."""
    from mt_plan.memory import device_memory
    from mt_pretrain.cli.pretrain import DEMO_CONFIG, pretrain_main

    overrides = {"seq_len": 100_000_000, "device": "cpu", "dry_run": True}
    assert pretrain_main(None, overrides, environ={}) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines()
                if line.startswith("warning")]
    assert warnings == [f"warning    the plan needs ~6199.013 GiB per rank (stage 0), more than "
                        f"{device_memory('cpu')[1]}: a run here would be refused"]
    assert pretrain_main(DEMO_CONFIG, {"device": "cpu", "dry_run": True}, environ={}) == 0
    assert "warning" not in capsys.readouterr().out
