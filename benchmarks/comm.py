"""Communication per training step, measured: collectives, bytes, exposed and hidden seconds,
and tokens/s, of mt against its peers on the same GPT, the same batches, the same AdamW, on
gloo processes of this machine.

Cases (``--cases``):

- ``tp4-sp``: TP 4 with sequence parallelism, one replica: mt with its replicated parameters'
  gradients summed once per step in one bucket (``mt``, what ``mt pretrain`` runs) against the
  same model summing them in every micro-batch's backward (``mt-per-use``: ``copy_to_tp``,
  what mt did before), the same mt model in DeepSpeed's engine at ZeRO 1 with its mpu and
  the same once-per-step sum before DeepSpeed's reduction (``deepspeed``, what ``mt pretrain
  --engine deepspeed`` runs), and megatron-core's GPTModel at TP 4 + SP (``mcore``).
- ``dpN-zS``: data parallelism over N ranks with ZeRO stage S (1 or 3): mt's
  ``ZeroOptimizer`` against DeepSpeed's ZeRO of the same stage (``deepspeed``) and, for stage
  1, megatron-core's ``DistributedDataParallel(overlap_grad_reduce=True)`` with its
  distributed optimizer (``mcore``).

Every collective is recorded by :class:`mt_dist.trace.CollectiveTrace`, which wraps
torch.distributed's functions, so it sees DeepSpeed's and megatron-core's collectives as it
sees mt's. Per engine (medians over the timed steps; collectives and seconds averaged over the
ranks):

- ``coll``: collectives per step (``by kind`` in ``--verbose``); ``MiB``: their bytes;
- ``exposed s``: seconds a rank was blocked in them per step (nothing else could run);
- ``peers s``: the part of those seconds before the last rank had launched the collective
  (waiting for a slower or descheduled rank: load imbalance, not communication; ranks'
  records are lined up on the host's monotonic clock). With more ranks than cores (DP 4 and
  TP 4 on 2 cores) most of the exposed time is this;
- ``hidden s``: seconds they were in flight under other work (asynchronous ones);
- ``tokens/s``: global tokens per second (each step timed between barriers).

``mt plan`` (``--plan``, on by default) predicts each case on this CPU, calibrated before
and after the case as benchmarks/plan.py calibrates; its exposed communication is compared
with mt's exposed seconds beyond the peer waits (what the plan models: the collectives
themselves), its tokens/s with mt's.

With ``--repeats R`` each case runs R rounds, alternating the engines' order. Peers are
pinned (benchmarks/requirements.txt): a missing one is an error, not a skip. Example::

    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') python3 benchmarks/comm.py \\
        --cases tp4-sp dp2-z1 dp4-z1 dp2-z3 dp4-z3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mt_dist import Topology, build_groups
from mt_dist.testing import run_distributed
from mt_dist.trace import CollectiveTrace, summarize
from mt_model import GPT, GPTConfig
from mt_plan.estimate import estimate
from mt_plan.layout import ParallelLayout
from mt_tensor_parallel import GPT_PLAN, apply_tensor_parallel, defer_replicated_grads
from mt_zero import ZeroConfig, ZeroOptimizer, counts_once, decay_param_groups
from mt_zero.deepspeed_engine import (
    deepspeed_config,
    deepspeed_environ,
    initialize_deepspeed,
    sum_partial_grads_at_boundary,
)
from mt_zero.deepspeed_mpu import GroupsMpu

sys.path.insert(0, str(Path(__file__).parent))  # mcore_peer.py, plan.py beside this file
EXTENSIONS = Path.home() / ".cache" / "mt" / "torch_extensions"
MIB = 2**20
LR = 1e-4


def _case(name: str) -> tuple[int, int, int]:
    """``tp4-sp`` -> (tp 4, dp 1, stage 1); ``dp2-z3`` -> (tp 1, dp 2, stage 3)."""
    if name.startswith("tp") and name.endswith("-sp"):
        return int(name[2:-3]), 1, 1
    if name.startswith("dp") and "-z" in name:
        dp, stage = name[2:].split("-z")
        return 1, int(dp), int(stage)
    raise SystemExit(f"--cases: {name!r} is neither tpN-sp nor dpN-zS")


def engines_of(name: str) -> tuple[str, ...]:
    tp, _dp, stage = _case(name)
    if tp > 1:
        return ("mt", "mt-per-use", "deepspeed", "mcore")
    return ("mt", "deepspeed", "mcore") if stage == 1 else ("mt", "deepspeed")


def _config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads,
                     vocab_size=args.vocab, seq_len=args.seq)


def _batches(args: argparse.Namespace, replica: int) -> list[list[tuple[torch.Tensor, ...]]]:
    """Every step's micro-batches of this data-parallel replica (TP ranks share them)."""
    steps = []
    for step in range(args.warmup + args.steps + (1 if args.profile else 0)):
        micro = []
        for i in range(args.micro_batches):
            gen = torch.Generator().manual_seed(100_000 * step + 100 * i + replica)
            tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1),
                                   generator=gen)
            micro.append((tokens[:, :-1], tokens[:, 1:]))
        steps.append(micro)
    return steps


def _mt(case: str, engine: str, args: argparse.Namespace) -> Callable[[list[Any]], float]:
    tp, dp, stage = _case(case)
    groups = build_groups(Topology(tp=tp, dp=dp))
    model = GPT(_config(args), seed=0)
    if tp > 1:
        model = apply_tensor_parallel(model, groups.tp, GPT_PLAN, sequence_parallel=True)
    partial = defer_replicated_grads(model) if engine == "mt" and tp > 1 else []
    styles = {n: "replicate" if p.dim() == 1 or "positions" in n else "sliced"
              for n, p in model.named_parameters()} if tp > 1 else {}
    opt = ZeroOptimizer(
        model, lambda g: torch.optim.AdamW(g, lr=LR), groups.dp,
        ZeroConfig(stage=stage, clip_grad=1.0, bucket_numel=args.bucket_numel),
        param_groups=decay_param_groups(model.named_parameters(), 0.1),
        norm_groups=[groups.tp],
        count_in_norm=counts_once(groups.tp_rank, lambda n, _p: styles.get(n) == "replicate"),
        partial_params=[p for _, p in partial], partial_group=groups.tp)

    def step(micro: list[Any]) -> float:
        total = 0.0
        for i, (idx, targets) in enumerate(micro):
            quiet = opt.no_sync() if i < len(micro) - 1 else _nothing()
            with quiet:
                loss = model.loss_fn(model(idx), targets) if tp > 1 else model(idx, targets)
                opt.backward(loss / len(micro))
            total += float(loss.detach()) / len(micro)
        opt.step()
        return total

    return step


class _nothing:  # noqa: N801 - a null context manager, cheaper than contextlib's per call
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _deepspeed(case: str, args: argparse.Namespace) -> Callable[[list[Any]], float]:
    tp, dp, stage = _case(case)
    os.environ.update(deepspeed_environ(dist.get_rank(), dist.get_world_size(),
                                        dist.get_rank()))
    os.environ["TORCH_EXTENSIONS_DIR"] = str(EXTENSIONS)
    import deepspeed

    model = GPT(_config(args), seed=0)
    mpu, partial, groups = None, [], None
    if tp > 1:  # mt's TP + SP model in DeepSpeed's engine, as mt pretrain --engine deepspeed
        groups = build_groups(Topology(tp=tp, dp=dp))
        model = apply_tensor_parallel(model, groups.tp, GPT_PLAN, sequence_parallel=True)
        for name, param in model.named_parameters():  # DeepSpeed's norm: sliced per TP rank
            param.model_parallel = not (param.dim() == 1 or "positions" in name)
        partial = [p for _, p in defer_replicated_grads(model)]
        mpu = GroupsMpu(groups)
    client = torch.optim.AdamW(decay_param_groups(model.named_parameters(), 0.1), lr=LR)
    zero = ZeroConfig(stage=stage, clip_grad=1.0, bucket_numel=args.bucket_numel)
    engine = initialize_deepspeed(model, client, deepspeed_config(
        zero, args.micro_batch, args.micro_batches, dp), mpu=mpu)
    if groups is not None:  # summed over TP once per step, at DeepSpeed's boundary
        sum_partial_grads_at_boundary(engine, partial, groups.tp)
    if stage == 3:  # the head uses the embedding's weight outside the embedding module
        deepspeed.zero.register_external_parameter(model.head, model.embed.tokens.weight)

    def step(micro: list[Any]) -> float:
        total = 0.0
        for idx, targets in micro:
            loss = model.loss_fn(engine(idx), targets) if tp > 1 else engine(idx, targets)
            engine.backward(loss)
            engine.step()  # DeepSpeed steps on the last micro-batch of the step
            total += float(loss.detach()) / len(micro)
        return total

    return step


def _mcore(case: str, args: argparse.Namespace) -> Callable[[list[Any]], float]:
    import mcore_peer

    tp, _dp, _stage = _case(case)
    shape = {"n_layers": args.layers, "hidden": args.hidden, "n_heads": args.heads,
             "vocab_size": args.vocab, "seq_len": args.seq}
    peer = mcore_peer.build(shape, tp=tp, sequence_parallel=tp > 1,
                            distributed_optimizer=tp == 1, bucket_numel=args.bucket_numel,
                            lr=LR)
    return peer.step


def _rank(case: str, engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """One rank of one (case, engine): its timed steps' medians."""
    torch.manual_seed(0)
    tp, _dp, _stage = _case(case)
    if engine == "deepspeed":
        step = _deepspeed(case, args)
    elif engine == "mcore":
        step = _mcore(case, args)
    else:
        step = _mt(case, engine, args)
    batches = _batches(args, dist.get_rank() // tp)
    times, counts, nbytes, exposed, hidden, losses = [], [], [], [], [], []
    aligned: list[list[tuple[str, float, float, float]]] = []  # per step: host clock
    profile = ""
    with CollectiveTrace() as trace:
        for i, micro in enumerate(batches):
            with trace.paused():
                dist.barrier()
            trace.take()
            origin = trace.origin_s
            extra = i == args.warmup + args.steps  # profiled by rank 0, not timed
            profiled = extra and dist.get_rank() == 0
            with torch.profiler.profile() if profiled else _nothing() as prof:
                start = time.perf_counter()
                losses.append(step(micro))
                elapsed = time.perf_counter() - start
            if profiled:
                profile = prof.key_averages().table(sort_by="self_cpu_time_total",
                                                    row_limit=args.profile)
            records = trace.take()
            summary = summarize(records)
            with trace.paused():
                dist.barrier()
            if args.warmup <= i and not extra:
                aligned.append([(r.group, origin + r.launched_s, r.blocked_s,
                                 origin + r.launched_s + r.in_flight_s) for r in records])
                times.append(elapsed)
                counts.append(summary["collectives"])
                nbytes.append(summary["comm_bytes"])
                exposed.append(summary["comm_exposed_s"])
                hidden.append(summary["comm_hidden_s"])
                by_kind = summary["by_kind"]
    med = statistics.median
    return {"step_s": med(times), "coll": med(counts), "bytes": med(nbytes),
            "exposed": med(exposed), "hidden": med(hidden), "by_kind": by_kind,
            "first_loss": losses[0], "last_loss": losses[args.warmup + args.steps - 1],
            "aligned": aligned, "profile": profile}


def peer_waits(ranks: list[list[list[tuple[str, float, float, float]]]]
               ) -> list[list[float]]:
    """Per rank and step, the seconds it was blocked in a collective before its last peer
    had launched that collective (waiting for a slower rank, not for the network).

    ``ranks[r][step]``: rank r's collectives of the step as (group, launch, seconds
    blocked, end) on the host's clock; the k-th collective of a group on one rank is the
    k-th of that group on every rank. A wait (synchronous or ``wait()``) ends at the
    collective's end, so it spans ``[end - blocked, end]``."""
    waits: list[list[float]] = [[] for _ in ranks]
    for step in range(min(len(r) for r in ranks)):
        last: dict[tuple[str, int], float] = {}
        keys: list[list[tuple[str, int]]] = []
        for records in ranks:
            seen: dict[str, int] = {}
            mine = []
            for group, launched, _blocked, _end in records[step]:
                key = (group, seen.get(group, 0))
                seen[group] = key[1] + 1
                last[key] = max(last.get(key, launched), launched)
                mine.append(key)
            keys.append(mine)
        for r, records in enumerate(ranks):
            waits[r].append(sum(
                max(0.0, min(last[key], end) - (end - blocked))
                for key, (_g, _l, blocked, end) in zip(keys[r], records[step], strict=True)))
    return waits


def _measure(case: str, engine: str, args: argparse.Namespace) -> dict[str, Any]:
    tp, dp, _stage = _case(case)
    ranks = run_distributed(_rank, tp * dp, case, engine, args, timeout=args.timeout)
    mean = statistics.fmean
    tokens = dp * args.micro_batch * args.micro_batches * args.seq
    waits = peer_waits([r["aligned"] for r in ranks])
    return {"tokens_per_s": tokens / max(r["step_s"] for r in ranks),
            "coll": mean(r["coll"] for r in ranks), "bytes": mean(r["bytes"] for r in ranks),
            "exposed": mean(r["exposed"] for r in ranks),
            "peers": mean(statistics.median(w) for w in waits),
            "hidden": mean(r["hidden"] for r in ranks), "by_kind": ranks[0]["by_kind"],
            "first_loss": ranks[0]["first_loss"], "last_loss": ranks[0]["last_loss"],
            "load": os.getloadavg()[0], "profile": ranks[0]["profile"]}


def _row(case: str, engine: str, r: dict[str, Any]) -> str:
    loss = f"{r['first_loss']:.4f}->{r['last_loss']:.4f}" if "first_loss" in r else ""
    load = f"{r['load']:.1f}" if "load" in r else ""
    return (f"{case:>7} {engine:>11} {r['tokens_per_s']:>9.0f} {r['coll']:>7.0f} "
            f"{r['bytes'] / MIB:>8.1f} {r['exposed']:>9.3f} {r['peers']:>7.3f} "
            f"{r['hidden']:>8.3f} "
            f"{loss:>16} {load:>5}")


NUMBERS = ("tokens_per_s", "coll", "bytes", "exposed", "peers", "hidden")


def _calibrate(case: str, args: argparse.Namespace) -> dict[str, float]:
    """benchmarks/plan.py's measurement of this CPU as the case's ranks see it."""
    import plan

    tp, dp, _stage = _case(case)
    rows = args.micro_batch * args.seq
    return plan._cpu_spec(_config(args), rows, tp * dp, rows * args.micro_batches, tp, tp > 1)


def _predict(case: str, args: argparse.Namespace, parts: list[dict[str, float]]) -> Any:
    """``mt plan``'s estimate of the case on the calibrations ``parts`` (before and after)."""
    import plan

    tp, dp, stage = _case(case)
    spec = plan._spec(parts, statistics.mean(p["share"] for p in parts))
    layout = ParallelLayout(tp=tp, pp=1, dp=dp, micro_batch=args.micro_batch,
                            global_batch=dp * args.micro_batch * args.micro_batches,
                            zero_stage=stage, sequence_parallel=tp > 1, recompute="none",
                            precision="fp32")
    return estimate(_config(args), layout, spec, efficiency=1.0)


def _compare(case: str, args: argparse.Namespace) -> None:
    engines = [e for e in engines_of(case) if e not in args.skip]
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    parts = [_calibrate(case, args)] if args.plan else []
    for round_ in range(args.repeats):
        for engine in engines if round_ % 2 == 0 else engines[::-1]:
            runs[engine].append(_measure(case, engine, args))
            print(_row(case, engine, runs[engine][-1]), flush=True)
            if args.profile:
                print(f"{case} {engine}: rank 0's last step, by self CPU time\n"
                      f"{runs[engine][-1]['profile']}", flush=True)
            if args.verbose:
                for kind, row in runs[engine][-1]["by_kind"].items():
                    print(f"{'':>20} {kind:<32} {row['n']:>5} x, {row['bytes'] / MIB:8.2f} "
                          f"MiB, exposed {row['exposed_s']:.3f} s, hidden "
                          f"{row['hidden_s']:.3f} s", flush=True)
    med = {e: {k: statistics.median(r[k] for r in runs[e]) for k in NUMBERS} for e in engines}
    if args.repeats > 1:
        for engine in engines:
            print(_row(case, engine + " med", med[engine]), flush=True)
    mt = med["mt"]
    if args.plan:
        est = _predict(case, args, [*parts, _calibrate(case, args)])
        measured = mt["exposed"] - mt["peers"]
        print(f"{case:>7} {'mt plan':>11} {est.tokens_per_s:>9.0f} {'':>7} {'':>8} "
              f"{est.exposed_comm_s:>9.3f} {'':>7} {est.hidden_comm_s:>8.3f}   exposed "
              f"{100 * (est.exposed_comm_s / measured - 1):+.0f}% of mt's {measured:.3f} s "
              f"beyond peer waits, tokens/s "
              f"{100 * (est.tokens_per_s / mt['tokens_per_s'] - 1):+.0f}%", flush=True)
    for peer in engines[1:]:
        other = med[peer]
        print(f"{case:>7} {'mt/' + peer:>11} {mt['tokens_per_s'] / other['tokens_per_s']:>8.2f}x"
              f" {mt['coll'] / max(other['coll'], 1):>6.2f}x {'':>8} "
              f"{mt['exposed'] / max(other['exposed'], 1e-9):>8.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["tp4-sp", "dp2-z1", "dp4-z1",
                                                       "dp2-z3", "dp4-z3"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=4, help="per step and replica")
    parser.add_argument("--bucket-numel", type=int, default=ZeroConfig().bucket_numel,
                        help="gradient bucket elements (mt, DeepSpeed and megatron-core)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip", nargs="*", default=[], choices=("mt-per-use", "deepspeed",
                                                                  "mcore"),
                        help="leave a peer out (otherwise a missing peer is an error)")
    parser.add_argument("--verbose", action="store_true", help="collectives by kind")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the N operators of rank 0's last step that took the most "
                        "CPU time (torch.profiler), per engine and round")
    parser.add_argument("--plan", action=argparse.BooleanOptionalAction, default=True,
                        help="mt plan's prediction of each case on this CPU, calibrated "
                        "before and after the case (benchmarks/plan.py's measurements)")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    import importlib.util

    for peer, module in (("deepspeed", "deepspeed"), ("mcore", "megatron.core")):
        if peer not in args.skip and importlib.util.find_spec(module) is None:
            raise SystemExit(f"{module} is not installed: pip install -r "
                             "benchmarks/requirements.txt -c infra/python/constraints.txt "
                             f"(or --skip {peer})")
    params = sum(p.numel() for p in GPT(_config(args), seed=None).parameters())
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, vocab {args.vocab}:"
          f" {params / 1e6:.1f}M parameters; micro-batch {args.micro_batch} x "
          f"{args.micro_batches} per replica and step; fp32; bucket {args.bucket_numel:,}; "
          f"median of {args.steps} steps after {args.warmup}; {args.repeats} round(s); "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'case':>7} {'engine':>11} {'tokens/s':>9} {'coll':>7} {'MiB':>8} "
          f"{'exposed s':>9} {'peers s':>7} {'hidden s':>8} {'loss 1st->last':>16} "
          f"{'load':>5}")
    for case in args.cases:
        _compare(case, args)


if __name__ == "__main__":
    main()
