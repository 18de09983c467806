"""Pipeline benchmark on 2 CPU processes: mt_pipeline's executor against its peers.

1. Bubble: mt's executor runs GPipe, 1F1B and interleaved 1F1B (v=2) with a timestamp per
   instruction; the measured bubble of each stage, (flush - start - busy) / busy with busy
   = that stage's forward + backward time, is printed next to the theory ((p-1)/m,
   (p-1)/(v*m)) and next to the simulator fed with the measured forward / backward times.
2. Throughput (tokens/s) of one training step (forward, backward, tied-gradient sum, AdamW)
   on the same GPT and the same batch: mt_pipeline 1F1B, DeepSpeed's PipelineModule (a
   pinned peer, benchmarks/requirements.txt: missing, it is an error unless
   ``--no-deepspeed``) and torch.distributed.pipelining's Schedule1F1B. All three
   start from the same weights; their first-step losses are printed to show it. Rounds
   alternate between frameworks so that background load hits all of them alike.

Run: ``python3 benchmarks/pp.py [--trace DIR]`` (it relaunches itself under torchrun with
2 processes; needs mt-dist, mt-model and mt-pipeline importable, e.g. via PYTHONPATH).
DeepSpeed starts without its shm inference allreduce op (nothing is JIT-built). Wall-clock
numbers on a shared machine are noisy: compare the CPU seconds too.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mt_dist import Topology, build_groups, discover, init_distributed
from mt_model import GPT, Block, Embedding, GPTConfig
from mt_pipeline import (
    Backward,
    Forward,
    PipelineConfig,
    PipelineExecutor,
    StageComm,
    build_stage,
    measured_timeline,
    plan_pipeline,
    simulate,
    write_chrome_trace,
    write_png,
)

WORLD = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per turn")
    parser.add_argument("--rounds", type=int, default=8, help="turns of every framework")
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--dump", action="store_true", help="print every step time")
    parser.add_argument("--trace", default="", help="directory for measured Chrome traces "
                        "(+ PNG with matplotlib) of the fastest recorded step per schedule")
    return parser.parse_args()


def make_batch(config: GPTConfig, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------- mt_pipeline
class MtRunner:
    def __init__(self, model: GPT, args: argparse.Namespace, schedule: str, v: int = 1) -> None:
        groups = build_groups(Topology(pp=WORLD))
        self.comm = StageComm.from_groups(groups)
        self.config = PipelineConfig(schedule, args.micro_batches, v)
        plan = plan_pipeline(self.config, args.layers, WORLD)
        self.stage = build_stage(copy.deepcopy(model), plan.stages[self.comm.stage])
        shape = (args.batch // args.micro_batches, args.seq, args.hidden)
        self.executor = PipelineExecutor(self.stage, self.config, self.comm, shape)
        self.optimizer = torch.optim.AdamW(self.stage.parameters(), lr=1e-4)

    def step(self, idx: torch.Tensor, targets: torch.Tensor, record: bool = False) -> Any:
        return self.executor.train_step(
            self.optimizer, idx if self.comm.is_first else None,
            targets if self.comm.is_last else None, record=record)


# ---------------------------------------------------------------- torch.distributed.pipelining
class _PiPPyStage(nn.Module):
    """Stage 0: embed + first half of the blocks; stage 1: the rest, ln_f and the tied head
    with its own copy of the token embedding."""

    def __init__(self, model: GPT, rank: int) -> None:
        super().__init__()
        half = len(model.blocks) // 2
        self.rank = rank
        self.embed = model.embed if rank == 0 else None
        self.blocks = nn.ModuleList(model.blocks[:half] if rank == 0 else model.blocks[half:])
        self.ln_f = model.ln_f if rank == 1 else None
        self.tokens = model.embed.tokens if rank == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None:
            x = F.linear(self.ln_f(x), self.tokens.weight)
        return x


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class PiPPyRunner:
    def __init__(self, model: GPT, args: argparse.Namespace) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.rank = dist.get_rank()
        self.module = _PiPPyStage(copy.deepcopy(model), self.rank)
        stage = PipelineStage(self.module, self.rank, WORLD, torch.device("cpu"))
        self.schedule = Schedule1F1B(stage, args.micro_batches, loss_fn=_ce)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.tied = (self.module.embed.tokens.weight if self.rank == 0
                     else self.module.tokens.weight)

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(idx)
        else:
            self.schedule.step(target=targets, losses=losses)
        # Tied embedding: sum the two copies' gradients, as the other two frameworks do.
        dist.all_reduce(self.tied.grad)
        self.optimizer.step()
        return float(torch.stack(losses).mean().detach()) if losses else float("nan")


# ---------------------------------------------------------------- DeepSpeed PipelineModule
def _ds_head(module: Embedding, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.tokens.weight)


class DeepSpeedRunner:
    def __init__(self, model: GPT, args: argparse.Namespace) -> None:
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

        from mt_zero.deepspeed_engine import init_deepspeed_distributed

        init_deepspeed_distributed(deepspeed, "gloo")  # wraps the existing process group
        cfg = model.config
        layers = [TiedLayerSpec("embed", Embedding, cfg, tied_weight_attr="tokens.weight")]
        layers += [LayerSpec(Block, cfg) for _ in range(cfg.n_layers)]
        layers += [LayerSpec(nn.LayerNorm, cfg.hidden, eps=cfg.layernorm_eps),
                   TiedLayerSpec("embed", Embedding, cfg, forward_fn=_ds_head,
                                 tied_weight_attr="tokens.weight")]
        pipe = PipelineModule(layers, num_stages=WORLD, loss_fn=_ce,
                              partition_method="type:Block")
        _load_gpt_weights(pipe, model)
        ds_config = {
            "train_batch_size": args.batch,
            "train_micro_batch_size_per_gpu": args.batch // args.micro_batches,
            "gradient_accumulation_steps": args.micro_batches,
            "steps_per_print": 10**9,
            "zero_optimization": {"stage": 0},
        }
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        self.engine, *_ = deepspeed.initialize(model=pipe, optimizer=optimizer,
                                               config=ds_config)
        self.m = args.micro_batches

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        micro = list(zip(idx.chunk(self.m), targets.chunk(self.m)))
        loss = self.engine.train_batch(data_iter=iter(micro))
        return float(loss)


def _load_gpt_weights(pipe: nn.Module, model: GPT) -> None:
    """Copy the GPT's weights into DeepSpeed's layer numbering (0 embed, 1..L blocks,
    L+1 ln_f, L+2 tied head)."""
    full = model.state_dict()
    n = model.config.n_layers
    with torch.no_grad():
        for name, param in pipe.named_parameters():
            if name.startswith("tied_modules.embed."):
                source = "embed." + name[len("tied_modules.embed."):]
            else:
                index, rest = name.split(".", 1)
                index = int(index)
                source = f"blocks.{index - 1}.{rest}" if index <= n else f"ln_f.{rest}"
            param.copy_(full[source])


# ---------------------------------------------------------------- measurements
def _timed(step: Callable[[], Any]) -> tuple[float, float]:
    """Wall seconds of one step between barriers, and the CPU seconds both ranks spent in it
    (all threads; less sensitive than wall time to other processes on a shared machine)."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    step()
    cpu = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.barrier()
    wall = time.perf_counter() - start
    dist.all_reduce(cpu)
    return wall, cpu.item()


def measure_bubble(model: GPT, args: argparse.Namespace, schedule: str, v: int) -> dict:
    """Bubble of mt's executor from its own timestamps, per stage, over ``args.rounds`` steps."""
    runner = MtRunner(model, args, schedule, v)
    idx, targets = make_batch(model.config, args.batch, 0)
    runner.step(idx, targets)  # warm-up
    timelines = []
    for _ in range(args.rounds):
        dist.barrier()
        events = runner.step(idx, targets, record=True).events
        everyone: list[Any] = [None] * WORLD
        dist.all_gather_object(everyone, events)
        timelines.append(measured_timeline(everyone, v, args.micro_batches))
    measured = [[t.bubble_fraction[s] for t in timelines] for s in range(WORLD)]
    f_mean, b_mean = [], []
    for s in range(WORLD):
        spans = [e for t in timelines for e in t.events[s]]
        f_mean.append(statistics.mean(e.duration for e in spans
                                      if isinstance(e.instruction, Forward)))
        b_mean.append(statistics.mean(e.duration for e in spans
                                      if isinstance(e.instruction, Backward)))
    sim = simulate(runner.config.schedule_for(WORLD), forward_time=f_mean, backward_time=b_mean)
    if args.trace and dist.get_rank() == 0:
        best = min(timelines, key=lambda t: t.pipeline_time)
        name = f"{args.trace}/measured_{schedule}" + (f"_v{v}" if v > 1 else "")
        write_chrome_trace(best, name + ".json", us_per_unit=1e6)
        try:
            write_png(best, name + ".png", title=f"measured {schedule}")
        except ImportError:
            pass
    return {"schedule": schedule, "v": v, "theory": (WORLD - 1) / (v * args.micro_batches),
            "measured_mean": [statistics.mean(x) for x in measured],
            "measured_min": [min(x) for x in measured],
            "simulated": list(sim.bubble_fraction), "forward_s": f_mean, "backward_s": b_mean}


def measure_throughput(model: GPT, args: argparse.Namespace) -> dict[str, Any]:
    runners: dict[str, Any] = {"mt_pipeline 1F1B": MtRunner(model, args, "1f1b")}
    if not args.no_deepspeed:  # DeepSpeed is pinned (infra/python/constraints.txt): never skipped
        runners["DeepSpeed PipelineModule"] = DeepSpeedRunner(model, args)
    runners["torch.distributed.pipelining Schedule1F1B"] = PiPPyRunner(model, args)
    runners["mt_pipeline interleaved v=2"] = MtRunner(model, args, "interleaved", 2)
    idx, targets = make_batch(model.config, args.batch, 0)
    first_loss = {}
    for name, runner in runners.items():  # warm-up; first step from identical weights
        result = runner.step(idx, targets)
        loss = torch.tensor([getattr(result, "loss", result)])
        if dist.get_rank() != WORLD - 1:
            loss.fill_(0.0)
        dist.all_reduce(loss)  # the last stage knows the loss in all three frameworks
        first_loss[name] = loss.item()
        runner.step(idx, targets)
    # Frameworks take turns step by step, so background load hits them alike; the median
    # step time is robust to the bursts of other processes on a shared machine.
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for round_index in range(args.rounds):
        # Rotate who goes first, so no framework always follows the same one.
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            runner = runners[name]
            for _ in range(args.steps):
                wall, cpu_s = _timed(lambda r=runner: r.step(idx, targets))
                seconds[name].append(wall)
                cpu[name].append(cpu_s)
    tokens = args.batch * args.seq
    return {"tokens_per_s": {n: tokens / statistics.median(s) for n, s in seconds.items()},
            "mean_tokens_per_s": {n: tokens / statistics.mean(s) for n, s in seconds.items()},
            "cpu_s": {n: statistics.median(c) for n, c in cpu.items()},
            "wall_s": seconds,
            "first_loss": first_loss}


def report(bubbles: list[dict], throughput: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nGPT {args.layers} layers, hidden {args.hidden}, heads {args.heads}, vocab "
          f"{args.vocab}, seq {args.seq}; batch {args.batch} = {args.micro_batches} micro-"
          f"batches of {args.batch // args.micro_batches}; {WORLD} stages, 1 thread each")
    print("\nbubble (idle until flush / forward+backward time), per stage:")
    print(f"  {'schedule':16s} theory | simulated, measured F/B | measured mean | measured min"
          " | mean F, B per chunk (ms)")
    for b in bubbles:
        name = b["schedule"] + (f" v={b['v']}" if b["v"] > 1 else "")

        def fmt(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
            return ", ".join(f"{x * scale:.{digits}f}" for x in values)

        print(f"  {name:16s} {b['theory']:.3f}  | {fmt(b['simulated']):24s} | "
              f"{fmt(b['measured_mean']):13s} | {fmt(b['measured_min']):12s} | "
              f"{fmt(b['forward_s'], 1e3, 1)}; {fmt(b['backward_s'], 1e3, 1)}")
    rates, means = throughput["tokens_per_s"], throughput["mean_tokens_per_s"]
    best = {n: args.batch * args.seq / min(s) for n, s in throughput["wall_s"].items()}
    key = "mt_pipeline 1F1B"
    print(f"\nthroughput (tokens/s of a training step: forward, backward, tied-gradient sum, "
          f"AdamW) from the best | median | mean of {args.rounds * args.steps} step times; "
          "ratio = mt 1F1B / this (best, median)")
    print(f"  {'':42s} {'best':>7s} {'median':>7s} {'mean':>7s}  {'ratio':>11s}  "
          "CPU s/step (2 ranks)  first-step loss")
    for name, rate in rates.items():
        print(f"  {name:42s} {best[name]:7.1f} {rate:7.1f} {means[name]:7.1f}  "
              f"{best[key] / best[name]:.3f}, {rates[key] / rate:.3f}  "
              f"{throughput['cpu_s'][name]:12.3f}{'':8s} {throughput['first_loss'][name]:.6f}")
        if args.dump:
            print("    step s:", " ".join(f"{x:.3f}" for x in throughput["wall_s"][name]))


def worker(args: argparse.Namespace) -> None:
    # DeepSpeed's pipeline P2P backpropagates through c10d::broadcast_ and warns every step.
    warnings.filterwarnings("ignore", message="c10d::broadcast_")
    torch.set_num_threads(1)
    init_distributed(discover(os.environ), torch.device("cpu"))
    config = GPTConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads,
                       vocab_size=args.vocab, seq_len=args.seq)
    model = GPT(config, seed=0)
    bubbles = [measure_bubble(model, args, "gpipe", 1), measure_bubble(model, args, "1f1b", 1),
               measure_bubble(model, args, "interleaved", 2)]
    throughput = measure_throughput(model, args)
    if dist.get_rank() == 0:
        report(bubbles, throughput, args)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        # Relaunch under torchrun: it sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* (which
        # DeepSpeed also reads) and OMP_NUM_THREADS=1.
        env = dict(os.environ, DS_ACCELERATOR="cpu")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={WORLD}", __file__, *sys.argv[1:]]
        raise SystemExit(subprocess.call(command, env=env))
    worker(args)


if __name__ == "__main__":
    main()
