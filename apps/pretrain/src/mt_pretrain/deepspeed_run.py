"""`mt pretrain --engine deepspeed`: the same model, data and LR schedule, with DeepSpeed's
engine (ZeRO 0-3) doing data parallelism, clipping and the optimizer step.

Only pure data parallelism (tp = pp = 1) is supported: the DP group is the whole world,
which is DeepSpeed's default group. :class:`DeepSpeedOptimizer` gives the engine the small
interface the training loop uses from mt's ZeroOptimizer (``no_sync``, ``backward``,
``step``, ``optimizer``, ``gathered``, ``full_parameters``), so the loop is unchanged.
DeepSpeed does its own gradient accumulation: ``engine.backward`` + ``engine.step`` per
micro-batch, the optimizer stepping on the last of ``gradient_accumulation_steps`` (fixed,
hence no batch-size ramp-up with this engine). The loop calls the engine (not the stage)
for forward: ZeRO-3 under DeepSpeed gives wrong gradients with accumulation otherwise.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mt_data import DataLoaderState
from mt_dist import ParallelGroups
from mt_pretrain.config import PretrainConfig
from mt_pretrain.launch import default_cache_dir
from mt_pretrain.plan import RunPlan
from mt_zero import StepResult, ZeroConfig, decay_param_groups
from mt_zero.deepspeed_engine import deepspeed_config, deepspeed_environ, initialize_deepspeed

__all__ = ["DeepSpeedCheckpointer", "DeepSpeedOptimizer", "make_deepspeed_optimizer"]


class DeepSpeedOptimizer:
    """The DeepSpeed engine behind the optimizer interface of the training loop."""

    scaler = None  # fp16 is not offered with this engine (config validation)
    loss_scale = 1.0

    def __init__(self, engine: Any, client: torch.optim.Optimizer, stage: int) -> None:
        self.engine = engine
        self.optimizer = client  # param_groups shared with the engine: the loop sets lr here
        self.stage = stage

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to do: DeepSpeed counts micro-batches and only reduces on the last one
        of its ``gradient_accumulation_steps``."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """``engine.backward`` (without DeepSpeed's own 1/accumulation scaling: the loop
        divides by the number of micro-batches already), then ``engine.step``, which steps
        the optimizer only at DeepSpeed's accumulation boundary."""
        self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()

    def step(self) -> StepResult:
        """The engine stepped in the last :meth:`backward`; report its gradient norm."""
        if not self.engine.was_step_applied():
            raise RuntimeError(
                "DeepSpeed did not step at the end of the global batch: its "
                f"gradient_accumulation_steps {self.engine.gradient_accumulation_steps()} "
                "differs from the number of micro-batches")
        norm = self.engine.get_global_grad_norm()
        return StepResult(grad_norm=float(norm) if norm is not None else float("nan"),
                          skipped=False, loss_scale=1.0)

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        """Evaluation needs nothing extra: ZeRO-3's module hooks gather parameters."""
        return contextlib.nullcontext()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Full weights by name, as fp32, on every rank (collective under ZeRO-3); with
        bf16 these are the bf16 model weights upcast (DeepSpeed keeps the fp32 masters)."""
        import deepspeed  # pants: no-infer-dep (optional engine)

        module = self.engine.module
        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.stage == 3):
            return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def _set_environment(groups: ParallelGroups) -> None:
    """What DeepSpeed reads from the environment; launchers (torchrun, deepspeed) may have
    set it already, `--nproc` children have not."""
    env = deepspeed_environ(groups.rank, groups.topology.world_size, groups.rank,
                            "cuda" if groups.device.type == "cuda" else "cpu")
    for key, value in env.items():
        os.environ.setdefault(key, value)
    # The shm comm op DeepSpeed JIT-builds on first use (about 35 s) is cached here.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                          str(default_cache_dir(os.environ) / "torch_extensions"))


def make_deepspeed_optimizer(config: PretrainConfig, plan: RunPlan, stage: nn.Module,
                             groups: ParallelGroups) -> DeepSpeedOptimizer:
    """``deepspeed.initialize`` on this rank's model with mt's AdamW and decay groups."""
    _set_environment(groups)
    train, par = config.train, config.parallel
    client = torch.optim.AdamW(decay_param_groups(stage.named_parameters(), train.weight_decay),
                               lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                               eps=train.adam_eps)
    dp = plan.topology.dp
    zero = ZeroConfig(stage=par.zero_stage, precision=par.precision, clip_grad=train.clip_grad)
    accumulation = max(1, train.global_batch_size // (train.micro_batch_size * dp))
    ds_config = deepspeed_config(zero, train.micro_batch_size, accumulation, dp)
    backend = "nccl" if groups.device.type == "cuda" else "gloo"
    engine = initialize_deepspeed(stage, client, ds_config, dist_backend=backend)
    layout = getattr(stage, "layout", None)
    if par.zero_stage == 3 and layout is not None and layout.head and layout.tied_weight:
        # The head uses the embedding's weight outside the embedding module: ZeRO-3 must
        # gather it around the head too (in evaluation as well as in training).
        import deepspeed  # pants: no-infer-dep (optional engine)

        deepspeed.zero.register_external_parameter(stage.get_submodule(layout.head),
                                                   stage.get_parameter(layout.tied_weight))
    return DeepSpeedOptimizer(engine, client, par.zero_stage)


class DeepSpeedCheckpointer:
    """Checkpoints in DeepSpeed's own format (``engine.save_checkpoint``: model, ZeRO
    optimizer shards, its ``latest`` tag file) plus the data-loader position as client
    state. Resuming them with ``mt pretrain --load`` is not supported yet."""

    def __init__(self, root: Path, optimizer: DeepSpeedOptimizer) -> None:
        self.root, self.optimizer = root, optimizer
        self.last_saved: Path | None = None
        self.last_step: int | None = None

    def save(self, step: int, data_state: DataLoaderState) -> Path:
        """Write the checkpoint of ``step`` (collective); returns its folder."""
        tag = f"step-{step:08d}"
        self.optimizer.engine.save_checkpoint(str(self.root), tag=tag,
                                              client_state={"data": data_state.to_dict()})
        self.last_saved, self.last_step = self.root / tag, step
        return self.last_saved
