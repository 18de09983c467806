"""mt's own engine: mt-pipeline's schedules (or gradient accumulation with one stage) and
mt-zero's data parallelism, ZeRO, mixed precision and clipping; mt's sharded checkpoints."""

from __future__ import annotations

import contextlib
import getpass
import os
import tempfile
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mt_checkpoint import Built
from mt_data import DataLoaderState
from mt_dist import ParallelGroups
from mt_dist.supervisor import preload_for_fork
from mt_pipeline import PipelineExecutor, StageComm
from mt_pretrain.config.resolve import RunPlan, activation_shape
from mt_pretrain.config.schema import PretrainConfig
from mt_pretrain.data.inputs import inputs_targets, to_batch
from mt_pretrain.engines.base import Engine, Saver
from mt_pretrain.engines.build import build_model_stage, make_optimizer, seed_everything
from mt_pretrain.engines.checkpoint import Checkpointer, load
from mt_zero import StepResult, ZeroOptimizer
from mt_zero.precision import compute_dtype, precision_of

__all__ = ["MTEngine"]


class _ScaledLoss(nn.Module):
    """Multiplies the loss by the fp16 loss scale inside the pipeline executor, which calls
    ``backward`` itself (the ZeRO optimizer's ``backward`` is not used on that path); in
    evaluation (``eval()``) the loss stays unscaled."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.scale = 1.0

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.inner(logits, targets)
        return loss * self.scale if self.training else loss


def compile_cache_per_capability() -> None:
    """One inductor cache per CPU vector capability (unless the user set TORCHINDUCTOR_CACHE_DIR):
    torch's cache does not tell kernels compiled for one capability from another's.
    Measured: after an AVX-512 run, the same tiny run with ATEN_CPU_CAPABILITY=avx2 loaded
    the cached kernels and reached a NaN loss at step 1; with a cache of its own it trained
    like one process."""
    torch_default = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", torch_default) != torch_default:
        return  # the user's choice (importing inductor sets torch's default)
    capability = torch.backends.cpu.get_cpu_capability().lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(torch_default, capability)


class MTEngine(Engine):
    """The stage in mt-zero's :class:`~mt_zero.ZeroOptimizer`; pp > 1 runs mt-pipeline's
    executor, pp == 1 accumulates micro-batches (the DP reduction overlapping the last
    backward). ZeRO-3 gathers parameters in module hooks, so the stage is then called as a
    module; otherwise its (optionally compiled) forward + loss in one function."""

    def __init__(self, built: Built, optimizer: ZeroOptimizer, config: PretrainConfig,
                 plan: RunPlan, groups: ParallelGroups) -> None:
        super().__init__(built)
        self.optimizer, self.config, self.plan, self.groups = optimizer, config, plan, groups
        layout = plan.layout  # the run's one layout (resolved and checked once)
        self.dtype = compute_dtype(layout.precision)
        self.shape = activation_shape(plan)
        self._executors: dict[int, PipelineExecutor] = {}
        stage = built.stage
        # fp16 through the pipeline executor: the loss module itself applies the loss scale
        # (on the last stage); the loss every stage receives is then scaled too.
        self._scale_in_loss = precision_of(layout.precision).loss_scaling and layout.pp > 1
        self._scaled: _ScaledLoss | None = None
        if self._scale_in_loss and stage.plan.has_head:
            self._scaled = _ScaledLoss(stage.get_submodule(stage.layout.loss))
            stage.set_submodule(stage.layout.loss, self._scaled)
        self._call_module = layout.zero_stage == 3
        if config.parallel.compile:
            compile_cache_per_capability()
        # pp == 1: the same (optionally compiled) forward + loss the executor runs.
        self._forward_loss = (torch.compile(stage.forward_loss) if config.parallel.compile
                              else stage.forward_loss)

    @classmethod
    def preload(cls, config: PretrainConfig) -> None:
        """torch's lazy imports that every rank's optimizer would make, once (mt-dist's
        ``preload_for_fork``)."""
        preload_for_fork()

    @classmethod
    def create(cls, config: PretrainConfig, plan: RunPlan, groups: ParallelGroups,
               device: torch.device) -> MTEngine:
        """This rank's stage, initialized like the unsharded model, in the ZeRO wrapper."""
        seed_everything(config.train.seed, groups)
        dropout = plan.gpt.dropout > 0 or plan.gpt.attention_dropout > 0
        # Compiled code draws dropout masks from inductor's generator: not keyed.
        built = build_model_stage(plan, groups, config.train.seed,
                                  plan.layout.sequence_parallel, device,
                                  keyed_dropout=dropout and not config.parallel.compile)
        built.stage.train()
        optimizer = make_optimizer(config.train, plan.layout, built.stage, groups, built.styles,
                                   config.parallel.bucket_numel)
        return cls(built, optimizer, config, plan, groups)

    @property
    def skips_nonfinite(self) -> bool:
        return self.optimizer.scaler is not None

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.optimizer.param_groups:
            group["lr"] = lr

    def forward_backward(self, micro: Sequence[np.ndarray], keys: list[int] | None) -> float:
        if self.plan.topology.pp > 1:
            return self._pipeline_loss(micro, keys)
        return self._accumulate_loss(micro, keys)

    def step(self) -> StepResult:
        return self.optimizer.step()

    def gathered(self) -> AbstractContextManager[None]:
        return self.optimizer.gathered()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.optimizer.full_parameters()

    def saver(self, root: Path, keep_last: int) -> Saver:
        return Checkpointer(root, keep_last, self.config, self.plan, self.groups, self.built,
                            self.optimizer)

    def load(self, path: str | Path) -> tuple[int, DataLoaderState]:
        return load(path, self.config.train, self.plan, self.groups, self.built, self.optimizer)

    # ------------------------------------------------------------------------ internals
    def _inputs(self, batch: Any) -> tuple[Any, Any]:
        """Input tokens and targets of ``batch``: this rank's slice of them with context
        parallelism (each rank's loss is the mean over its tokens, which are as many on every
        rank: the mean over dp x cp of those means is the whole batch's mean)."""
        return inputs_targets(batch, self.groups.cp_size, self.groups.cp_rank)

    def _accumulate_loss(self, micro: Sequence[np.ndarray], keys: list[int] | None) -> float:
        """pp == 1: plain gradient accumulation; DP reduction overlaps the last backward."""
        opt, stage = self.optimizer, self.built.stage
        checkpoint = self.plan.layout.recompute  # none, selective or full
        device = self.groups.device
        m, total = len(micro), 0.0
        for i, array in enumerate(micro):
            idx, targets = self._inputs(to_batch([array]).to(device))
            key = None if keys is None else keys[i]
            quiet = opt.no_sync() if i < m - 1 else contextlib.nullcontext()
            with quiet:
                if self._call_module:
                    loss = stage(idx, key=key, targets=targets)
                else:
                    loss = self._forward_loss(0, idx, targets, checkpoint, key)
                opt.backward(loss / m)
            total += float(loss.detach())
        return total / m

    def _executor(self, m: int) -> PipelineExecutor:
        if m not in self._executors:
            config = replace(self.plan.pipeline, num_micro_batches=m)
            self._executors[m] = PipelineExecutor(
                self.built.stage, config, StageComm.from_groups(self.groups), self.shape,
                dtype=self.dtype, grad_of=self.optimizer.main_grad)
        return self._executors[m]

    def _pipeline_loss(self, micro: Sequence[np.ndarray], keys: list[int] | None) -> float:
        """pp > 1: the schedule runs all micro-batches; gradients are reduced at step()."""
        opt, groups = self.optimizer, self.groups
        idx, targets = self._inputs(to_batch(list(micro)))
        scale = opt.loss_scale
        if self._scaled is not None:
            self._scaled.scale = scale
        with opt.no_sync():
            result = self._executor(len(micro)).run(
                idx if groups.is_first_stage else None,
                targets if groups.is_last_stage else None, keys=keys)
        return result.loss / scale if self._scale_in_loss else result.loss
