"""Throughput and peak memory per rank of data-parallel training with ZeRO stages 0-3:
mt's ZeroOptimizer against DeepSpeed's ZeRO of the same stage, on 2 gloo processes, same
GPT (mt_model), same batches, same torch AdamW (weight-decay groups), clipping 1.0.

Each (engine, stage) runs in 2 fresh processes (forked from this small parent), so that
``ru_maxrss`` -- the peak resident memory of a rank -- belongs to that configuration only.
Reported per rank (max over ranks):

- ``peak``: ``ru_maxrss`` at the end (includes torch and, for DeepSpeed, its import);
- ``delta``: ``peak`` minus the resident memory just before building the model, i.e. what
  the model, its gradients, the optimizer state, activations and communication buffers
  cost -- the fair comparison of the two engines;
- ``state``: mt's own ``opt.memory()`` (parameter + gradient + optimizer bytes at rest);
- ``tokens/s``: global tokens per second, from the median of the timed steps (each step
  timed between barriers; both engines get the same warmup and timed steps);
- ``load``: the machine's 1-minute load average when the run ended (timings are only
  comparable between runs under similar load);
- ``cpu s``: median CPU seconds per timed step of a rank (max over ranks; all threads,
  communication included) -- the work done, less disturbed by other load than tokens/s.

With ``--repeats R`` each stage runs R rounds, alternating which engine goes first
(mt, ds / ds, mt / ...) so that a drift in machine load hits both alike; the summary line
per stage holds the medians over the rounds and the mt/ds ratios of tokens/s, cpu s, peak and
delta.

DeepSpeed is a pinned peer (benchmarks/requirements.txt): missing, it is an error unless
``--no-deepspeed`` is given (mt rows only). Example (mt starts DeepSpeed without its shm
inference allreduce op: nothing is JIT-built)::

    PYTHONPATH=packages/mt-dist/src:packages/mt-model/src:packages/mt-zero/src \\
        python3 benchmarks/zero.py --layers 6 --hidden 512 --seq 256
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mt_dist.testing import run_distributed
from mt_model import GPT, GPTConfig
from mt_zero import ZeroConfig, ZeroOptimizer, decay_param_groups
from mt_zero.deepspeed_engine import deepspeed_config, deepspeed_environ, initialize_deepspeed

EXTENSIONS = Path.home() / ".cache" / "mt" / "torch_extensions"
MIB = 2**20


def _rss_mib() -> float:
    """Current resident memory of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _batches(args: argparse.Namespace, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _cpu_s() -> float:
    """CPU seconds this process used so far (all its threads, communication included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(step_fn: Any, batches: list[Any], warmup: int) -> tuple[list[float], float, float]:
    """Run the steps; return the losses, the median timed step (between barriers) and the
    median CPU seconds per timed step (less sensitive to other load on a shared machine)."""
    losses, times, cpu = [], [], []
    for i, (idx, targets) in enumerate(batches):
        dist.barrier()
        start, cpu_start = time.perf_counter(), _cpu_s()
        losses.append(step_fn(idx, targets))
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            cpu.append(_cpu_s() - cpu_start)
    return losses, statistics.median(times), statistics.median(cpu)


def _rank(engine: str, stage: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rank of one configuration."""
    if engine == "deepspeed":
        # DeepSpeed reads these before/at import; set in this child process only.
        os.environ.update(deepspeed_environ(dist.get_rank(), dist.get_world_size(),
                                            dist.get_rank()))
        os.environ["TORCH_EXTENSIONS_DIR"] = str(EXTENSIONS)
        import deepspeed
    base = _rss_mib()
    config = GPTConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads,
                       vocab_size=args.vocab, seq_len=args.seq)
    model = GPT(config, seed=0)
    groups = decay_param_groups(model.named_parameters(), 0.1)
    zero = ZeroConfig(stage=stage, precision=args.precision, clip_grad=1.0)
    state = float("nan")
    if engine == "mt":
        opt = ZeroOptimizer(model, lambda g: torch.optim.AdamW(g, lr=1e-4), dist.group.WORLD,
                            zero, param_groups=groups)

        def step(idx: torch.Tensor, targets: torch.Tensor) -> float:
            loss = model(idx, targets)
            opt.backward(loss)
            opt.step()
            return float(loss.detach())
    else:
        client = torch.optim.AdamW(groups, lr=1e-4)
        ds = initialize_deepspeed(model, client, deepspeed_config(
            zero, args.micro_batch, 1, dist.get_world_size()))
        if stage == 3:  # the head uses the embedding's weight outside the embedding module
            deepspeed.zero.register_external_parameter(model.head, model.embed.tokens.weight)

        def step(idx: torch.Tensor, targets: torch.Tensor) -> float:
            loss = ds(idx, targets)
            ds.backward(loss)
            ds.step()
            return float(loss.detach())

    losses, median, cpu = _timed(step, _batches(args, dist.get_rank()), args.warmup)
    if engine == "mt":
        state = opt.memory().total / MIB
    peak = _peak_mib()
    return {"tokens_per_s": dist.get_world_size() * args.micro_batch * args.seq / median,
            "step_s": median, "cpu_s": cpu, "peak": peak, "delta": peak - base, "state": state,
            "first_loss": losses[0], "last_loss": losses[-1]}


ENGINES = ("mt", "deepspeed")
NUMBERS = ("tokens_per_s", "cpu_s", "peak", "delta", "state")


def _measure(engine: str, stage: int, args: argparse.Namespace) -> dict[str, Any]:
    ranks = run_distributed(_rank, args.nproc, engine, stage, args, timeout=args.timeout)
    return {"tokens_per_s": ranks[0]["tokens_per_s"], "step_s": ranks[0]["step_s"],
            "cpu_s": max(r["cpu_s"] for r in ranks),
            "peak": max(r["peak"] for r in ranks), "delta": max(r["delta"] for r in ranks),
            "state": max(r["state"] for r in ranks), "first_loss": ranks[0]["first_loss"],
            "last_loss": ranks[0]["last_loss"], "load": os.getloadavg()[0]}


def _row(stage: int, engine: str, r: dict[str, Any]) -> str:
    loss = f"{r['first_loss']:>7.4f}->{r['last_loss']:.4f}" if "first_loss" in r else ""
    load = f"{r['load']:>5.1f}" if "load" in r else ""
    return (f"{stage:>5} {engine:>9} {r['tokens_per_s']:>9.0f} {r['cpu_s']:>7.2f} "
            f"{r['peak']:>9.0f} "
            f"{r['delta']:>9.0f} {r['state']:>9.0f} {loss:>16} {load:>5}")


def _compare(stage: int, args: argparse.Namespace) -> None:
    """All rounds of one stage, then the medians and the mt/ds ratios."""
    engines = ENGINES[:1] if args.no_deepspeed else ENGINES
    runs: dict[str, list[dict[str, Any]]] = {engine: [] for engine in engines}
    for round_ in range(args.repeats):
        for engine in engines if round_ % 2 == 0 else engines[::-1]:
            runs[engine].append(_measure(engine, stage, args))
            print(_row(stage, engine, runs[engine][-1]), flush=True)
    med = {engine: {k: statistics.median(r[k] for r in runs[engine]) for k in NUMBERS}
           for engine in engines}
    if args.repeats > 1:
        for engine in engines:
            print(_row(stage, ("ds" if engine == "deepspeed" else "mt") + " med", med[engine]),
                  flush=True)
    if args.no_deepspeed:
        return
    mt, ds = med["mt"], med["deepspeed"]
    print(f"{stage:>5} {'mt/ds':>9} {mt['tokens_per_s'] / ds['tokens_per_s']:>8.2f}x "
          f"{mt['cpu_s'] / ds['cpu_s']:>6.2f}x {mt['peak'] / ds['peak']:>8.2f}x "
          f"{mt['delta'] / ds['delta']:>8.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds per stage, alternating which engine runs first")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--no-deepspeed", action="store_true",
                        help="mt only (otherwise a missing deepspeed is an error, not a skip)")
    args = parser.parse_args()
    if not args.no_deepspeed:
        # DeepSpeed is a pinned peer (benchmarks/requirements.txt): fail here, in the parent,
        # before any rank starts. Only the spec is looked up: its import belongs to the ranks
        # (it reads the environment they set first).
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise SystemExit("deepspeed is not installed: pip install -r "
                             "benchmarks/requirements.txt -c infra/python/constraints.txt "
                             "(or pass --no-deepspeed to run mt only)")
    params = sum(p.numel() for p in GPT(GPTConfig(
        n_layers=args.layers, hidden=args.hidden, n_heads=args.heads, vocab_size=args.vocab,
        seq_len=args.seq), seed=None).parameters())
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, vocab {args.vocab}:"
          f" {params / 1e6:.1f}M parameters; {args.nproc} gloo processes x micro-batch "
          f"{args.micro_batch}; {args.precision}; median of {args.steps} steps after "
          f"{args.warmup} warmup; {args.repeats} round(s); load average at start "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    print(f"{'stage':>5} {'engine':>9} {'tokens/s':>9} {'cpu s':>7} {'peak MiB':>9} "
          f"{'delta MiB':>9} "
          f"{'state MiB':>9} {'loss 1st->last':>16} {'load':>5}")
    for stage in args.stages:
        _compare(stage, args)


if __name__ == "__main__":
    main()
