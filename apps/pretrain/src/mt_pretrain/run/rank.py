"""One rank of `mt pretrain`, from an initialized launch to the summary of the run.

launcher info -> process group -> plan -> groups -> model shard + optimizer -> data ->
(resume) -> training loop -> final checkpoint -> sample.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mt_checkpoint import fresh_start
from mt_data import DataLoaderState
from mt_dist import (
    LaunchInfo,
    ParallelGroups,
    build_groups,
    finalize_distributed,
    init_distributed,
    local_device,
)
from mt_dist.launcher import lost_peer
from mt_dist.restarts import Restart, agreed_restart
from mt_model import count_parameters
from mt_plan.memory import MemoryPeaks, device_memory, gather_memory, map_large_blocks
from mt_pretrain.config.refusals import engine_of
from mt_pretrain.config.resolve import RunPlan, check_memory, fullest_stage_memory, resolve
from mt_pretrain.config.schema import ConfigError, PretrainConfig, TrainArgs
from mt_pretrain.data.inputs import (
    batch_change_note,
    check_load_tokenizer,
    ensure_data,
    make_loaders,
    tokenizer_for,
)
from mt_pretrain.engines.base import Engine
from mt_pretrain.run.folder import claim_run_folder, run_folder_lock
from mt_pretrain.run.metrics import MetricsWriter, WandbTarget
from mt_pretrain.run.progress import Reporter
from mt_pretrain.run.sample import (
    MAX_SAMPLE_PARAMETERS,
    gather_model,
    gather_weights,
    greedy_generate,
)
from mt_pretrain.run.tasks import task_scorer
from mt_pretrain.run.train import StepStats, Trainer, stats_dict

__all__ = ["RankOutOfMemory", "RunSummary", "make_engine", "run_rank"]


class RankOutOfMemory(OSError):
    """A rank's allocation failed (torch's CPU or CUDA allocator, or Python's): the run
    failed for want of memory (exit 1, as any ENOMEM), said in one line naming the rank and
    the bytes asked for."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOMEM


@dataclass
class RunSummary:
    """What rank 0 reports at the end of a run.

    ``records`` holds every step's metrics line (loss, grad_norm, lr, ...); ``weights``, when
    the launch asked for them, every fp32 master weight at full shape after the last step.
    """

    losses: list[float] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    weights: dict[str, torch.Tensor] | None = None
    start_step: int = 0
    final_step: int = 0
    tokens: int = 0
    """The tokens this run trained on (its steps; a resumed run's checkpoint's not counted)."""
    tokens_per_s: float = 0.0
    wall_time: float = 0.0
    val_loss: float | None = None
    checkpoint: str | None = None
    sample: str | None = None
    stopped: str | None = None
    """Why the run stopped before its last step: "signal", "exit-interval", "exit-duration"."""
    memory: MemoryPeaks | None = None
    """Every rank's peak memory at the end of the run (after the last checkpoint and sample)."""
    planned_memory: float | None = None
    """The planner's bytes per rank of the fullest pipeline stage (``planned_stage``)."""
    planned_stage: int | None = None
    restarts: int = 0
    """Restarts before this run (the summary covers the steps since the last one)."""


class StopFlag:
    """Set by SIGTERM / SIGINT; the training loop saves and stops at the next step end."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self) -> bool:
        return self.requested


#: Seconds within which a further SIGINT / SIGTERM is the same interrupt, echoed: a launcher
#: (torchrun, srun) forwards the terminal's Ctrl-C to ranks that got it from the terminal too.
ECHO_S = 1.0


@contextmanager
def _stop_on_signals(flag: StopFlag) -> Iterator[None]:
    first: list[float] = []

    def handler(signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if not first:
            first.append(now)
            flag.requested = True
        elif now - first[0] > ECHO_S:  # a second interrupt: stop now, without the checkpoint
            raise KeyboardInterrupt(f"signal {signum} received twice")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with _stop_native_code_at_the_second_signal():
            yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


#: Seconds the main thread has to act on a second interrupt before the process stops anyway.
NATIVE_GRACE_S = 3.0


@contextmanager
def _stop_native_code_at_the_second_signal() -> Iterator[None]:
    """Python runs a signal handler only between bytecodes: during one long native op (the
    attention of a long sequence: minutes) the handler above waits, and so would a second
    Ctrl-C. The C-level handler still writes each signal's number to a wake-up socket; a
    thread reading it ends the process (exit 130) when a second interrupt, past the echo
    window, is not acted on within NATIVE_GRACE_S."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        first = None
        while data := reader.recv(1):
            if data[0] not in (signal.SIGTERM, signal.SIGINT):
                continue
            now = time.monotonic()
            if first is None:
                first = now
            elif now - first > ECHO_S:
                time.sleep(NATIVE_GRACE_S)  # the main thread, if free, has exited by now
                print(f"interrupted twice (signal {data[0]}) inside a long operation: "
                      "stopped at once; the last complete checkpoint stays",
                      file=sys.stderr, flush=True)
                os._exit(130)

    thread = threading.Thread(target=watch, name="mt-second-signal", daemon=True)
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        writer.close()  # the thread's recv returns b"": it ends
        thread.join(timeout=1.0)
        reader.close()


def run_rank(config: PretrainConfig, info: LaunchInfo, cache_dir: Path,
             keep_weights: bool = False, restart: Restart | None = None) -> RunSummary | None:
    """Train as rank ``info.rank``; returns the summary on rank 0, None elsewhere (with the
    final full weights in it when ``keep_weights``). ``restart``: this run continues one
    that failed (said in one line, and in the first metrics record)."""
    if config.log.level == "error":  # --log-level error: errors only
        warnings.simplefilter("ignore")
    use_cuda = {"auto": None, "cpu": False, "cuda": True}[config.parallel.device]
    device = local_device(info, use_cuda=use_cuda)
    if device.type == "cuda" and info.local_rank >= torch.cuda.device_count():
        raise ConfigError(f"local rank {info.local_rank} needs GPU {info.local_rank} but this "
                          f"node has {torch.cuda.device_count()}; use --device cpu or fewer "
                          "processes per node")
    if device.type == "cpu":  # freed activations leave the RSS (mt_plan.memory)
        map_large_blocks(os.environ)
    init_distributed(info, device, timeout=config.parallel.timeout)
    completed = False
    try:
        agreed = agreed_restart(restart, info.launcher, device)
        ckpt = config.checkpoint
        if agreed is not restart and ckpt.load is None and ckpt.save_dir is not None:
            # a rank of an agent that joined an elastic job later: it continues the run too
            config, restart = replace(config, checkpoint=ckpt.resuming_own()), agreed
        plan = resolve(config, info.world_size)
        check_memory(plan, device, info.local_world_size)
        check_load_tokenizer(config, plan.gpt.vocab_size)
        groups = build_groups(plan.topology, device, timeout=config.parallel.timeout)
        with ExitStack() as held:
            _claim_run_folder(config, groups, held)
            flag = StopFlag()
            with _stop_on_signals(flag):
                try:
                    summary = _train(config, plan, groups, device, cache_dir, flag,
                                     info.launcher, keep_weights, restart)
                except (MemoryError, RuntimeError) as err:
                    if (line := _out_of_memory(err, info, device, plan)) is None:
                        raise
                    raise RankOutOfMemory(line) from None
        completed = True
        return summary
    except RuntimeError as err:
        # Under a launcher a rank's error is the command's own: a lost peer in one line. In a
        # --nproc run the supervisor names the rank that failed first, from every traceback.
        if info.launcher == "single" or (lost := lost_peer(err, info)) is None:
            raise
        raise lost from None
    finally:
        finalize_distributed(completed=completed)


#: The bytes a failed allocation asked for, in torch's CPU and CUDA messages.
_ASKED = (re.compile(r"you tried to allocate (\d+) bytes"),
          re.compile(r"Tried to allocate (\d+(?:\.\d+)? [KMGTP]?i?B)"))


def _out_of_memory(err: BaseException, info: LaunchInfo, device: torch.device,
                   plan: RunPlan) -> str | None:
    """One line for a failed allocation (``err``: torch's CPU allocator, a CUDA out of memory
    error, a MemoryError): the rank, the bytes asked for, the plan's estimate and this
    machine's memory; None for any other error."""
    text = str(err)
    if not (isinstance(err, (MemoryError, torch.cuda.OutOfMemoryError))
            or "DefaultCPUAllocator: can't allocate memory" in text):
        return None
    asked = next((m.group(1) for m in (p.search(text) for p in _ASKED) if m), None)
    if asked is not None and asked.isdigit():
        asked = f"{int(asked) / 2**30:,.3f} GiB"
    stage, estimate = fullest_stage_memory(plan, device.type)
    memory = device_memory(device)
    shared = f", {info.local_world_size} ranks" if device.type == "cpu" and \
        info.local_world_size > 1 else ""
    return (f"rank {info.rank} of {info.world_size} ran out of memory on {device}: an "
            f"allocation of {asked or 'unknown size'} failed (the plan: "
            f"~{estimate['total'] / 2**30:,.3f} GiB per rank, stage {stage}; "
            f"{memory[1] if memory else 'memory unknown'}{shared}); free memory for the run, "
            "or use a smaller --seq-len, --micro-batch-size or model, recomputation, or more "
            "machines")


def _claim_run_folder(config: PretrainConfig, groups: ParallelGroups,
                      held: ExitStack) -> None:
    """Rank 0 locks the run folder for the run (``held`` keeps the lock), then checks (and
    with --overwrite clears) it; every rank gets its verdict, so all fail alike."""
    ckpt = config.checkpoint
    verdict: list[str | None] = [None]
    if groups.rank == 0:
        try:
            # The checkpoint folder is what two jobs of one run would fight over (its
            # --out-dir may be shared by runs that save elsewhere).
            held.enter_context(run_folder_lock(ckpt.save_dir or ckpt.out_dir))
            claim_run_folder(ckpt, config.metrics_path)
        except ConfigError as err:
            verdict[0] = str(err)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ConfigError(verdict[0])


def _train(config: PretrainConfig, plan: RunPlan, groups: ParallelGroups, device: torch.device,
           cache_dir: Path, flag: StopFlag, launcher: str, keep_weights: bool,
           restart: Restart | None) -> RunSummary | None:
    started, rank0, ckpt, log = time.perf_counter(), groups.rank == 0, config.checkpoint, config.log
    engine = make_engine(config, plan, groups, device)
    paths = ensure_data(config.data, plan.gpt.vocab_size, cache_dir)
    start_step, state = 0, DataLoaderState()
    resuming = ckpt.load is not None and not fresh_start(ckpt.load, ckpt.save_dir)
    if resuming:
        start_step, state = engine.load(ckpt.load)
    loader, valid = make_loaders(config.data, config.train, plan, paths, groups.dp_rank, state)
    debug = log.says("debug")
    reporter = Reporter(plan.train_steps, start_step, rank0 and log.says("info"),
                        log.progress and not debug, 1 if debug else log.log_interval)
    _announce(config, plan, groups, device, launcher, reporter, start_step, resuming, restart)
    metrics = _metrics_writer(config, start_step, reporter) if rank0 else None
    summary = RunSummary(start_step=start_step, final_step=start_step,
                         restarts=restart.count if restart else 0)
    saver = engine.saver(ckpt.save_dir, ckpt.keep_last) if ckpt.save_dir is not None else None
    restarted = {"restart": restart.count, "restart_cause": restart.cause,
                 "restart_world_size": plan.topology.world_size} if restart else {}

    def on_step(stats: StepStats) -> None:
        summary.losses.append(stats.loss)
        summary.records.append({**stats_dict(stats), **restarted})
        restarted.clear()  # the first record after a restart says so
        if metrics is not None:
            metrics.write(summary.records[-1])
        reporter.step(stats)
        for note in stats.notes if rank0 and log.says("warning") else ():  # a warning
            if reporter.enabled:
                reporter.print(note)  # above the bar
            else:
                print(note, flush=True)
        if stats.tasks:
            reporter.print(f"step {stats.step}: " + ", ".join(
                f"{key} {value:.4g}" for key, value in stats.tasks.items()))
        if stats.val_loss is not None:
            summary.val_loss = stats.val_loss
            reporter.print(f"step {stats.step}: validation loss {stats.val_loss:.4f}, "
                           f"perplexity {stats.val_ppl:.2f}")

    def save(step: int, background: bool = False) -> float:
        """Save ``step`` (in the background if asked and --async-save); the seconds a whole
        save takes (for --exit-duration: the longest background write counts)."""
        if saver is None:
            return 0.0
        began, background = time.perf_counter(), background and ckpt.async_save
        saver.save(step, loader.state, background)
        reporter.print(f"saving checkpoint {saver.last_saved} in the background" if background
                       else f"saved checkpoint {saver.last_saved}")
        return max(time.perf_counter() - began, saver.longest_write)

    score_tasks = None
    if config.train.eval_tasks:
        score_tasks = task_scorer(config.train, plan, groups, engine, tokenizer_for(paths))
    trainer = Trainer(config.train, ckpt, config.log, plan, groups, engine, loader, valid,
                      on_step, flag, save, started, score_tasks,
                      saver.settle if saver is not None else lambda: None)
    try:
        stats, stopped = trainer.run()
    finally:
        reporter.close()
        if metrics is not None:
            metrics.close()
    if saver is not None:
        saver.wait()  # the last background save published (or its error raised)
    summary.final_step, summary.stopped = loader.state.step, stopped
    if saver is not None and stats and not stopped and saver.last_step != loader.state.step:
        save(loader.state.step)
    if saver is not None:
        saver.close()  # the writer process of --async-save ended
    if keep_weights:
        summary.weights = gather_weights(engine.full_parameters(), engine.built.styles, groups,
                                         plan.model)
    if stopped:
        reporter.print(_stopped_line(stopped, loader.state.step, ckpt.save_dir, saver))
    elif config.train.sample_tokens and count_parameters(plan.model) <= MAX_SAMPLE_PARAMETERS:
        summary.sample = _sample(config.train, engine, groups, plan, paths)
    memory = gather_memory(device)  # collective: every rank, after everything above
    if not rank0:
        return None
    summary.memory = memory
    summary.checkpoint = str(saver.last_saved) if saver and saver.last_saved else None
    _totals(summary, plan, stats, started, device)
    return summary


def _metrics_writer(config: PretrainConfig, start_step: int,
                    reporter: Reporter) -> MetricsWriter:
    """Rank 0's metrics: the JSONL file, TensorBoard and W&B as the flags ask."""
    log, out = config.log, Path(config.checkpoint.out_dir)
    wandb = WandbTarget(log.wandb_project, log.wandb_name or out.resolve().name, out,
                        asdict(config)) if log.wandb_project else None
    metrics = MetricsWriter(config.metrics_path, out / "tensorboard" if log.tensorboard
                            else None, start_step, wandb)
    if metrics.wandb_line:
        reporter.print(metrics.wandb_line)
    return metrics


def _stopped_line(stopped: str, step: int, save_dir: Path | None, saver: Any) -> str:
    if stopped == "signal":
        return f"stopped by signal after step {step}"
    resume = f"; continue with --load {save_dir}" if saver is not None else ""
    return f"exiting after step {step} (--{stopped}){resume}"


def _announce(config: PretrainConfig, plan: RunPlan, groups: ParallelGroups,
              device: torch.device, launcher: str, reporter: Reporter, start_step: int,
              resuming: bool, restart: Restart | None) -> None:
    """The start-up lines: where each rank sits (``--log-level debug``), which launcher
    placed the ranks, where training resumes and whether anything is left to train."""
    ckpt, rank0 = config.checkpoint, groups.rank == 0
    debug = config.log.says("debug")
    topo = plan.topology
    if debug:  # every rank: where it sits (printed as the ranks reach this point)
        coords = groups.coord
        print(f"rank {groups.rank}: tp {coords.tp} pp {coords.pp} dp {coords.dp}, "
              f"{device}, pid {os.getpid()}", flush=True)
    if rank0:  # which launcher placed the ranks ("single": this command's --nproc)
        source = "--nproc" if launcher == "single" else launcher
        reporter.print(f"{topo.world_size} ranks from {source}: {topo.describe()} on "
                       f"{device.type}")
    resumed = (f"resumed from {ckpt.load} at step {start_step}" if start_step else
               f"no checkpoint in {ckpt.load} yet: starting at step 0"
               if ckpt.load and not resuming else None)
    if resumed and (change := batch_change_note(config, plan)):
        resumed += f" ({change})"
    if rank0 and restart is not None and config.log.says("warning"):
        print(restart.line(resumed or "starting at step 0"), flush=True)
    elif rank0 and resumed:
        reporter.print(resumed)
    if rank0 and start_step >= plan.train_steps and config.log.says("warning"):
        # A warning's weight: shown unless --log-level error.
        print(f"nothing to train: {ckpt.load} is at step {start_step}, the run ends at step "
              f"{plan.train_steps} (raise --train-steps / --train-tokens to train on)",
              flush=True)


def _totals(summary: RunSummary, plan: RunPlan, stats: list[StepStats], started: float,
            device: torch.device) -> None:
    """Rank 0's run totals: tokens, throughput, wall time, planned memory."""
    summary.tokens = sum(s.global_batch_size for s in stats) * plan.gpt.seq_len  # this run's
    timed = stats[1:] or stats
    if timed:
        summary.tokens_per_s = sum(s.global_batch_size * plan.gpt.seq_len for s in timed) / \
            sum(s.step_time for s in timed)
    summary.wall_time = time.perf_counter() - started
    summary.planned_stage, planned = fullest_stage_memory(plan, device.type)
    summary.planned_memory = planned["total"]


def make_engine(config: PretrainConfig, plan: RunPlan, groups: ParallelGroups,
                device: torch.device) -> Engine:
    """The engine ``--engine`` names (its registry entry), built for this rank."""
    return engine_of(config).load().create(config, plan, groups, device)


def _sample(train: TrainArgs, engine: Engine, groups: ParallelGroups, plan: RunPlan,
            paths: list[Path]) -> str | None:
    """Greedy continuation of the prompt on rank 0 (collective gather first)."""
    model = gather_model(engine.full_parameters(), engine.built.styles, groups, plan.model)
    if model is None:
        return None
    tokenizer = tokenizer_for(paths)
    ids = tokenizer.encode(train.prompt)
    out = greedy_generate(model, ids, train.sample_tokens)
    return tokenizer.decode(out)
