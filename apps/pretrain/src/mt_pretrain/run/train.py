"""The training loop: LR warmup + cosine, batch-size ramp-up, the engine's forward, backward
and step (:mod:`mt_pretrain.engines.base`), NaN detection, metrics, eval, checkpoints, early exits
and a clean stop on SIGTERM / SIGINT. It knows no engine by name.

Every rank runs the same loop; all decisions that change control flow (non-finite loss,
stop request) are taken from values that are identical on every rank (all-reduced), so no
rank leaves a collective behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mt_data import DPDataLoader
from mt_dist import ParallelGroups
from mt_dist.failpoints import failpoint
from mt_dist.stragglers import BusyClock, StragglerWatch, gather_busy
from mt_dist.trace import CollectiveTrace, summarize
from mt_model import model_flops_per_token_training
from mt_plan.memory import gather_memory
from mt_plan.mfu import measure_peak_flops, model_flops_utilization
from mt_pretrain.config.resolve import RunPlan, activation_shape
from mt_pretrain.config.schema import CheckpointArgs, LogArgs, TrainArgs
from mt_pretrain.engines.base import Engine
from mt_pretrain.run.evaluate import evaluate
from mt_zero import LRSchedule
from mt_zero.precision import compute_dtype

__all__ = ["NonFiniteLossError", "StepStats", "Trainer"]


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite (and no fp16 loss scaler could skip the step)."""


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did (one metrics line)."""

    step: int
    loss: float
    lr: float
    global_batch_size: int
    tokens: int
    tokens_per_s: float
    grad_norm: float
    step_time: float
    tflops_per_rank: float
    mfu: float
    skipped: bool
    loss_scale: float
    peak_mem_gib: float | None = None
    """Peak memory so far, max over ranks (GiB): allocated on CUDA, RSS on CPU."""
    peak_mem_gib_per_rank: list[float] | None = None
    """Each rank's ``peak_mem_gib``, in rank order."""
    peak_reserved_gib: float | None = None
    """CUDA only: peak reserved by the caching allocator, max over ranks (GiB)."""
    peak_reserved_gib_per_rank: list[float] | None = None
    """CUDA only: each rank's ``peak_reserved_gib``, in rank order."""
    mem_source: str | None = None
    """Where the memory figures come from: ``"cuda-allocator"`` or ``"rss"``."""
    val_loss: float | None = None
    val_ppl: float | None = None
    tasks: dict[str, float] | None = None
    """--eval-task metrics by ``TASK/METRIC`` (on the steps that score them)."""
    busy_s_per_rank: list[float] | None = None
    """Each rank's seconds of work in the step (forward, backward and optimizer step, less
    its waits for peers in data-parallel collectives), in rank order
    (:mod:`mt_dist.stragglers`)."""
    stragglers: list[int] | None = None
    """The ranks slower than their peers, on the steps where that set changed."""
    notes: tuple[str, ...] = ()
    """Lines to print with this step (not metrics): a straggler named, or recovered."""
    collectives: int | None = None
    """--trace-collectives: this rank's collectives in the step (forward, backward and
    optimizer step; rank 0's in the metrics, every rank's in OUT_DIR/collectives)."""
    comm_bytes: int | None = None
    """--trace-collectives: the bytes of those collectives (:mod:`mt_dist.trace`)."""
    comm_exposed_s: float | None = None
    """--trace-collectives: seconds this rank was blocked in them (exposed communication)."""
    comm_hidden_s: float | None = None
    """--trace-collectives: seconds they were in flight under other work (hidden)."""


class Trainer:
    """Runs the optimizer steps of one rank.

    Args:
        train, ckpt, log: the run's training, checkpoint and logging config sections.
        plan, groups, engine: the resolved plan, the process groups, and the engine running
            this rank's model stage and optimizer.
        loader: this DP rank's training loader (already at the resume position).
        valid: validation loader or None.
        on_step: called with every :class:`StepStats` (rank 0 writes metrics there); on
            validation steps they carry the validation loss and perplexity.
        should_stop: local stop request (e.g. a signal arrived); agreed on by all ranks.
        save: called with the step number to write a checkpoint and whether it may be
            written in the background; returns the seconds a whole save takes.
        score_tasks: scores the --eval-task tasks (collective), or None; called every
            ``train.eval_task_interval`` steps and after the last one.
        before_update: called before every optimizer step, the first moment the state
            changes (a background save's copies of it are waited for there).
        started: ``time.perf_counter()`` at the run's start (``--exit-duration`` counts from
            it; default: now).
    """

    def __init__(self, train: TrainArgs, ckpt: CheckpointArgs, log: LogArgs, plan: RunPlan,
                 groups: ParallelGroups, engine: Engine, loader: DPDataLoader,
                 valid: DPDataLoader | None,
                 on_step: Callable[[StepStats], None], should_stop: Callable[[], bool],
                 save: Callable[[int, bool], float], started: float | None = None,
                 score_tasks: Callable[[], dict[str, float]] | None = None,
                 before_update: Callable[[], None] = lambda: None) -> None:
        self.train, self.ckpt = train, ckpt
        self.score_tasks, self.before_update = score_tasks, before_update
        self.plan, self.groups, self.engine = plan, groups, engine
        self.loader, self.valid = loader, valid
        self.on_step, self.should_stop, self.save = on_step, should_stop, save
        minutes = train.exit_duration
        started = time.perf_counter() if started is None else started
        self._deadline = None if minutes is None else started + 60.0 * minutes
        self._longest_step = self._longest_save = 0.0
        gpt = plan.gpt
        self.lr = LRSchedule.create(train.lr, train.min_lr, train.warmup_tokens,
                                    train.decay_tokens, plan.train_samples * gpt.seq_len)
        self.dtype = compute_dtype(plan.layout.precision)
        self.device = groups.device
        self.activation_shape = activation_shape(plan)
        self._flops_per_token = model_flops_per_token_training(gpt)
        self._busy = BusyClock()
        self._watch = StragglerWatch(plan.topology.dp_groups(), log.straggler_steps,
                                     log.straggler_factor) if log.straggler_steps else None
        self._hosts: list[str] = []
        self._trace = CollectiveTrace(_group_names(groups)) if log.trace_collectives else None
        self._trace_path = Path(ckpt.out_dir) / "collectives" / f"rank-{groups.rank:05d}.jsonl"
        # MFU denominator: given, or probed once on rank 0 (the rank that reports it).
        peak = log.peak_tflops
        self._peak_flops = peak * 1e12 if peak is not None else (
            measure_peak_flops(self.dtype, self.device) if groups.rank == 0 else float("nan"))

    # ------------------------------------------------------------------------- the loop
    def run(self) -> tuple[list[StepStats], str | None]:
        """Train until ``plan.train_steps`` or an early exit, which saves a checkpoint first.

        Returns (stats, why the run stopped early: ``"signal"``, ``"exit-interval"``,
        ``"exit-duration"``, or None when it reached its last step).
        """
        with self._trace if self._trace is not None else contextlib.nullcontext():
            return self._run()

    def _run(self) -> tuple[list[StepStats], str | None]:
        stats: list[StepStats] = []
        interval, eval_interval = self.ckpt.save_interval, self.train.eval_interval
        while self.loader.state.step < self.plan.train_steps:
            failpoint("train.stall", self.groups.rank)
            record = self.step()
            step = record.step
            self._longest_step = max(self._longest_step, record.step_time)
            if self.valid is not None and eval_interval and step % eval_interval == 0:
                val_loss, val_ppl = self.evaluate()
                record = replace(record, val_loss=val_loss, val_ppl=val_ppl)
            every = self.train.eval_task_interval
            if self.score_tasks is not None and (
                    (every and step % every == 0) or step == self.plan.train_steps):
                record = replace(record, tasks=self.score_tasks())
            stats.append(record)
            self.on_step(record)
            reason = self._early_exit(step)
            if reason is not None:
                self._save(step)
                return stats, reason
            if interval and step % interval == 0 and step < self.plan.train_steps:
                self._save(step, background=True)
        return stats, None

    def _early_exit(self, step: int) -> str | None:
        """Why to stop after ``step`` (the same answer on every rank), or None."""
        late = self._deadline is not None and time.perf_counter() + self._longest_step + max(
            self._longest_save, self._longest_step) > self._deadline
        signal, late = self._agree(self.should_stop(), late)
        exit_interval = self.train.exit_interval
        if signal:
            return "signal"
        if late and step < self.plan.train_steps:
            return "exit-duration"
        if exit_interval and step % exit_interval == 0 and step < self.plan.train_steps:
            return "exit-interval"
        return None

    def _save(self, step: int, background: bool = False) -> None:
        self._longest_save = max(self._longest_save, self.save(step, background))

    def evaluate(self) -> tuple[float, float]:
        """Validation loss and perplexity (every rank gets the same numbers)."""
        assert self.valid is not None
        with self.engine.gathered():
            return evaluate(self.engine.stage, self.groups, self.valid, self.activation_shape,
                            self.dtype, self.device)

    def _agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag true on every rank if it is true on any rank (one all-reduce)."""
        value = torch.tensor([1.0 if f else 0.0 for f in flags], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return tuple(bool(v > 0) for v in value.tolist())

    # ------------------------------------------------------------------------ one step
    def step(self) -> StepStats:
        """One optimizer step over one global batch."""
        if self._trace is not None:
            self._trace.take()  # what ran between steps (saves, evaluation) is not the step's
        start = time.perf_counter()
        engine, seq = self.engine, self.plan.gpt.seq_len
        consumed = self.loader.state.consumed_samples
        global_batch = self.loader.schedule.batch_size(consumed)
        tokens = (consumed + global_batch) * seq
        lr = self.lr(tokens)
        engine.set_lr(lr)
        keys = self._micro_batch_keys(consumed, global_batch)
        self._busy.start()
        failpoint("train.slow", self.groups.rank)
        local_loss = engine.forward_backward(self.loader.next(), keys)
        self._busy.stop()
        loss = self._mean_over_dp(local_loss)
        if not math.isfinite(loss) and not engine.skips_nonfinite:
            raise NonFiniteLossError(
                f"loss is {loss} at step {self.loader.state.step} (lr {lr:.3g}, tokens "
                f"{tokens:,}); stopping (only fp16 loss scaling skips such steps). Lower "
                "--lr or set --clip-grad, then resume from the last checkpoint")
        self._busy.start()
        self.before_update()  # a background save's copies of the state done
        result = engine.step()
        self._busy.stop()
        elapsed = time.perf_counter() - start
        traced = self._traced_step() if self._trace is not None else {}
        # After the timing: all-gathers of 4 numbers per rank, outside the step's time.
        memory = gather_memory(self.device).metrics()
        busy = gather_busy(self._busy.take(), self.device)
        tokens_per_s = global_batch * seq / elapsed
        world = self.plan.topology.world_size
        flops_per_rank = self._flops_per_token * tokens_per_s / world
        return StepStats(
            step=self.loader.state.step, loss=loss, lr=lr, global_batch_size=global_batch,
            tokens=tokens, tokens_per_s=tokens_per_s, grad_norm=result.grad_norm,
            step_time=elapsed,
            tflops_per_rank=flops_per_rank / 1e12,
            mfu=model_flops_utilization(flops_per_rank, self._peak_flops),
            skipped=result.skipped, loss_scale=result.loss_scale, **memory,
            busy_s_per_rank=[round(b, 6) for b in busy], **self._stragglers(busy), **traced)

    def _traced_step(self) -> dict[str, Any]:
        """The step's collectives: summed for the metrics, each one in this rank's file."""
        assert self._trace is not None
        records = self._trace.take()
        summary = summarize(records)
        line = {"step": self.loader.state.step, **summary, "records": [
            [r.kind, r.group, r.bytes, round(r.launched_s, 6), round(r.blocked_s, 6),
             round(r.in_flight_s, 6)] for r in records]}
        self._trace_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._trace_path, "a") as out:
            out.write(json.dumps(line) + "\n")
        return {k: summary[k] for k in ("collectives", "comm_bytes", "comm_exposed_s",
                                        "comm_hidden_s")}

    def _stragglers(self, busy: list[float]) -> dict[str, Any]:
        """The ranks named slow or recovered at this step (the same on every rank: each
        has the whole table): ``stragglers`` and the lines saying so, or nothing."""
        if self._watch is None:
            return {}
        new, recovered = self._watch.add(busy)
        if not (new or recovered):
            return {}
        if not self._hosts:  # a collective, reached by every rank at the same step
            self._hosts = [""] * self.plan.topology.world_size
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_gather_object(self._hosts, socket.gethostname())
        notes = [s.line(self._hosts[s.rank]) for s in new]
        notes += [f"rank {r} is no longer a straggler" for r in recovered]
        return {"stragglers": sorted(self._watch.slow), "notes": tuple(notes)}

    def _micro_batch_keys(self, consumed: int, global_batch: int) -> list[int] | None:
        """The dropout key of each of this rank's micro-batches: the run-wide index of its
        first sample, which no layout changes (None without keyed dropout)."""
        if not self.engine.keyed_dropout:
            return None
        return [int(k) for k in self.loader.rank_indices(consumed, global_batch)[:, 0]]

    def _mean_over_dp(self, local: float) -> float:
        # Over data and context parallelism: each context-parallel rank's loss is the mean
        # over its slice of the same sequences.
        value = torch.tensor([local], dtype=torch.float64, device=self.device)
        if self.groups.grad_size > 1:
            dist.all_reduce(value, group=self.groups.grad_group)
            value /= self.groups.grad_size
        return float(value)


def _group_names(groups: ParallelGroups) -> dict[Any, str]:
    """What the trace calls this rank's groups (the first name of a group that is several)."""
    named = [("tp", groups.tp), ("cp", groups.cp), ("dp", groups.dp), ("dp_cp", groups.dp_cp),
             ("pp", groups.pp), ("embedding", groups.embedding),
             ("model_parallel", groups.model_parallel)]
    names: dict[Any, str] = {}
    for name, group in named:
        if group is not None and group not in names:
            names[group] = name
    return names


def stats_dict(stats: StepStats) -> dict[str, Any]:
    """The metrics line of a step (validation and task keys only on the steps that have
    them; task metrics as ``eval/TASK/METRIC``)."""
    line = {k: v for k, v in asdict(stats).items()
            if v is not None and k not in ("tasks", "notes")}
    line.update({f"eval/{key}": value for key, value in (stats.tasks or {}).items()})
    return line
