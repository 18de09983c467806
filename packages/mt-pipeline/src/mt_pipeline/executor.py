"""Run one stage's instruction list over torch.distributed: the pipeline executor.

Each instruction type has one handler. Activations and gradients have a shape fixed in
advance (``activation_shape``, e.g. ``(micro_batch, seq, hidden)``), so receive buffers are
allocated without any shape handshake. Gradients of all micro-batches accumulate into the
parameters' ``.grad`` (each micro-batch loss is scaled by ``1 / m``), so after a step the
gradients equal those of the mean loss over the whole batch, as in one process. An optimizer
that keeps gradients elsewhere (e.g. mt-zero's fp32 main gradients) names where through
``grad_of``: the tied weights' gradients are summed there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mt_pipeline.checks import ops_of
from mt_pipeline.config import PipelineConfig
from mt_pipeline.p2p import StageComm
from mt_pipeline.schedules import (
    Backward,
    Forward,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    P2POp,
    RecvActivation,
    RecvGrad,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from mt_pipeline.simulator import Event
from mt_pipeline.stage import PipelineStage

__all__ = ["PipelineExecutor", "PipelineStepResult"]

_Key = tuple[int, int]  # (micro-batch, local chunk)


@dataclass(frozen=True)
class PipelineStepResult:
    """Outcome of one pipeline step on one rank.

    Attributes:
        loss: mean loss over the micro-batches (known on every stage when the executor
            broadcasts it, else only on the last stage and NaN elsewhere).
        micro_batch_losses: each micro-batch's loss, on the last stage only.
        events: per-instruction timeline (``time.perf_counter`` seconds, comparable across
            processes of one machine) when recording was asked for, else empty.
        peak_in_flight: most chunk forwards whose activations were held at once (what the
            schedule's memory bound is about; equals the simulator's count).
    """

    loss: float
    micro_batch_losses: tuple[float, ...] = ()
    events: tuple[Event, ...] = ()
    peak_in_flight: int = 0


@dataclass
class _StepState:
    """Tensors alive during one step (kept off the executor so a step cannot leak)."""

    inputs: list[torch.Tensor] | None
    targets: list[torch.Tensor] | None
    keys: Sequence[int] | None = None
    loaded: dict[int, torch.Tensor] = field(default_factory=dict)
    received_act: dict[_Key, torch.Tensor] = field(default_factory=dict)
    received_grad: dict[_Key, torch.Tensor] = field(default_factory=dict)
    # (chunk input, chunk output or scaled loss) kept from forward until backward.
    saved: dict[_Key, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    outbox_act: dict[_Key, torch.Tensor] = field(default_factory=dict)
    outbox_grad: dict[_Key, torch.Tensor] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    peak_in_flight: int = 0
    optimizer_step: Callable[[], Any] | None = None


def _split(batch: torch.Tensor | None, m: int, what: str, stage: int) -> list[torch.Tensor] | None:
    if batch is None:
        return None
    if batch.dim() < 1 or batch.shape[0] % m != 0:
        raise ValueError(
            f"stage {stage}: {what} batch of {batch.shape[0] if batch.dim() else 0} rows "
            f"cannot be split into {m} equal micro-batches"
        )
    return list(batch.chunk(m, dim=0))


class PipelineExecutor:
    """Executes this rank's share of a pipeline schedule for one stage.

    Args:
        stage: this rank's :class:`PipelineStage` (its chunks, embedding / head / loss).
        config: schedule, micro-batch count, virtual stages, checkpointing.
        comm: ranks and groups of this rank's pipeline (:meth:`StageComm.from_groups`).
        activation_shape: shape of one micro-batch's activation (and gradient) between
            stages, e.g. ``(micro_batch, seq, hidden)``; ``(micro_batch, seq // tp, hidden)``
            with sequence parallelism.
        dtype: activation dtype sent between stages.
        device: where receive buffers live (default: the stage's parameters' device).
        broadcast_loss: send the mean loss from the last stage to every stage each step.
        grad_of: where a parameter's accumulated gradient lives, for the tied weights' sum
            over stages (default: its ``.grad``; mt-zero: ``ZeroOptimizer.main_grad``).
    """

    def __init__(
        self,
        stage: PipelineStage,
        config: PipelineConfig,
        comm: StageComm,
        activation_shape: Sequence[int],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        broadcast_loss: bool = True,
        grad_of: Callable[[torch.nn.Parameter], torch.Tensor] | None = None,
    ) -> None:
        # Pure validation first: a bad (stages, micro-batches, chunks) combination raises
        # here, before any communication.
        self.instructions: list[Instruction] = config.schedule_for(comm.num_stages)[comm.stage]
        if stage.stage_index != comm.stage or stage.num_chunks != config.virtual_stages:
            raise ValueError(
                f"stage module is stage {stage.stage_index} with {stage.num_chunks} chunks, "
                f"but this rank runs stage {comm.stage} of {comm.num_stages} with "
                f"virtual_stages={config.virtual_stages}"
            )
        if stage.plan.has_embedding != comm.is_first or stage.plan.has_head != comm.is_last:
            raise ValueError(
                f"stage {comm.stage} of {comm.num_stages}: embedding/head placement "
                f"({stage.plan.has_embedding}, {stage.plan.has_head}) does not match"
            )
        if any(n < 1 for n in activation_shape):
            raise ValueError(f"activation_shape must be positive, got {tuple(activation_shape)}")
        self.stage, self.config, self.comm = stage, config, comm
        self.activation_shape = torch.Size(activation_shape)
        self.dtype, self.broadcast_loss = dtype, broadcast_loss
        self._grad_of = grad_of or _dot_grad
        if device is None:
            first = next(iter(stage.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self._run_chunk, self._run_loss = stage.forward_chunk, stage.forward_loss
        if config.compile:
            # Compiled once per function (dynamo caches by code object and guards), so
            # executors built later for other micro-batch counts reuse the compiled code.
            self._run_chunk = torch.compile(stage.forward_chunk)
            self._run_loss = torch.compile(stage.forward_loss)

    def run(
        self,
        inputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        *,
        optimizer_step: Callable[[], Any] | None = None,
        record: bool = False,
        keys: Sequence[int] | None = None,
    ) -> PipelineStepResult:
        """Run one step (all micro-batches): forward, backward, tied-gradient sum, optimizer.

        ``inputs`` (token ids, first stage) and ``targets`` (last stage) hold this pipeline's
        whole batch; they are split into ``num_micro_batches`` along dim 0. Gradients are
        *added* to ``.grad``: zero them before the step. ``optimizer_step`` (e.g.
        ``optimizer.step``) runs at the schedule's OptimizerStep; leave it None to step
        yourself (e.g. after a data-parallel gradient reduction). ``record`` keeps a
        timestamped event per instruction. ``keys`` name the micro-batches for the stage's
        RNG (one per micro-batch, the same on every stage; see :class:`RegionRNG`).
        """
        m, comm = self.config.num_micro_batches, self.comm
        if keys is not None and len(keys) != m:
            raise ValueError(f"{len(keys)} micro-batch keys for {m} micro-batches")
        if comm.is_first and inputs is None:
            raise ValueError("the first pipeline stage needs inputs")
        if comm.is_last and targets is None:
            raise ValueError("the last pipeline stage needs targets")
        state = _StepState(
            inputs=_split(inputs, m, "inputs", comm.stage) if comm.is_first else None,
            targets=_split(targets, m, "targets", comm.stage) if comm.is_last else None,
            optimizer_step=optimizer_step,
            keys=keys,
        )
        events: list[Event] = []
        for instruction in self.instructions:
            start = time.perf_counter()
            self._execute(instruction, state)
            if record:
                events.append(Event(comm.stage, start, time.perf_counter(), instruction))
        return self._result(state, events)

    def _result(self, state: _StepState, events: list[Event]) -> PipelineStepResult:
        if state.saved or state.received_act or state.received_grad:
            raise RuntimeError("pipeline step ended with unconsumed activations or gradients")
        per_micro = tuple(float(loss) for loss in state.losses)
        loss = torch.full((1,), math.nan, dtype=torch.float32, device=self.device)
        if per_micro:
            loss.fill_(sum(per_micro) / len(per_micro))
        if self.broadcast_loss:
            self.comm.broadcast_from_last(loss)
        return PipelineStepResult(float(loss.item()), per_micro, tuple(events),
                                  state.peak_in_flight)

    def _execute(self, instruction: Instruction, state: _StepState) -> None:
        if isinstance(instruction, Forward):
            self._forward(instruction.micro_batch, instruction.chunk, state)
        elif isinstance(instruction, Backward):
            self._backward(instruction.micro_batch, instruction.chunk, state)
        elif isinstance(instruction, LoadMicroBatch):
            self._load(instruction.micro_batch, state)
        elif isinstance(instruction, ReduceTiedGrads):
            self._reduce_tied()
        elif isinstance(instruction, OptimizerStep):
            if state.optimizer_step is not None:
                state.optimizer_step()
        elif ops_of(instruction):
            self._exchange(ops_of(instruction), state)
        else:
            raise TypeError(f"unknown pipeline instruction {instruction!r}")

    def _load(self, mb: int, state: _StepState) -> None:
        if state.inputs is not None:
            state.loaded[mb] = state.inputs[mb].to(self.device, non_blocking=True)
        if state.targets is not None:
            # Stored under -1 - mb so one dict holds both ends on a single-stage pipeline.
            state.loaded[-1 - mb] = state.targets[mb].to(self.device, non_blocking=True)

    def _forward(self, mb: int, chunk: int, state: _StepState) -> None:
        stage = self.stage
        if stage.is_first_chunk(chunk):
            x = state.loaded.pop(mb)
        else:
            x = state.received_act.pop((mb, chunk)).requires_grad_()
        checkpoint = self.config.recompute
        key = None if state.keys is None else state.keys[mb]
        if stage.is_last_chunk(chunk):
            loss = self._run_loss(chunk, x, state.loaded.pop(-1 - mb), checkpoint, key)
            state.losses.append(loss.detach())
            # Scale so that accumulated gradients are those of the mean over micro-batches.
            state.saved[(mb, chunk)] = (x, loss / self.config.num_micro_batches)
            state.peak_in_flight = max(state.peak_in_flight, len(state.saved))
            return
        out = self._run_chunk(chunk, x, checkpoint, key)
        if out.shape != self.activation_shape or out.dtype != self.dtype:
            raise ValueError(
                f"stage {self.comm.stage} chunk {chunk} produced {tuple(out.shape)} "
                f"{out.dtype}, but activations are declared {tuple(self.activation_shape)} "
                f"{self.dtype}"
            )
        state.saved[(mb, chunk)] = (x, out)
        state.peak_in_flight = max(state.peak_in_flight, len(state.saved))
        state.outbox_act[(mb, chunk)] = out.detach().contiguous()

    def _backward(self, mb: int, chunk: int, state: _StepState) -> None:
        x, out = state.saved.pop((mb, chunk))
        if self.stage.is_last_chunk(chunk):
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, state.received_grad.pop((mb, chunk)))
        if not self.stage.is_first_chunk(chunk):
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            state.outbox_grad[(mb, chunk)] = grad.contiguous()

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)

    def _exchange(self, ops: Sequence[P2POp], state: _StepState) -> None:
        posted: list[tuple[bool, int, torch.Tensor]] = []
        for op in ops:
            key = (op.micro_batch, op.chunk)
            if isinstance(op, SendActivation):
                posted.append((True, op.peer, state.outbox_act.pop(key)))
            elif isinstance(op, SendGrad):
                posted.append((True, op.peer, state.outbox_grad.pop(key)))
            elif isinstance(op, RecvActivation):
                state.received_act[key] = buffer = self._buffer()
                posted.append((False, op.peer, buffer))
            elif isinstance(op, RecvGrad):
                state.received_grad[key] = buffer = self._buffer()
                posted.append((False, op.peer, buffer))
            else:
                raise TypeError(f"unknown P2P op {op!r}")
        self.comm.exchange(posted)

    def _reduce_tied(self) -> None:
        self.comm.reduce_tied([self._grad_of(p) for p in self.stage.tied_parameters()])

    def train_step(
        self,
        optimizer: torch.optim.Optimizer,
        inputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        *,
        record: bool = False,
    ) -> PipelineStepResult:
        """Zero the gradients, run one step and apply ``optimizer`` at OptimizerStep."""
        optimizer.zero_grad(set_to_none=True)
        return self.run(inputs, targets, optimizer_step=optimizer.step, record=record)


def _dot_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """``param.grad``, zeros if it has none (a stage whose copy got no gradient still takes
    part in the tied-gradient sum)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad
