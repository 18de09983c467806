"""Tokens/s of one full training step (forward + backward + AdamW) of mt_model's GPT:

- mt TP=1: the plain single-process model (with 1 thread, and with as many threads as the
  TP=2 run uses processes, i.e. the same cores);
- mt TP=2 on 2 processes (gloo): ``GPT_PLAN`` (blocks + vocabulary-parallel embedding,
  head and cross entropy), optionally with sequence parallelism;
- mt TP=2 restricted to the blocks (qkv/fc column, proj row): the same decomposition as the
  DTensor variant below, the like-for-like comparison;
- torch DTensor TP=2: ``parallelize_module`` with ``ColwiseParallel`` on qkv / fc and
  ``RowwiseParallel`` on the projections, over a 1-D DeviceMesh on gloo (embedding, head
  and loss stay replicated, as in that plan).

Every variant starts from the same weights and batches (each TP rank processes the same
sequences, so every variant does the same batch x seq tokens per step), and the first step's
loss is printed next to the throughput as a sanity check. The headline ratios divide equal
work: mt against DTensor at the same TP degree, and mt TP=2 against mt TP=1 on as many
threads as TP=2 has processes. Example:

    PYTHONPATH=packages/mt-dist/src:packages/mt-model/src:packages/mt-tensor-parallel/src \\
        python3 benchmarks/tp.py --layers 4 --hidden 512 --seq 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mt_dist.testing import run_distributed
from mt_model import GPT, GPTConfig
from mt_tensor_parallel import GPT_PLAN, apply_tensor_parallel, merge_shards, shard_tensor

BLOCKS_PLAN = {k: v for k, v in GPT_PLAN.items() if k.startswith("blocks.")}


def _config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads,
                     vocab_size=args.vocab, seq_len=args.seq)


def _batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1),
                               generator=torch.Generator().manual_seed(step))
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _time_steps(model: nn.Module, args: argparse.Namespace, sync: Callable[[], None]
                ) -> dict[str, float]:
    """Run warmup + timed steps; return the median timed step and the first loss.

    Each step is timed between two barriers (all ranks), and the median step is reported:
    robust to the bursts of other work on a shared machine.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    first_loss = float("nan")
    times: list[float] = []
    cpu: list[float] = []
    for step, (idx, targets) in enumerate(_batches(args)):
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = model(idx, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
        if step == 0:
            first_loss = float(loss.detach().float())
    median = statistics.median(times)
    return {"tokens_per_s": args.batch * args.seq / median, "step_s": median,
            "best_step_s": min(times), "cpu_step_s": statistics.median(cpu),
            "first_loss": first_loss}


def _single(args: argparse.Namespace, threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    return _time_steps(GPT(_config(args)), args, lambda: None)


def _mt_tp(args: argparse.Namespace, plan_name: str, sequence_parallel: bool
           ) -> dict[str, float]:
    plan = GPT_PLAN if plan_name == "full" else BLOCKS_PLAN
    model = apply_tensor_parallel(GPT(_config(args)), dist.group.WORLD, plan,
                                  sequence_parallel=sequence_parallel)
    return _time_steps(model, args, dist.barrier)


def _dtensor_tp(args: argparse.Namespace) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = dist.get_world_size()
    model = GPT(_config(args))
    with torch.no_grad():
        # DTensor's Colwise gives rank r a contiguous row block; reorder the fused [q; k; v]
        # rows so that block is [q_r; k_r; v_r] (whole heads), as mt's column_qkv slices.
        for block in model.blocks:
            for param in (block.attn.qkv.weight, block.attn.qkv.bias):
                shards = [shard_tensor("column_qkv", param, r, tp) for r in range(tp)]
                param.copy_(merge_shards("column", shards))
    mesh = init_device_mesh("cpu", (tp,))
    plan = {
        "blocks.*.attn.qkv": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(),
    }
    parallelize_module(model, mesh, plan)
    return _time_steps(model, args, dist.barrier)


def _rank0(results: list[Any]) -> Any:
    # Rank 0's timings: steps are bracketed by barriers, so all ranks measure the same.
    return results[0]


def _launch(fn: Callable[..., Any], world: int, args: argparse.Namespace, *rest: Any
            ) -> list[Any]:
    return run_distributed(fn, world, args, *rest, timeout=args.timeout)


def _variants(tp: int) -> list[tuple[str, Callable[..., Any], int, tuple[Any, ...]]]:
    return [
        ("mt TP=1 (1 process, 1 thread)", _single, 1, (1,)),
        (f"mt TP=1 (1 process, {tp} threads)", _single, 1, (tp,)),
        (f"mt TP={tp} (GPT_PLAN)", _mt_tp, tp, ("full", False)),
        (f"mt TP={tp} (GPT_PLAN + sequence parallel)", _mt_tp, tp, ("full", True)),
        (f"mt TP={tp} (blocks only)", _mt_tp, tp, ("blocks", False)),
        (f"DTensor TP={tp} (blocks only)", _dtensor_tp, tp, ()),
    ]


def _run(args: argparse.Namespace) -> list[tuple[str, dict[str, float]]]:
    """Every variant, ``--rounds`` times interleaved; keep each variant's fastest round."""
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for name, fn, world, extra in _variants(args.tp):
            result = _rank0(_launch(fn, world, args, *extra))
            if name not in best or result["step_s"] < best[name]["step_s"]:
                best[name] = result
    return list(best.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3,
                        help="repeat all variants interleaved, keep each one's best round")
    parser.add_argument("--timeout", type=float, default=1200.0)
    args = parser.parse_args()
    print(f"GPT layers={args.layers} hidden={args.hidden} heads={args.heads} "
          f"vocab={args.vocab} seq={args.seq} batch={args.batch}; "
          f"{args.warmup} warmup + {args.steps} timed steps (fwd + bwd + AdamW), fp32, gloo")
    load_before = os.getloadavg()[0]
    rows = _run(args)
    print(f"load average (1 min) before / after: {load_before:.1f} / {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores (other work on the machine slows every variant)")
    width = max(len(name) for name, _ in rows)
    print(f"{'variant':<{width}}  {'tokens/s':>10}  {'median s/step':>13}  "
          f"{'best s/step':>11}  {'CPU s/step':>10}  {'loss@0':>8}")
    for name, r in rows:
        print(f"{name:<{width}}  {r['tokens_per_s']:>10.1f}  {r['step_s']:>13.3f}  "
              f"{r['best_step_s']:>11.3f}  {r['cpu_step_s']:>10.3f}  {r['first_loss']:>8.4f}")
    print("CPU s/step: rank 0's process CPU time (all its threads) per step")
    # Every ratio divides equal work: the same model (same weights: loss@0 agrees), the same
    # batch of batch x seq tokens per step (all TP ranks process the same sequences), and the
    # same TP degree or the same cores on both sides.
    by_name = dict(rows)
    tp = args.tp
    dtensor = by_name[f"DTensor TP={tp} (blocks only)"]["tokens_per_s"]
    print(f"headline (same model, same {args.batch} x {args.seq} tokens per step, TP={tp} on "
          "both sides; tokens/s from the median step):")
    print(f"  mt TP={tp} (blocks only) / DTensor TP={tp} (blocks only): "
          f"{by_name[f'mt TP={tp} (blocks only)']['tokens_per_s'] / dtensor:.2f}  "
          "(like for like: the same layers sharded the same way)")
    for name in (f"mt TP={tp} (GPT_PLAN)", f"mt TP={tp} (GPT_PLAN + sequence parallel)"):
        print(f"  {name} / DTensor TP={tp} (blocks only): "
              f"{by_name[name]['tokens_per_s'] / dtensor:.2f}  (mt also shards the embedding, "
              "head and loss, which DTensor's plan replicates)")
    single = by_name[f"mt TP=1 (1 process, {tp} threads)"]["tokens_per_s"]
    print(f"  mt TP={tp} (GPT_PLAN) / mt TP=1 ({tp} threads, the same cores): "
          f"{by_name[f'mt TP={tp} (GPT_PLAN)']['tokens_per_s'] / single:.2f}  (TP's speed-up "
          "on one machine's cores; on CPU processes compete for the same cores)")


if __name__ == "__main__":
    main()
