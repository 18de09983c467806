"""DeepSpeed as a second engine: its config translation, and the same training through
``deepspeed.initialize`` as through mt's ZeroOptimizer.

The distributed test trains TinyLM 10 steps (2 micro-batches of gradient accumulation,
AdamW with decay groups, clipping at 1.0) on 2 gloo processes with mt's ZeroOptimizer and
with DeepSpeed ZeRO of the same stage (0-3), same initial weights and data, and compares
the global loss curves and final weights. Measured (fp32, every stage): losses agree
within 1.1e-7 relative, final weights within 1.7e-7 relative L2; asserted 1e-5 for both.

DeepSpeed runs with DS_ACCELERATOR=cpu, set (with LOCAL_RANK etc.) in the child processes
only, with an empty TORCH_EXTENSIONS_DIR: nothing may be JIT-built (its shm inference
allreduce, 35-150 s, is skipped by :func:`mt_zero.deepspeed_engine.init_deepspeed_distributed`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mt_dist.testing import run_distributed
from mt_zero import ZeroConfig, ZeroOptimizer, decay_param_groups
from mt_zero.deepspeed_engine import deepspeed_config, deepspeed_environ, initialize_deepspeed
from mt_zero.testing import TinyLM, make_batches

LR = 1e-2
STEPS = 10
MICRO = 2  # gradient accumulation steps
BATCHES = make_batches(STEPS, batch=8, seq=6, vocab=32)
STAGES = (0, 1, 2, 3)


# ----------------------------------------------------------------- pure config translation
def test_deepspeed_config_translates_zero_settings() -> None:
    cfg = deepspeed_config(ZeroConfig(stage=2, precision="bf16", clip_grad=1.0,
                                      bucket_numel=1000), micro_batch_size=4,
                           gradient_accumulation_steps=3, dp_size=2)
    assert cfg["train_batch_size"] == 24
    assert cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["gradient_accumulation_steps"] == 3
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 1000
    assert "offload_optimizer" not in cfg["zero_optimization"]
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    # fp32 main gradients (ZeroConfig's default) are DeepSpeed's fp32 accumulation and
    # reduction; without them DeepSpeed keeps its own default (the compute dtype).
    assert cfg["data_types"] == {"grad_accum_dtype": "fp32"}
    assert cfg["communication_data_type"] == "fp32"
    half = deepspeed_config(ZeroConfig(stage=2, precision="bf16", main_grads=False), 4, 3, 2)
    assert "data_types" not in half and "communication_data_type" not in half
    assert "data_types" not in deepspeed_config(ZeroConfig(stage=2), 4, 3, 2)  # fp32
    assert cfg["zero_allow_untested_optimizer"] is True
    assert "optimizer" not in cfg and "scheduler" not in cfg  # client optimizer, mt's LR


def test_deepspeed_config_fp16_offload_and_errors() -> None:
    cfg = deepspeed_config(ZeroConfig(stage=3, precision="fp16"), 1, 1, 1, offload=True)
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["loss_scale"] == 0
    assert cfg["fp16"]["initial_scale_power"] == 16  # LossScalerConfig's 2**16
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert "bf16" not in deepspeed_config(ZeroConfig(stage=0), 1, 1, 1)
    with pytest.raises(ValueError, match="stage 0"):
        deepspeed_config(ZeroConfig(stage=0), 1, 1, 2, offload=True)
    with pytest.raises(ValueError, match="micro_batch_size 0"):
        deepspeed_config(ZeroConfig(stage=1), 0, 1, 2)
    assert deepspeed_environ(1, 2, 1)["LOCAL_RANK"] == "1"
    with pytest.raises(ValueError, match="rank 2"):
        deepspeed_environ(2, 2, 0)


# ------------------------------------------------------------- training: mt vs DeepSpeed
def _local(rank: int, dp: int, idx: torch.Tensor, targets: torch.Tensor) -> list[Any]:
    """This rank's micro-batches of a global batch."""
    b = idx.shape[0] // dp
    mine = idx[rank * b:(rank + 1) * b], targets[rank * b:(rank + 1) * b]
    return list(zip(mine[0].chunk(MICRO), mine[1].chunk(MICRO)))


def _global_mean(total: float) -> float:
    value = torch.tensor([total], dtype=torch.float64)
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def _train_mt(stage: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = TinyLM()
    opt = ZeroOptimizer(model, lambda g: torch.optim.AdamW(g, lr=LR), dist.group.WORLD,
                        ZeroConfig(stage=stage, clip_grad=1.0),
                        param_groups=decay_param_groups(model.named_parameters(), 0.1))
    rank, dp, losses = dist.get_rank(), dist.get_world_size(), []
    for idx, targets in BATCHES:
        total = 0.0
        for m, (x, y) in enumerate(_local(rank, dp, idx, targets)):
            loss = model(x, y)
            if m < MICRO - 1:
                with opt.no_sync():
                    opt.backward(loss / MICRO)
            else:
                opt.backward(loss / MICRO)
            total += float(loss.detach()) / MICRO
        opt.step()
        losses.append(_global_mean(total))
    return losses, opt.full_parameters()


def _train_deepspeed(stage: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = TinyLM()
    client = torch.optim.AdamW(decay_param_groups(model.named_parameters(), 0.1), lr=LR)
    dp = dist.get_world_size()
    config = deepspeed_config(ZeroConfig(stage=stage, clip_grad=1.0), 8 // dp // MICRO,
                              MICRO, dp)
    engine = initialize_deepspeed(model, client, config)
    rank, losses = dist.get_rank(), []
    for idx, targets in BATCHES:
        total = 0.0
        for x, y in _local(rank, dp, idx, targets):
            loss = engine(x, y)
            engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
            engine.step()          # steps the optimizer on the last micro-batch only
            total += float(loss.detach()) / MICRO
        losses.append(_global_mean(total))
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return losses, params


def _compare_engines(stages: tuple[int, ...], extensions: str) -> dict[Any, Any]:
    """Child process: DeepSpeed's environment, then both engines for every stage; and
    whether DeepSpeed's backend holds a shm op and anything was JIT-built."""
    os.environ.update(deepspeed_environ(dist.get_rank(), dist.get_world_size(),
                                        dist.get_rank()))
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions
    result: dict[Any, Any] = {s: (_train_mt(s), _train_deepspeed(s)) for s in stages}
    import deepspeed.comm.comm as ds_comm

    result["no_shm_op"] = ds_comm.cdb.shm_comm_op is None
    result["built"] = sorted(p.name for p in Path(extensions).glob("*"))
    return result


@pytest.fixture(scope="module")
def curves(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    pytest.importorskip("deepspeed")
    extensions = tmp_path_factory.mktemp("torch_extensions")
    return run_distributed(_compare_engines, 2, STAGES, str(extensions), timeout=240.0)[0]


def test_deepspeed_builds_no_op(curves: dict[Any, Any]) -> None:
    assert curves["no_shm_op"]  # DeepSpeed started without its shm inference op
    assert curves["built"] == []  # and compiled nothing


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_matches_mt_zero(curves: dict[Any, Any], stage: int) -> None:
    (mt_losses, mt_params), (ds_losses, ds_params) = curves[stage]
    assert len(mt_losses) == len(ds_losses) == STEPS
    for step, (a, b) in enumerate(zip(mt_losses, ds_losses), start=1):
        assert b == pytest.approx(a, rel=1e-5), f"stage {stage} step {step}: {a} vs {b}"
    assert mt_losses[-1] < mt_losses[0]  # it learns
    assert mt_params.keys() == ds_params.keys()
    for name, ref in mt_params.items():
        err = float((ds_params[name] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < 1e-5, f"stage {stage} {name}: relative L2 {err:.2e}"


# ------------------------------------------------- mt's groups as DeepSpeed's mpu / topology
def _mpu_view(tp: int, pp: int) -> dict[str, Any]:
    """Child process: GroupsMpu over mt's groups, and DeepSpeed's topology in mt's order."""
    from mt_dist import Topology, build_groups
    from mt_zero.deepspeed_mpu import GroupsMpu, pipe_topology

    os.environ.update(deepspeed_environ(dist.get_rank(), dist.get_world_size(),
                                        dist.get_rank()))
    topo = Topology.from_world(dist.get_world_size(), tp=tp, pp=pp)
    groups = build_groups(topo)
    mpu = GroupsMpu(groups)
    ds = pipe_topology(topo)
    coord = ds.get_coord(dist.get_rank())
    return {
        "dp": (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
               dist.get_process_group_ranks(mpu.get_data_parallel_group())),
        "tp": (mpu.get_tensor_model_parallel_rank(), mpu.get_slice_parallel_world_size(),
               dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group())),
        "mp": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(),
               dist.get_process_group_ranks(mpu.get_model_parallel_group())),
        "pp": (mpu.get_pipe_parallel_rank(), mpu.get_pipe_parallel_world_size()),
        "ds": (coord.pipe, coord.data, coord.model),
    }


def test_groups_mpu_and_pipe_topology_follow_mt_rank_order() -> None:
    """rank = (pp * dp + dp_idx) * tp + tp_idx, on 4 ranks as TP 2 x PP 2 (DP 1)."""
    pytest.importorskip("deepspeed")
    views = run_distributed(_mpu_view, 4, 2, 2, timeout=120.0)
    for rank, view in enumerate(views):
        pp, tp = divmod(rank, 2)
        assert view["tp"] == (tp, 2, [2 * pp, 2 * pp + 1])
        assert view["dp"] == (0, 1, [rank])
        assert view["mp"] == (rank, 4, [0, 1, 2, 3])
        assert view["pp"] == (pp, 2)
        assert view["ds"] == (pp, 0, tp)
