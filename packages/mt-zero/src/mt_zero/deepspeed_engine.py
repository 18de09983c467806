"""DeepSpeed as a second engine: the same model, data and optimizer through ``deepspeed``.

:func:`deepspeed_config` translates mt's :class:`~mt_zero.optimizer.ZeroConfig` (stage,
precision, clipping, bucket size, loss scaling) plus the batch layout into DeepSpeed's JSON
config, as a pure function. :func:`initialize_deepspeed` wraps ``deepspeed.initialize``
with a *client* torch optimizer (mt's AdamW with its weight-decay parameter groups), so the
optimizer math is torch's in both engines and no DeepSpeed op (cpu_adam, fused_adam) has to
be JIT-compiled.

``deepspeed`` is imported only inside :func:`initialize_deepspeed`: mt-zero imports and
works without it. DeepSpeed reads its accelerator and ranks from the environment, so the
caller (an app, or a test's child process) sets the variables of :func:`deepspeed_environ`
before the first ``import deepspeed``; this library never touches ``os.environ``.
Its groups come from mt's: an ``mpu`` (:mod:`mt_zero.deepspeed_mpu`) or, for pipelines, a
topology with mt's rank order.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mt_dist.collectives import all_reduce_sum_flat
from mt_zero.optimizer import ZeroConfig

__all__ = ["deepspeed_config", "deepspeed_environ", "init_deepspeed_distributed",
           "initialize_deepspeed", "sum_partial_grads_at_boundary"]

#: DeepSpeed's shared-memory allreduce op: its torch backend JIT-compiles it when it starts
#: on CPU (tens of seconds, and again for every new install path), but only its inference
#: ``inference_all_reduce`` uses it; mt never calls that.
SHM_COMM_OP = "deepspeed_shm_comm"

#: Printing every N steps: effectively never (mt reports its own metrics).
_QUIET_STEPS = 2**31 - 1


def deepspeed_config(
    zero: ZeroConfig,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    dp_size: int,
    offload: bool = False,
) -> dict[str, Any]:
    """DeepSpeed's config dict for ``zero`` and the batch layout.

    Args:
        zero: stage 0-3, precision (fp32 / bf16 / fp16 with ``zero.loss_scaler``),
            ``clip_grad`` (0 disables) and ``bucket_numel`` (DeepSpeed's reduce and
            all-gather bucket sizes).
        micro_batch_size: sequences per micro-batch per data-parallel rank.
        gradient_accumulation_steps: micro-batches per optimizer step (DeepSpeed
            accumulates and divides the loss by this itself).
        dp_size: data-parallel ranks (train_batch_size = micro x accumulation x dp).
        offload: keep the optimizer state (and with stage 3 the parameters) in CPU memory;
            needs stage >= 1 (stage 3 for parameters).

    The config names no optimizer or scheduler: the client optimizer is passed to
    ``deepspeed.initialize`` and mt drives the learning rate itself.
    """
    problems = []
    if micro_batch_size < 1 or gradient_accumulation_steps < 1 or dp_size < 1:
        problems.append(f"micro_batch_size {micro_batch_size}, gradient_accumulation_steps "
                        f"{gradient_accumulation_steps} and dp_size {dp_size} must all be >= 1")
    if offload and zero.stage == 0:
        problems.append(f"CPU offload needs ZeRO stage >= 1, got stage {zero.stage}")
    if problems:
        raise ValueError("; ".join(problems))
    zero_section: dict[str, Any] = {
        "stage": zero.stage,
        "reduce_bucket_size": zero.bucket_numel,
        "allgather_bucket_size": zero.bucket_numel,
        "overlap_comm": False,  # gloo on CPU: a side stream buys nothing
    }
    if offload:
        zero_section["offload_optimizer"] = {"device": "cpu"}
        if zero.stage == 3:
            zero_section["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "train_batch_size": micro_batch_size * gradient_accumulation_steps * dp_size,
        "zero_optimization": zero_section,
        "gradient_clipping": float(zero.clip_grad),
        # A client torch optimizer under ZeRO is "untested" to DeepSpeed; it works.
        "zero_allow_untested_optimizer": True,
        # With offload, use the client torch AdamW on the CPU copy (no cpu_adam build).
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": _QUIET_STEPS,
        "wall_clock_breakdown": False,
    }
    if zero.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif zero.precision == "fp16":
        scaler = zero.loss_scaler
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # 0 = dynamic
            "initial_scale_power": round(math.log2(scaler.init_scale)),
            "loss_scale_window": scaler.growth_interval,
            "min_loss_scale": scaler.min_scale,
            "hysteresis": 1,
        }
    if zero.precision != "fp32" and zero.main_grads:
        # mt's fp32 main gradients: accumulated and reduced in fp32 (DeepSpeed's default for
        # the reduction is the compute dtype).
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["communication_data_type"] = "fp32"
    return config


def deepspeed_environ(rank: int, world_size: int, local_rank: int,
                      accelerator: str = "cpu") -> dict[str, str]:
    """Environment variables DeepSpeed expects before ``import deepspeed``.

    ``deepspeed.initialize`` asserts LOCAL_RANK is set (its launcher or torchrun set it;
    ``mt pretrain --nproc`` and test processes do not), and DS_ACCELERATOR picks its
    accelerator (``cpu`` here: no IPEX / oneCCL needed with gloo). The caller applies them.
    """
    if not 0 <= rank < world_size or not 0 <= local_rank < world_size:
        raise ValueError(f"need 0 <= rank {rank} < world_size {world_size} and "
                         f"0 <= local_rank {local_rank} < world_size")
    return {"DS_ACCELERATOR": accelerator, "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(local_rank)}


def initialize_deepspeed(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: dict[str, Any],
    dist_backend: str = "gloo",
    mpu: Any = None,
) -> Any:
    """``deepspeed.initialize`` with a client optimizer; returns the DeepSpeed engine.

    Reuses the already initialized default process group (DeepSpeed wraps it instead of
    creating one). Train with ``loss = engine(*inputs)``, ``engine.backward(loss)``,
    ``engine.step()`` once per micro-batch: DeepSpeed accumulates
    ``gradient_accumulation_steps`` micro-batches and steps the optimizer on the last.
    Set the learning rate on ``optimizer.param_groups`` (they are shared with the engine).
    ``mpu`` (e.g. :class:`mt_zero.deepspeed_mpu.GroupsMpu`) gives DeepSpeed its data- and
    model-parallel groups; it must be None for a ``PipelineModule``, whose own grid (built
    from its topology) serves instead, and a ``PipelineEngine`` is returned then.
    """
    try:
        import deepspeed  # pants: no-infer-dep (lazy: optional, mt-zero[deepspeed])
    except ImportError as err:
        raise ImportError("the DeepSpeed engine needs the deepspeed package "
                          "(pip install deepspeed==0.19.8)") from err

    init_deepspeed_distributed(deepspeed, dist_backend)
    engine, _opt, _loader, _sched = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, mpu=mpu)
    return engine


def sum_partial_grads_at_boundary(engine: Any, params: list[nn.Parameter],
                                  group: Any) -> None:
    """Make DeepSpeed's ``engine`` sum ``params``' gradients over ``group`` once per step,
    in one all-reduce, at the accumulation boundary. ``params``: parameters whose gradient
    on this rank is a partial sum (replicated over tensor parallelism under sequence
    parallelism, after :func:`mt_tensor_parallel.defer_replicated_grads`), accumulated
    locally over the step's micro-batches.

    The sum runs in the engine's ``allreduce_gradients`` (which its backward and the
    pipeline engine's schedule call) on the tensor that holds each accumulated gradient
    there (:func:`_accumulated_grads`): before DeepSpeed's data-parallel reduction where
    the gradients wait for it whole (ZeRO 0 and 1), after it where the reduction leaves
    each rank its partition (ZeRO 2 and 3: only the owned part of each parameter is summed,
    1 / dp of the bytes). Both sums are linear, so either order gives the per-use sums'
    result. TP peers partition alike (equal shapes); that is checked here, once, with one
    all-reduce over ``group``. ValueError for CPU offload (the gradients leave for host
    buffers inside the backward)."""
    if not params:
        return
    optimizer = engine.optimizer
    if getattr(optimizer, "cpu_offload", False) or getattr(optimizer, "offload_optimizer",
                                                           False):
        raise ValueError("DeepSpeed's CPU offload moves every micro-batch's gradients to the "
                         "host inside the backward: partial gradients cannot be summed once "
                         "per step there (keep the per-use all-reduce)")
    stage = engine.zero_optimization_stage()
    after = stage >= 2
    spans = _zero2_spans(optimizer) if stage == 2 else {}
    sizes = _owned_numels(stage, params, spans)
    bounds = torch.tensor([sum(sizes), -sum(sizes)], dtype=torch.int64)
    torch.distributed.all_reduce(bounds, torch.distributed.ReduceOp.MAX, group=group)
    most, least = bounds.tolist()
    if most != -least:
        raise ValueError(f"ZeRO {stage}: the TP peers hold between {-least} and {most} "
                         "elements of the partial gradients: their partitions differ, so "
                         "they cannot be summed element for element")
    reduce = engine.allreduce_gradients

    def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary and not after:
            all_reduce_sum_flat(_accumulated_grads(engine, params, sizes, spans), group)
        out = reduce(*args, **kwargs)
        if boundary and after:
            all_reduce_sum_flat(_accumulated_grads(engine, params, sizes, spans), group)
        return out

    engine.allreduce_gradients = allreduce_gradients


def _owned_numels(stage: int, params: list[nn.Parameter],
                  spans: dict[int, tuple[int, int, int]]) -> list[int]:
    """How many elements of each of ``params``' gradients this rank holds at the step: all
    of them at ZeRO 0 and 1; at ZeRO 2 the part inside this rank's flat partition (``spans``;
    zero for a parameter outside it); at ZeRO 3 its partition (padding included)."""
    if stage <= 1:
        return [p.numel() for p in params]
    if stage == 3:
        return [p.partition_numel() for p in params]
    return [spans[id(p)][2] if id(p) in spans else 0 for p in params]


def _zero2_spans(optimizer: Any) -> dict[int, tuple[int, int, int]]:
    """ZeRO 2: (group, offset in this rank's gradient partition, elements) of every
    parameter that has elements in the partition, by ``id``."""
    spans = {}
    for group, in_partition in enumerate(optimizer.params_in_partition):
        rank = torch.distributed.get_rank(group=optimizer.real_dp_process_group[group])
        size = int(optimizer.partition_size[group])
        for p in in_partition:
            key = optimizer.get_param_id(p)
            start = int(optimizer.grad_start_offset[group][rank][key])
            dest = int(optimizer.grad_partition_insertion_offset[group][rank][key])
            spans[id(p)] = (group, dest, min(p.numel() - start, size - dest))
    return spans


def _accumulated_grads(engine: Any, params: list[nn.Parameter], sizes: list[int],
                       spans: dict[int, tuple[int, int, int]]) -> list[torch.Tensor]:
    """The tensors holding ``params``' accumulated gradients (this rank's part) at the
    boundary, each a view DeepSpeed's step then reads: ``param.grad`` (ZeRO 0 in fp32 or
    fp16; ZeRO 1 without fp32 accumulation), the bf16 optimizer's fp32 gradient (ZeRO 0 in
    bf16), ``param.grad_accum`` (ZeRO 1 with fp32 accumulation), the slice of the rank's
    gradient partition (ZeRO 2, after the reduction), the parameter's gradient partition
    (ZeRO 3, after it). A gradient absent on this rank (the parameter unused this step)
    becomes zeros where DeepSpeed reads it."""
    optimizer, stage = engine.optimizer, engine.zero_optimization_stage()
    wanted = {id(p): i for i, p in enumerate(params)}
    grads: list[torch.Tensor | None] = [None] * len(params)
    if stage == 3:
        for group, members in enumerate(optimizer.fp16_groups):
            for p, grad in zip(members, optimizer.averaged_gradients[group], strict=True):
                if id(p) in wanted:
                    grads[wanted[id(p)]] = grad
    elif stage == 2:  # the partition's pieces lie end to end (padding pieces included)
        for group, pieces in optimizer.averaged_gradients.items():
            starts, offset = {}, 0
            for piece in pieces:
                starts[offset] = piece
                offset += piece.numel()
            for p in params:
                span = spans.get(id(p))
                if span is not None and span[0] == group and span[1] in starts:
                    grads[wanted[id(p)]] = starts[span[1]].view(-1)
        empty = torch.zeros(0)  # a parameter outside this rank's partition
        grads = [empty if g is None else g for g in grads]
    elif hasattr(optimizer, "fp32_groups_gradients"):  # the bf16 optimizer (ZeRO 0)
        for group, members in enumerate(optimizer.bf16_groups):
            for p, grad in zip(members, optimizer.fp32_groups_gradients[group], strict=True):
                if id(p) in wanted:
                    grads[wanted[id(p)]] = grad
    else:
        accum = getattr(optimizer, "use_grad_accum_attribute", False)  # ZeRO 1, fp32 accumulation
        for i, p in enumerate(params):
            if accum:
                if p.grad_accum is None:
                    p.grad_accum = torch.zeros_like(p, dtype=optimizer.gradient_accumulation_dtype)
                grads[i] = p.grad_accum
            else:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads[i] = p.grad
    found = [g for g in grads if g is not None]
    if len(found) != len(params) or [g.numel() for g in found] != sizes:
        raise RuntimeError(f"ZeRO {stage}: the accumulated gradients of the partial parameters "
                           "are not where DeepSpeed's step reads them")
    return [g for g in found if g.numel()]


def init_deepspeed_distributed(deepspeed: Any, dist_backend: str = "gloo") -> None:
    """``deepspeed.init_distributed`` (wrapping the default process group) without building
    DeepSpeed's shared-memory inference allreduce (:data:`SHM_COMM_OP`): the op is marked
    incompatible in DeepSpeed's own table (which its start probes anyway), so its backend
    does not JIT-compile it. Training collectives go through torch.distributed either way."""
    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    deepspeed.init_distributed(dist_backend=dist_backend)
