"""Context parallelism: peak memory per rank and tokens/s of `mt pretrain --cp 1 | 2 | 4` on
one long sequence, beside `mt plan`'s prediction; and mt's context-parallel attention against
torch's own (`torch.distributed.tensor.experimental.context_parallel`) on the same model,
sequence and ranks.

1. `mt pretrain`: the `tiny` preset (4 x 64, 4 heads) at sequence 16,384, fp32, micro-batch 1,
   global batch 1, 3 steps, no recomputation, ZeRO 0, cp ranks (1 thread each), alternated
   and repeated, as `mt pretrain` runs on CPU (every block of 64 KiB or more mapped on its
   own and unmapped when freed: RSS follows the live bytes the estimator counts) and with
   blocks under 32 MiB served from glibc's heap (`MALLOC_MMAP_THRESHOLD_=33554432`: where
   glibc's default threshold settles once activations are freed; freed blocks stay in the
   RSS). Measured: each rank's peak RSS (the metrics' per-rank peaks, the fullest rank) and
   tokens/s (median of the steps after the first).
   Predicted: the estimator's peak for the layout (`mt plan --cp`) plus the runtime's own
   memory per rank (the same command at the same number of ranks and allocator with a model
   of hidden size 8 and sequence 8, minus the estimator's figure for it).
2. The same GPT (GPT-2 `tiny`, learned positions) and sequence, forward + backward of one
   sequence per step on cp ranks, alternating mt (`ContextParallel` slices, chunked causal
   attention) and torch (its context manager shards the tokens, positions and targets with
   the same head-and-tail balance and runs ring attention inside every SDPA call). On CPU
   torch's refuses (its ring attention covers CUDA's attention kernels only): the benchmark
   prints its error in one line; `--device cuda` runs the comparison on GPUs (bf16, NCCL).

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') python3 benchmarks/cp.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from loss_memory import CPU, _load  # noqa: E402 - the memory-only machine spec
from plan import _flags  # noqa: E402 - benchmarks/plan.py's flag rendering

from mt_model import preset  # noqa: E402
from mt_plan import ParallelLayout, estimate  # noqa: E402

DEGREES = (1, 2, 4)
RUN = {"model": "tiny", "precision": "fp32", "micro_batch_size": 1, "global_batch_size": 1,
       "train_steps": 3, "eval_interval": 0, "zero_stage": 0, "recompute": "none",
       "log_interval": 1}


def _predicted(cp: int, seq: int, hidden: int | None = None) -> float:
    """The estimator's peak bytes per rank of RUN at ``cp`` (``hidden``: the runtime probe's
    micro model, one head)."""
    gpt = preset("tiny").replace(seq_len=seq)
    if hidden is not None:
        gpt = gpt.replace(hidden=hidden, n_heads=1, n_kv_heads=1)
    layout = ParallelLayout(1, 1, 1, 1, 1, zero_stage=0, recompute="none", precision="fp32",
                            cp=cp)
    return estimate(gpt, layout, CPU, 1.0).memory_per_gpu_gb * 1e9


#: The allocators the runs are measured with: mt's (large blocks unmapped when freed), and
#: glibc's heap up to 32 MiB (its default threshold's ceiling).
ALLOCATORS = {"mt": {}, "heap": {"MALLOC_MMAP_THRESHOLD_": "33554432"}}


def _run(options: dict[str, Any], workdir: Path, env: dict[str, str] | None = None
         ) -> tuple[float, float]:
    """(peak RSS bytes of the fullest rank, median tokens/s after step 1) of one run
    (``env``: extra environment variables)."""
    import subprocess

    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "mt_pretrain", "pretrain", *_flags(options), "--metrics",
           str(metrics), "--out-dir", str(workdir / "out"), "--overwrite", "--no-progress",
           "--sample-tokens", "0", "--save", "none"]
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if done.returncode:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    peak = max(max(r["peak_mem_gib_per_rank"]) for r in rows) * 2**30
    return peak, statistics.median(r["tokens_per_s"] for r in rows[1:])


def _runtime(cp: int, workdir: Path, env: dict[str, str]) -> float:
    """The runtime's own memory per rank at ``cp`` ranks (interpreter, torch, gloo)."""
    peak, _ = _run({**RUN, "hidden": 8, "n_heads": 1, "seq_len": 8, "cp": cp, "nproc": cp},
                   workdir, env)
    return peak - _predicted(cp, 8, hidden=8)


def mt_pretrain_rows(seq: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        runtime = {(name, cp): _runtime(cp, Path(tmp), env)
                   for name, env in ALLOCATORS.items() for cp in DEGREES}
        print("runtime per rank (hidden 8, sequence 8): "
              + ", ".join(f"{name} cp {cp} {b / 2**20:.0f} MB"
                          for (name, cp), b in runtime.items()))
        print(f"{'alloc':<6} {'cp':>3} {'pred MB':>8} {'meas MB':>8} {'err':>6} | "
              f"{'model pred MB':>13} | {'tok/s':>7}")
        for _ in range(repeats):
            for cp in DEGREES:
                for name, env in ALLOCATORS.items():
                    rss, tps = _run({**RUN, "seq_len": seq, "cp": cp, "nproc": cp}, Path(tmp),
                                    env)
                    model = _predicted(cp, seq)
                    pred = model + runtime[name, cp]
                    print(f"{name:<6} {cp:>3} {pred / 2**20:>8.0f} {rss / 2**20:>8.0f} "
                          f"{100 * (pred / rss - 1):>+5.1f}% | {model / 2**20:>13.0f} | "
                          f"{tps:>7.0f}  {_load()}", flush=True)


# ------------------------------------------------------------------ mt against torch's CP
def _compare_rank(rank: int, world: int, port: int, seq: int, steps: int, device_type: str,
                  out: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from mt_model import GPT
    from mt_tensor_parallel import ContextParallel, attach_context, shard_sequence

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device_type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = GPT(preset("tiny").replace(seq_len=seq)).to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.config.vocab_size, (1, seq + 1), generator=gen).to(device)
    tokens, targets = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    context = ContextParallel(dist.group.WORLD, seq)

    def loss_of(x: torch.Tensor, t: torch.Tensor, positions: torch.Tensor | None) -> Any:
        h = model.embed(x, positions)
        for block in model.blocks:
            h = block(h)
        logits = model.head(model.ln_f(h), model.embed.tokens.weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), t.flatten())

    def mt_step() -> None:
        attach_context(model, context)
        try:
            loss_of(shard_sequence(tokens, world, rank), shard_sequence(targets, world, rank),
                    None).backward()
        finally:
            attach_context(model, None)

    def torch_step() -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh(device_type, (world,))
        x, t = tokens.clone(), targets.clone()
        positions = torch.arange(seq, device=device)[None].clone()
        with context_parallel(mesh, buffers=[x, t, positions], buffer_seq_dims=[1, 1, 1]):
            loss_of(x, t, positions).backward()

    def timed(step: Any) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() if cuda else float("nan")
        return seconds, peak

    result: dict[str, Any] = {}
    try:
        timed(torch_step)  # warm-up; on CPU this is where torch refuses
    except Exception as err:  # noqa: BLE001 - reported as the one line the issue asks for
        result["torch_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    timed(mt_step)
    sides = {"mt": mt_step} if "torch_error" in result else {"mt": mt_step, "torch": torch_step}
    for name in sides:
        result[name] = []
    for _ in range(steps):  # alternating
        for name, step in sides.items():
            result[name].append(timed(step))
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def compare_with_torch(seq: int, world: int, steps: int, device_type: str) -> None:
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    port = 29500 + os.getpid() % 1000
    mp.spawn(_compare_rank, args=(world, port, seq, steps, device_type, queue), nprocs=world)
    result = queue.get()
    mt_s = statistics.median(s for s, _ in result["mt"])
    print(f"mt   cp {world}, {device_type}, seq {seq:,}: {seq / mt_s:,.0f} tokens/s "
          f"(forward + backward)"
          + (f", peak {max(p for _, p in result['mt']) / 2**20:,.0f} MB per rank"
             if device_type == "cuda" else ""))
    if "torch_error" in result:
        print(f"torch context_parallel on {device_type}: {result['torch_error']} "
              "(its ring attention needs CUDA: run with --device cuda on a GPU machine)")
        return
    torch_s = statistics.median(s for s, _ in result["torch"])
    print(f"torch cp {world}: {seq / torch_s:,.0f} tokens/s, peak "
          f"{max(p for _, p in result['torch']) / 2**20:,.0f} MB per rank; mt / torch = "
          f"{torch_s / mt_s:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=3, help="comparison steps per side")
    parser.add_argument("--skip-pretrain", action="store_true")
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_load()}, "
          f"{os.cpu_count()} cores")
    if not args.skip_pretrain and args.device == "cpu":
        mt_pretrain_rows(args.seq, args.repeats)
    for world in (2, 4):
        compare_with_torch(args.seq, world, args.steps, args.device)


if __name__ == "__main__":
    main()
