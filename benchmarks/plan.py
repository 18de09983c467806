"""`mt plan`'s estimator against real `mt pretrain` runs on this CPU.

For the `tiny` preset and a GPT-2-small-shaped model (12 x 768, 12 heads, GPT-2 vocabulary,
sequence 128 to stay short) at two layouts each (DP 2 and PP 2, 2 processes, 1 thread each),
it runs `python3 -m mt_pretrain pretrain ... --metrics`, then prints:

- peak memory per rank: measured (max RSS of the rank processes) vs predicted (the estimator's
  weights + grads + optimizer + activations of the fullest rank, plus the runtime's own memory,
  measured once per model by the same command with a model of hidden size 8); also the model
  part alone (measured minus runtime vs the estimate);
- tokens/s: measured (mean of the metrics' tokens_per_s after the first step) vs predicted by
  `estimate()` on a "GPU" whose peak FLOP/s is the fp32 matmul speed at the model's MLP and
  head shapes (FLOP-weighted), measured before and after the run in as many concurrent
  1-thread processes as the run has ranks, memory bandwidth the measured copy speed, and
  links the gloo bandwidth measured on this machine (0.7 GiB/s, /work/shared/notes), with
  efficiency 1.

Wall-clock figures follow the machine's load: the load average is printed first, and with
other jobs on the cores the tokens/s errors swing between runs. The estimator has no
per-operator overhead term, so models as small as `tiny` run slower than it predicts when
the cores are free. Run from the repo root (about 3 minutes on 2 cores):

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') python3 benchmarks/plan.py
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mt_pretrain.config_io import load_config
from mt_pretrain.estimate import estimate
from mt_pretrain.gpus import GPUSpec
from mt_pretrain.layout import Layout

# Runs a command and prints the largest RSS (KiB) of any of its descendants (the ranks).
_WRAPPER = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
            "sys.exit(r.returncode)")
GLOO_BYTES_PER_S = 0.7 * 2**30

MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"model": "tiny", "global_batch_size": 16, "train_steps": 6},
    "gpt2-small-s128": {"model": "gpt2-small", "seq_len": 128, "global_batch_size": 4,
                        "train_steps": 3},
}
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2": {"tp": 1, "pp": 1, "dp": 2},
    "pp2": {"tp": 1, "pp": 2, "dp": 1},
}


def _flags(overrides: dict[str, Any]) -> list[str]:
    return [x for k, v in overrides.items() for x in ("--" + k.replace("_", "-"), str(v))]


def _run(overrides: dict[str, Any], workdir: Path) -> tuple[float, float]:
    """(peak RSS bytes of the fullest rank, mean tokens/s after step 1) of one run."""
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "mt_pretrain", "pretrain", *_flags(overrides),
           "--metrics", str(metrics), "--out-dir", str(workdir / "out"), "--no-progress",
           "--sample-tokens", "0", "--save", "none"]
    out = subprocess.run([sys.executable, "-c", _WRAPPER, *cmd], capture_output=True,
                         text=True)
    if out.returncode:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{out.stderr[-2000:]}")
    rss = int(out.stdout.split("MAXRSS")[-1].split()[0]) * 1024.0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return rss, statistics.mean(r["tokens_per_s"] for r in rows[1:])


def _matmul_rate(shape: tuple[int, int, int]) -> float:
    """FLOP/s of one thread multiplying [rows, k] @ [k, n] for half a second."""
    torch.set_num_threads(1)
    rows, k, n = shape
    a, w = torch.randn(rows, k), torch.randn(k, n)
    a @ w
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.5:
        a @ w
        count += 1
    return 2.0 * rows * k * n * count / (time.perf_counter() - start)


def _matmul_speed(gpt: Any, rows: int, ranks: int) -> float:
    """FLOP/s of the model's matmuls: the layer (MLP) and head shapes, weighted by their
    FLOPs per token, each measured in ``ranks`` concurrent 1-thread processes (as the ranks
    run, sharing the cores with whatever else runs)."""
    h = gpt.hidden
    shapes = [(rows, h, gpt.ffn_hidden), (rows, h, gpt.vocab_size)]
    work = [gpt.n_layers * (8.0 * h * h + 4.0 * h * gpt.ffn_hidden), 2.0 * h * gpt.vocab_size]
    with multiprocessing.get_context("fork").Pool(ranks) as pool:
        rates = [statistics.mean(pool.map(_matmul_rate, [shape] * ranks)) for shape in shapes]
    return sum(work) / sum(w / r for w, r in zip(work, rates))


def _cpu_spec(flops: float) -> GPUSpec:
    """This CPU as one rank sees it: matmul FLOP/s as measured, copy speed of one thread,
    links at the gloo bandwidth."""
    torch.set_num_threads(1)
    x = torch.randn(8 * 2**20)
    y = torch.empty_like(x)
    copy = min(_timed(lambda: y.copy_(x)) for _ in range(5))
    return GPUSpec("cpu-1-thread", flops, 24 * 2**30, GLOO_BYTES_PER_S, GLOO_BYTES_PER_S,
                   2, 2 * x.numel() * 4 / copy)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _layout(overrides: dict[str, Any]) -> tuple[Any, Layout]:
    config = load_config(None, overrides)
    par, train = config.parallel, config.train
    layout = Layout(par.tp, par.pp, par.dp, train.global_batch_size, train.micro_batch_size,
                    par.zero_stage, par.schedule, par.virtual_stages, par.sequence_parallel,
                    "full" if par.activation_checkpointing else "none", par.precision)
    return config.model.gpt_config(), layout


def _pct(pred: float, meas: float) -> str:
    return f"{100 * (pred / meas - 1):+.0f}%"


def main() -> None:
    """Run every model x layout and print predicted vs measured memory and tokens/s."""
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'run':<22} {'mem pred MB':>11} {'meas MB':>8} {'err':>5} | {'model part':>10} "
          f"{'meas':>6} {'err':>5} | {'tok/s pred':>10} {'meas':>8} {'err':>5}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in MODELS.items():
            micro = {"micro_batch_size": model["global_batch_size"] // 4}
            base = {**model, **LAYOUTS["dp2"], **micro, "hidden": 8, "n_heads": 1}
            runtime, _ = _run(base, Path(tmp))
            for lname, lay in LAYOUTS.items():
                overrides = {**model, **lay, **micro}
                gpt, layout = _layout(overrides)
                rows = layout.micro_batch * gpt.seq_len
                before = _matmul_speed(gpt, rows, layout.world_size)
                rss, tps = _run(overrides, Path(tmp))
                # Load from other jobs drifts: calibrate on both sides of the run.
                spec = _cpu_spec((before + _matmul_speed(gpt, rows, layout.world_size)) / 2)
                est = estimate(gpt, layout, spec, efficiency=1.0)
                pred_mem = est.memory_per_gpu_gb * 1e9 + runtime
                part = rss - runtime
                # A model part below 5% of the runtime's RSS is under the measurement noise.
                part_err = (_pct(est.memory_per_gpu_gb * 1e9, part)
                            if part > 0.05 * runtime else "n/a")
                print(f"{name + ' ' + lname:<22} {pred_mem / 2**20:>11.0f} "
                      f"{rss / 2**20:>8.0f} {_pct(pred_mem, rss):>5} | "
                      f"{est.memory_per_gpu_gb * 1e9 / 2**20:>10.0f} "
                      f"{part / 2**20:>6.0f} {part_err:>5} | "
                      f"{est.tokens_per_s:>10.0f} {tps:>8.0f} {_pct(est.tokens_per_s, tps):>5}",
                      flush=True)
            print(f"  ({name}: runtime RSS {runtime / 2**20:.0f} MB; matmul "
                  f"{spec.peak_flops / 1e9:.1f} GFLOP/s, copy "
                  f"{spec.memory_bytes_per_s / 1e9:.1f} GB/s per thread)", flush=True)


if __name__ == "__main__":
    main()
