"""`mt pretrain --engine deepspeed`: the same model, weights, data and LR schedule, with
DeepSpeed's engine doing data parallelism (ZeRO 0-3), clipping and the optimizer step.

Layouts:

- pp == 1 (any tp): ``deepspeed.initialize`` on mt's (tensor-parallel) model with an ``mpu``
  built from mt's groups (:class:`mt_zero.deepspeed_mpu.GroupsMpu`); per micro-batch
  ``engine.backward`` + ``engine.step``, the optimizer stepping on the last of
  ``gradient_accumulation_steps`` (fixed: no batch-size ramp-up with this engine).
- pp > 1: mt's stage inside DeepSpeed's ``PipelineModule``
  (:mod:`mt_pretrain.engines.deepspeed_pipe`) and ``PipelineEngine.train_batch`` per global
  batch (DeepSpeed's own 1F1B schedule, ZeRO 1).

:class:`DeepSpeedEngine` is the :class:`~mt_pretrain.engines.base.Engine` of both.

Checkpoints: DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` (model, ZeRO optimizer
shards, its ``latest`` file) plus, per rank, mt's data-loader position and RNG states in
``mt-rank-NNNNN.pt`` (tensors and numbers only, read with ``weights_only=True``), and mt's
checksums of every file of the folder (``mt-checksums.json``, mt-checkpoint's manifest),
verified before anything is read. Resuming needs the same (tp, pp, dp) layout.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mt_checkpoint import (
    LATEST,
    Built,
    CheckpointError,
    folder_files,
    read_manifest,
    sharding_styles,
    sidecar_rank_file,
    step_dir,
    sum_files,
    verify_files,
    write_manifest,
)
from mt_data import BatchSchedule, DataLoaderState
from mt_dist import ParallelGroups
from mt_model import GPT
from mt_pipeline import ModelLayout
from mt_pretrain.config.resolve import RunPlan
from mt_pretrain.config.schema import ConfigError, PretrainConfig
from mt_pretrain.data.inputs import default_cache_dir, to_batch
from mt_pretrain.engines.base import Engine, Saver
from mt_pretrain.engines.build import build_model_stage, seed_everything
from mt_pretrain.engines.deepspeed_pipe import (
    build_pipeline_module,
    deepspeed_names,
    micro_batches,
)
from mt_tensor_parallel import defer_replicated_grads
from mt_zero import StepResult, decay_param_groups
from mt_zero.deepspeed_engine import (
    deepspeed_config,
    deepspeed_environ,
    init_deepspeed_distributed,
    initialize_deepspeed,
    sum_partial_grads_at_boundary,
)
from mt_zero.deepspeed_mpu import GroupsMpu
from mt_zero.deepspeed_universal import UNIVERSAL_CHECKPOINT_INFO, universal_checkpoint_info

__all__ = ["DeepSpeedCheckpointer", "DeepSpeedEngine", "load_deepspeed_checkpoint"]


class DeepSpeedEngine(Engine):
    """mt's stage trained by DeepSpeed: ``DeepSpeedEngine`` (pp == 1) or ``PipelineEngine``
    (pp > 1). ``ds`` is DeepSpeed's engine, ``client`` mt's AdamW inside it (its param
    groups are shared with DeepSpeed: the learning rate is set there)."""

    def __init__(self, built: Built, ds: Any, client: torch.optim.Optimizer,
                 config: PretrainConfig, plan: RunPlan, groups: ParallelGroups) -> None:
        super().__init__(built)
        self.ds, self.client, self.config, self.plan, self.groups = (
            ds, client, config, plan, groups)
        self.pipelined = plan.topology.pp > 1

    @classmethod
    def create(cls, config: PretrainConfig, plan: RunPlan, groups: ParallelGroups,
               device: torch.device) -> DeepSpeedEngine:
        """mt's stage (mt's init, mt's TP layers; dropout not keyed: DeepSpeed's pipeline
        engine calls the layers itself) inside DeepSpeed."""
        seed_everything(config.train.seed, groups)
        built = build_model_stage(plan, groups, config.train.seed,
                                  plan.layout.sequence_parallel, device)
        built.stage.train()
        ds, client = _initialize(config, plan, built.stage, groups)
        return cls(built, ds, client, config, plan, groups)

    @classmethod
    def preload(cls, config: PretrainConfig) -> None:
        """Import DeepSpeed before the ranks of a CPU run are forked. Its ``initialize``
        imports its Muon optimizer module, which compiles functions with ``torch.compile`` at
        import and so loads inductor: 8 s a process, measured 30 s of an 8-rank run on 2
        cores. Skipped where the ranks may use CUDA (importing DeepSpeed's CUDA accelerator
        before a fork could initialize CUDA there) or DS_ACCELERATOR names another one."""
        device = config.parallel.device
        if device == "cuda" or (device == "auto" and torch.backends.cuda.is_built()):
            return
        if os.environ.setdefault("DS_ACCELERATOR", "cpu") != "cpu":  # as _set_environment
            return
        with contextlib.suppress(ImportError):  # the rank then says what is missing
            # by name: an optional engine, not a dependency of the package
            importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")

    def set_lr(self, lr: float) -> None:
        for group in self.client.param_groups:
            group["lr"] = lr

    def forward_backward(self, micro: Sequence[np.ndarray], keys: list[int] | None) -> float:
        device = self.groups.device
        if self.pipelined:  # forward, backward and the optimizer step of the whole batch
            pairs = micro_batches(list(micro), device)
            expected = self.ds.gradient_accumulation_steps()
            if len(pairs) != expected:
                raise RuntimeError(f"{len(pairs)} micro-batches but DeepSpeed's "
                                   f"gradient_accumulation_steps is {expected}")
            return float(self.ds.train_batch(iter(pairs)))
        stage, m, total = self.built.stage, len(micro), 0.0
        for array in micro:
            batch = to_batch([array]).to(device)
            loss = stage.loss(self.ds(batch[:, :-1]), batch[:, 1:])
            # Without DeepSpeed's own 1/accumulation scaling (divided by m here); its step
            # applies the optimizer only at the accumulation boundary.
            self.ds.backward(loss / m, scale_wrt_gas=False)
            self.ds.step()
            total += float(loss.detach())
        return total / m

    def step(self) -> StepResult:
        """DeepSpeed stepped at the end of the batch; report its gradient norm."""
        if not self.ds.was_step_applied():
            raise RuntimeError(
                "DeepSpeed did not step at the end of the global batch: its "
                f"gradient_accumulation_steps {self.ds.gradient_accumulation_steps()} "
                "differs from the number of micro-batches")
        norm = self.ds.get_global_grad_norm()
        return StepResult(grad_norm=float(norm) if norm is not None else float("nan"),
                          skipped=False, loss_scale=1.0)

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        """Evaluation needs nothing extra: ZeRO-3's module hooks gather parameters."""
        return contextlib.nullcontext()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        if self.pipelined:  # this stage's, under mt's names
            return _fp32_weights(self.built.stage.named_parameters(), stage3=False)
        return _fp32_weights(self.ds.module.named_parameters(),
                             self.plan.layout.zero_stage == 3)

    def saver(self, root: Path, keep_last: int) -> Saver:
        return DeepSpeedCheckpointer(root, self.ds, self.groups, self.built.tracker,
                                     universal_state(self.plan, self.built.stage.layout
                                                     if self.pipelined else None))

    def load(self, path: str | Path) -> tuple[int, DataLoaderState]:
        step, state = load_deepspeed_checkpoint(path, self.ds, self.groups, self.built.tracker)
        train = self.config.train
        mine = BatchSchedule(train.global_batch_size, self.plan.rampup).consumed_at(step)
        if state.consumed_samples != mine:  # its own schedule: DeepSpeed's batch settings
            given = f"--global-batch-size {train.global_batch_size}" + \
                (" and ramp-up" if self.plan.rampup else "")
            steps = f"{step} step{'s' * (step != 1)}"
            raise ConfigError(f"--load {path}: its run consumed {state.consumed_samples:,} "
                              f"samples in {steps}, where this run's batch schedule "
                              f"({given}) consumes {mine:,}: --engine deepspeed resumes at "
                              "the global batch size and ramp-up its run started with "
                              "(--engine mt checkpoints may change them)")
        return step, state


def universal_state(plan: RunPlan, pipeline: ModelLayout | None) -> dict[str, Any]:
    """What a DeepSpeed checkpoint of mt's model carries beside DeepSpeed's own state, for
    ``ds_to_universal`` and ``mt convert``: the rules that join mt's tensor-parallel slices
    (:func:`mt_zero.deepspeed_universal.universal_checkpoint_info`), the model config
    (``mt_model``) and, with pipeline stages (``pipeline``: the stages' module layout), mt's
    name of each parameter DeepSpeed names (``mt_names``)."""
    from mt_tensor_parallel import padded_vocab_size

    gpt, tp = plan.gpt, plan.layout.tp
    styles = sharding_styles(gpt, tp)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in GPT(gpt, seed=None).named_parameters()}
    names = (deepspeed_names(styles, gpt.n_layers, pipeline) if pipeline is not None
             else {n: n for n in styles})
    info = universal_checkpoint_info({names[n]: s for n, s in styles.items()},
                                     {names[n]: shape for n, shape in shapes.items()},
                                     gpt.vocab_size, padded_vocab_size(gpt.vocab_size, tp))
    state: dict[str, Any] = {UNIVERSAL_CHECKPOINT_INFO: info, "mt_model": gpt.to_dict()}
    if pipeline is not None:
        state["mt_names"] = {ds: mt for mt, ds in names.items()}
    return state


def _fp32_weights(named: Iterator[tuple[str, nn.Parameter]],
                  stage3: bool) -> dict[str, torch.Tensor]:
    """DeepSpeed's fp32 master copy of each parameter (``safe_get_full_fp32_param``: ZeRO
    1-3 and bf16 keep one; collective over DP), else the parameter itself (fp32 ZeRO-0)."""
    import deepspeed  # pants: no-infer-dep (optional engine)
    from deepspeed.utils import safe_get_full_fp32_param  # pants: no-infer-dep

    named = list(named)
    out = {}
    with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=stage3):
        for name, param in named:
            master = safe_get_full_fp32_param(param)
            full = param if master is None else master
            out[name] = full.detach().float().reshape(param.ds_shape if stage3 else
                                                      param.shape).clone()
    return out


def _set_environment(groups: ParallelGroups) -> None:
    """What DeepSpeed reads from the environment; launchers (torchrun, deepspeed) may have
    set it already, `--nproc` children have not."""
    env = deepspeed_environ(groups.rank, groups.topology.world_size, groups.rank,
                            "cuda" if groups.device.type == "cuda" else "cpu")
    for key, value in env.items():
        os.environ.setdefault(key, value)
    # Where DeepSpeed would cache ops it JIT-builds (its shm inference allreduce, the one it
    # builds on CPU, is skipped: init_deepspeed_distributed).
    os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                          str(default_cache_dir(os.environ) / "torch_extensions"))
    _clear_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))  # every node's


#: A JIT build of DeepSpeed's ops takes minutes; a lock older than this was left by a build
#: that was killed (torch waits on such a lock forever).
STALE_BUILD_LOCK_S = 1800.0


def _clear_stale_build_locks(extensions: Path) -> None:
    """Remove the ``lock`` files of killed extension builds, with a warning naming each."""
    now = time.time()
    for lock in extensions.glob("*/lock"):
        with contextlib.suppress(OSError):
            if now - lock.stat().st_mtime > STALE_BUILD_LOCK_S:
                lock.unlink()
                warnings.warn(f"{lock}: removed the lock of an extension build that did not "
                              f"finish (older than {STALE_BUILD_LOCK_S:g} s)", stacklevel=2)


def _initialize(config: PretrainConfig, plan: RunPlan, stage: nn.Module,
                groups: ParallelGroups) -> tuple[Any, torch.optim.Optimizer]:
    """``deepspeed.initialize`` on this rank's model with mt's AdamW and decay groups:
    a ``PipelineModule`` around the stage when pp > 1, else the stage with mt's groups as
    DeepSpeed's ``mpu``."""
    _set_environment(groups)
    train, layout = config.train, plan.layout  # the run's one layout
    client = torch.optim.AdamW(decay_param_groups(stage.named_parameters(), train.weight_decay),
                               lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                               eps=train.adam_eps)
    dp = layout.dp
    zero = layout.zero_config(clip_grad=train.clip_grad,
                              bucket_numel=config.parallel.bucket_numel)
    accumulation = max(1, layout.global_batch // (layout.micro_batch * dp))
    ds_config = deepspeed_config(zero, layout.micro_batch, accumulation, dp)
    backend = "nccl" if groups.device.type == "cuda" else "gloo"
    styles = sharding_styles(plan.gpt, layout.tp)
    if layout.pp > 1:
        import deepspeed  # pants: no-infer-dep (optional engine)

        init_deepspeed_distributed(deepspeed, backend)
        # DeepSpeed sends 1/tp of each activation and all-gathers it over TP after the
        # hop, assuming activations are replicated over TP; with sequence parallelism each
        # TP rank holds its own sequence slice, so send them whole.
        whole = not layout.sequence_parallel
        ds_config["pipeline"] = {"pipe_partitioned": whole, "grad_partitioned": whole}
        module = build_pipeline_module(stage, plan, groups, styles)  # type: ignore
        engine = initialize_deepspeed(module, client, ds_config, dist_backend=backend)
        return _sum_replicated_once(engine, stage, plan, groups), client
    for name, param in stage.named_parameters():
        # DeepSpeed's norm counts sliced parameters on every TP rank, the rest on TP rank 0.
        param.model_parallel = styles.get(name, "replicate") != "replicate"  # type: ignore
    engine = initialize_deepspeed(stage, client, ds_config, dist_backend=backend,
                                  mpu=GroupsMpu(groups))
    names = getattr(stage, "layout", None)  # the stage's module names
    if layout.zero_stage == 3 and names is not None and names.head and names.tied_weight:
        # The head uses the embedding's weight outside the embedding module: ZeRO-3 must
        # gather it around the head too (in evaluation as well as in training).
        import deepspeed  # pants: no-infer-dep (optional engine)

        deepspeed.zero.register_external_parameter(stage.get_submodule(names.head),
                                                   stage.get_parameter(names.tied_weight))
    return _sum_replicated_once(engine, stage, plan, groups), client


def _sum_replicated_once(engine: Any, stage: nn.Module, plan: RunPlan,
                         groups: ParallelGroups) -> Any:
    """Under sequence parallelism the parameters replicated over TP accumulate their partial
    gradients locally and are summed over TP once per step, in one all-reduce at
    DeepSpeed's accumulation boundary (every ZeRO stage), as mt's engine does."""
    layout = plan.layout
    if layout.sequence_parallel and layout.tp > 1:
        partial = [p for _, p in defer_replicated_grads(stage)]
        sum_partial_grads_at_boundary(engine, partial, groups.tp)
    return engine


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / sidecar_rank_file(rank)


def _find_checkpoint(path: str | Path) -> Path:
    """The step folder ``path`` designates: itself, or the one DeepSpeed's ``latest`` names."""
    path = Path(path)
    if _rank_file(path, 0).is_file():
        return path
    latest = path / LATEST  # DeepSpeed's pointer file has mt's name
    if latest.is_file():
        return path / latest.read_text(encoding="utf-8").strip()
    raise FileNotFoundError(f"no DeepSpeed-engine checkpoint at {path} (neither "
                            f"{_rank_file(path, 0).name} nor latest found)")


class DeepSpeedCheckpointer:
    """Checkpoints in DeepSpeed's own format (``engine.save_checkpoint``: model, ZeRO
    optimizer shards, its ``latest`` tag file) plus mt's per-rank file: layout, data-loader
    position and RNG states (default generator, TP streams)."""

    def __init__(self, root: Path, ds: Any, groups: ParallelGroups,
                 tracker: Any = None, client: dict[str, Any] | None = None) -> None:
        self.root, self.ds, self.groups, self.tracker = root, ds, groups, tracker
        self.client = client or {}  # saved in DeepSpeed's model-states files
        self.last_saved: Path | None = None
        self.last_step: int | None = None
        self.longest_write = 0.0  # DeepSpeed's engine writes in the foreground

    def settle(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass

    def save(self, step: int, data_state: DataLoaderState, background: bool = False) -> Path:
        """Write the checkpoint of ``step`` (collective; never in the background:
        --async-save is refused with this engine); returns its folder."""
        tag = step_dir(step)
        folder = self.root / tag
        topo = self.groups.topology
        mine = {"step": step, "data": data_state.to_dict(),
                "layout": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp},
                "rng": {"torch": torch.get_rng_state(),
                        "tracker": self.tracker.state_dict() if self.tracker else {}}}
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{sidecar_rank_file(self.groups.rank)}.tmp"
        torch.save(mine, tmp)
        tmp.replace(_rank_file(folder, self.groups.rank))
        # DeepSpeed writes `latest` (rank 0) after its shards: our files come first.
        self.ds.save_checkpoint(str(self.root), tag=tag,
                                client_state={**self.client, "data": data_state.to_dict()})
        _write_checksums(folder, self.groups)
        self.last_saved, self.last_step = folder, step
        return folder


def load_deepspeed_checkpoint(path: str | Path, ds: Any,
                              groups: ParallelGroups, tracker: Any = None
                              ) -> tuple[int, DataLoaderState]:
    """Resume a DeepSpeed-engine checkpoint (a ``step-*`` folder, or the folder holding
    ``latest``) at the same layout; returns (step, data-loader state)."""
    folder = _find_checkpoint(path)
    mine_path = _rank_file(folder, groups.rank)
    if not mine_path.is_file():
        raise FileNotFoundError(f"{folder} has no {mine_path.name}: not a checkpoint of "
                                "`mt pretrain --engine deepspeed` at this world size")
    _verify_checksums(folder, groups)  # before anything of the folder is unpickled
    mine = torch.load(mine_path, map_location="cpu", weights_only=True)
    topo = groups.topology
    saved = mine["layout"]
    if (saved["tp"], saved["pp"], saved["dp"]) != (topo.tp, topo.pp, topo.dp):
        raise ValueError(f"{folder} was written at tp {saved['tp']} pp {saved['pp']} dp "
                         f"{saved['dp']}; --engine deepspeed resumes only at the same layout, "
                         f"not tp {topo.tp} pp {topo.pp} dp {topo.dp} (use --engine mt "
                         "checkpoints to change layouts)")
    load_path, _client = ds.load_checkpoint(
        str(folder.parent), tag=folder.name, load_optimizer_states=True,
        load_lr_scheduler_states=False)
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint in {folder}")
    torch.set_rng_state(mine["rng"]["torch"])
    if tracker is not None and mine["rng"]["tracker"]:
        tracker.load_state_dict(mine["rng"]["tracker"])
    return int(mine["step"]), DataLoaderState.from_dict(mine["data"])


def _write_checksums(folder: Path, groups: ParallelGroups) -> None:
    """mt's checksums of every file of the step folder (DeepSpeed's and mt's), each rank
    reading its share, rank 0 writing the manifest (collective)."""
    dist.barrier()  # every rank's files are on disk
    world = groups.topology.world_size
    names = folder_files(folder)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, sum_files(folder, names, groups.rank, world))
    if groups.rank == 0:
        write_manifest(folder, {k: v for part in parts for k, v in part.items()})
    dist.barrier()


def _verify_checksums(folder: Path, groups: ParallelGroups) -> None:
    """Every file of the step folder checked against its manifest before DeepSpeed reads
    any, each rank checking its share; one rank's finding fails every rank alike."""
    sums = read_manifest(folder)
    if sums is None:
        return
    world = groups.topology.world_size
    found: list[Any] = [None] * world
    dist.all_gather_object(found, verify_files(folder, sums, groups.rank, world))
    problems = [p for p in found if p]
    if problems:
        raise CheckpointError(problems[0])
