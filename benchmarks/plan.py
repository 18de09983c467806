"""`mt plan`'s estimator against real `mt pretrain` runs on this CPU.

For the `tiny` preset and a GPT-2-small-shaped model (12 x 768, 12 heads, GPT-2 vocabulary,
sequence 128 to stay short) at two layouts each (DP 2 with ZeRO-1 and PP 2, 2 processes,
1 thread each, fp32; `--layouts` adds the communication cases: dp2-z3, dp4, dp4-z3, tp4-sp),
it runs `python3 -m mt_pretrain pretrain ... --metrics --trace-collectives`, then prints:

- peak memory per rank: measured (max RSS of the rank processes) vs predicted (the estimator's
  peak of the fullest rank, plus the runtime's own memory, measured once per model by the
  same command with a model of hidden size 8); also the model part alone;
- exposed communication per step: measured (rank 0's `comm_exposed_s`, the seconds it was
  blocked in collectives, median over the steps after the first) vs the estimator's
  `exposed_comm_s` (TP on the critical path, DP as mt-zero overlaps it); no error with
  pipelines, where the measured blocked time includes the bubble's waits in receives;
- tokens/s: measured (median over the steps after the first) vs predicted by `estimate()`
  with efficiency 1 on a `GPUSpec` of this CPU that the benchmark measures right before and
  right after each run (the two averaged), in as many concurrent 1-thread gloo processes as
  the run has ranks: GEMM FLOP/s at the model's MLP and head shapes (forward, data and
  weight gradient, in F.linear's layouts), elementwise bandwidth, first touch of fresh
  memory, what a transformer layer's and the head's forward + backward cost beyond those
  GEMM and elementwise terms (1- and 3-layer models of the run's width, vocabulary,
  sequence and micro-batch, timed, minus the estimator's own figure for them), the
  optimizer step as mt pretrain runs it (`ZeroOptimizer.step` around fused AdamW:
  parameters/s and cost per tensor), gloo all-reduce: bandwidth and fixed cost of a
  bucket-sized message (the line through the model's bucket size and one 4x apart) and the
  latency of a one-element one, and the scratch an all-gather allocates; and the training
  framework's own costs per step, per micro-batch and per parameter tensor (hooks, data
  loading, small collectives): three real `mt pretrain` runs of a micro model (hidden 16,
  sequence 8) at the same layout, 1 or 5 layers per stage, 1 or 4 micro-batches, their
  step time minus what the estimator already models (once per layout). No number is
  fitted to a benchmarked run; every figure is a measured component.

Other jobs share the two cores, so compute is timed in CPU seconds of the thread (medians:
its cost when it has a core) and scaled by the share of a core the run's ranks got while
runnable from step 2 on (their threads' /proc schedstat: on-CPU vs runqueue time, read every
0.25 s: reading it every step took ~15% of a tiny run's speed); gloo is timed in wall
seconds and averaged with the mean (a blocked rank also waits to be scheduled again, on
every message). The load average is printed with every row, and each case's predicted
step time by part next to the measured one.

Run from the repo root (about 3 minutes on 2 cores):

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') python3 benchmarks/plan.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mt_dist.testing import run_distributed
from mt_model import GPT, GPTConfig, count_parameters
from mt_plan.estimate import bucket_numel, estimate
from mt_plan.gpus import GPUSpec
from mt_plan.layout import ParallelLayout
from mt_pretrain.config.load import load_config
from mt_pretrain.config.resolve import resolve
from mt_zero import ZeroConfig, ZeroOptimizer

# Runs a command and prints the largest RSS (KiB) of any of its descendants (the ranks).
_WRAPPER = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
            "sys.exit(r.returncode)")

MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"model": "tiny", "global_batch_size": 16, "train_steps": 150},
    "gpt2-small-s128": {"model": "gpt2-small", "seq_len": 128, "global_batch_size": 4,
                        "train_steps": 4},
}
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2": {"tp": 1, "pp": 1, "dp": 2},
    "pp2": {"tp": 1, "pp": 2, "dp": 1},
    # The communication cases of benchmarks/comm.py (--layouts to run them).
    "dp2-z3": {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 3},
    "dp4": {"tp": 1, "pp": 1, "dp": 4},
    "dp4-z3": {"tp": 1, "pp": 1, "dp": 4, "zero_stage": 3},
    "tp4-sp": {"tp": 4, "pp": 1, "dp": 1, "sequence_parallel": True},
}
DEFAULT_LAYOUTS = ("dp2", "pp2")


def _flags(overrides: dict[str, Any]) -> list[str]:
    """Command-line flags: ``--key value``, or ``--key`` / ``--no-key`` for a bool."""
    out = []
    for key, value in overrides.items():
        flag = key.replace("_", "-")
        out += ([f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool)
                else [f"--{flag}", str(value)])
    return out


_WATCH_INTERVAL = 0.25  # seconds between two reads of the ranks' scheduler counters


def _threads(pid: int | str = "self") -> dict[str, tuple[int, int]]:
    """(ns on a CPU, ns runnable but waiting for one) of each thread of ``pid``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:  # the thread ended
            continue
        out[f"{pid}/{task.name}"] = (int(fields[0]), int(fields[1]))
    return out


def _share(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> float:
    """Fraction of a core the threads runnable between two readings got (1 on an idle
    machine); only threads seen in both readings count."""
    run = sum(after[k][0] - before[k][0] for k in after.keys() & before.keys())
    wait = sum(after[k][1] - before[k][1] for k in after.keys() & before.keys())
    return run / (run + wait) if run + wait else 1.0


def _counters(pids: list[int]) -> dict[str, tuple[int, int]]:
    """Per-thread scheduler counters of ``pids`` (processes that ended count nothing)."""
    out: dict[str, tuple[int, int]] = {}
    for pid in pids:
        try:
            out.update(_threads(pid))
        except OSError:
            continue
    return out


def _watch(proc: subprocess.Popen, metrics: Path,
           window: list[dict[str, tuple[int, int]]]) -> None:
    """Scheduler counters of ``proc``'s descendants (the ranks): ``window`` gets them when
    step 1 is done (the first metrics line: start-up and the first step, left out of the
    tokens/s too, are left out) and, every ``_WATCH_INTERVAL`` seconds, the latest. Light on
    purpose: a /proc walk per step took ~15% of a tiny run's speed from the ranks."""
    import psutil

    pids: list[int] | None = None
    last = 0.0
    while proc.poll() is None:
        time.sleep(0.01)
        try:
            started = metrics.stat().st_size > 0
        except OSError:
            continue
        if not started:
            continue
        if pids is None:
            pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            window.append(_counters(pids))
            last = time.monotonic()
        elif time.monotonic() - last >= _WATCH_INTERVAL:
            window[1:] = [_counters(pids)]
            last = time.monotonic()


def _run(overrides: dict[str, Any], workdir: Path, trace: bool = False
         ) -> tuple[float, float, float, float]:
    """(peak RSS bytes of the fullest rank, median tokens/s after step 1, share of a core
    the ranks got while runnable, from step 2 on, and with ``trace`` rank 0's median exposed
    communication seconds per step after step 1, else nan) of one run."""
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "mt_pretrain", "pretrain", *_flags(overrides),
           "--metrics", str(metrics), "--out-dir", str(workdir / "out"), "--no-progress",
           "--sample-tokens", "0", "--save", "none"]
    cmd += ["--trace-collectives"] if trace else []
    proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, *cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    window: list[dict[str, tuple[int, int]]] = []
    watcher = threading.Thread(target=_watch, args=(proc, metrics, window), daemon=True)
    watcher.start()
    stdout, stderr = proc.communicate()
    watcher.join()
    if proc.returncode:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{stderr[-2000:]}")
    rss = int(stdout.split("MAXRSS")[-1].split()[0]) * 1024.0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    if len(window) < 2:
        raise SystemExit(f"too few steps seen to measure the core share: {' '.join(cmd)}")
    share = _share(window[0], window[1])
    exposed = statistics.median(r["comm_exposed_s"] for r in rows[1:]) if trace \
        else float("nan")
    return rss, statistics.median(r["tokens_per_s"] for r in rows[1:]), share, exposed


def _median_time(fn: Any, repeats: int, inner: int = 1, clock: Any = time.thread_time,
                 average: Any = statistics.median) -> float:
    """Median seconds of ``inner`` calls of ``fn`` over ``repeats`` tries (after a warm-up).

    Compute is timed in CPU seconds of this thread (``time.thread_time``): what it costs
    when it has a core, however many other jobs share the cores. Communication waits on
    the peer and is timed in wall seconds (``clock=time.perf_counter``) and averaged with
    the mean: when other jobs share the cores, a blocked rank also waits to be scheduled
    again after the message arrives, and a run pays that on every message.
    """
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        for _ in range(inner):
            fn()
        times.append((clock() - start) / inner)
    return statistics.median(times) if average is statistics.median else average(times)


def _matmul_flops(gpt: GPTConfig, rows: int) -> float:
    """FLOP/s of the model's GEMMs in the layouts F.linear uses (weight ``W`` stored
    [out, in]): forward ``x @ W^T``, data gradient ``dy @ W``, weight gradient ``dy^T @ x``,
    at the MLP and the head shapes, weighted by their FLOPs per token."""
    h = gpt.hidden
    work, rates = [], []
    for n, flops in ((gpt.ffn_hidden, gpt.n_layers * (8.0 * h * h + 4.0 * h * gpt.ffn_hidden)),
                     (gpt.vocab_size, 2.0 * h * gpt.vocab_size)):
        x, w, dy = torch.randn(rows, h), torch.randn(n, h), torch.randn(rows, n)
        inner = max(1, int(2e8 / (2.0 * rows * h * n)))  # ~0.2 GFLOP per try
        for gemm in (lambda x=x, w=w: x @ w.t(), lambda w=w, dy=dy: dy @ w,
                     lambda x=x, dy=dy: dy.t() @ x):
            rates.append(2.0 * rows * h * n / _median_time(gemm, 5, inner))
            work.append(flops)
    return sum(work) / sum(w / r for w, r in zip(work, rates))


def _model_overheads(gpt: GPTConfig, micro_batch: int, rates: dict[str, float]
                     ) -> tuple[float, float]:
    """(per layer, head) seconds of forward + backward that the estimator's GEMM and
    elementwise terms (at the measured ``rates``) leave out: operator dispatch, attention
    and softmax kernels slower than their FLOPs. A 1- and a 3-layer model of ``gpt``'s
    width, vocabulary and sequence are timed at ``micro_batch``; each one's modelled time
    (the estimator, those fixed costs 0) is subtracted; the 2 extra layers give the
    per-layer rest, the 1-layer model's rest minus one layer is the head's."""
    zero = _spec_of({**rates, "layer_overhead_s": 0.0, "head_overhead_s": 0.0})
    layout = ParallelLayout(tp=1, pp=1, dp=1, global_batch=micro_batch, micro_batch=micro_batch,
                    zero_stage=0, recompute="none", precision="fp32")

    def rest(layers: int) -> float:
        config = gpt.replace(n_layers=layers)
        model = GPT(config, seed=0)
        idx = torch.randint(0, config.vocab_size, (micro_batch, config.seq_len))

        def fwd_bwd() -> None:
            model(idx, idx).backward()
        # Large models: few timings of one call; micro ones: more, 5 calls per timing.
        small = config.hidden * config.vocab_size < 2**22
        measured = _median_time(fwd_bwd, 9 if small else 3, 5 if small else 1)
        modelled = estimate(config, layout, zero, efficiency=1.0).pipeline_time_s
        return measured - modelled
    one, three = rest(1), rest(3)
    layer = max(0.0, (three - one) / 2)
    return layer, max(0.0, one - layer)


def _adam_costs() -> tuple[float, float]:
    """(parameters/s, fixed seconds per tensor) of the optimizer step as mt pretrain runs
    it: ``ZeroOptimizer.step`` (one process: gradient norm, clipping, fused AdamW on the
    fp32 pieces, releasing the gradients) around fused AdamW, timed without the backward
    that produces the gradients."""
    def step_time(numel: int, count: int) -> float:
        model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(numel))
                                       for _ in range(count))
        opt = ZeroOptimizer(model, lambda groups: torch.optim.AdamW(
            groups, lr=1e-4, weight_decay=0.1, fused=True), None,
            ZeroConfig(stage=1, clip_grad=1.0))
        times = []
        for _ in range(8):
            opt.backward(sum(p.sum() for p in model))
            start = time.thread_time()
            opt.step()
            times.append(time.thread_time() - start)
        return statistics.median(times[1:])
    big = 2**21
    per_param = step_time(big, 1) / big
    small = step_time(16, 64) / 64
    return 1.0 / per_param, max(0.0, small - 16 * per_param)


def _comm_costs(bucket: int, compute_s: float, tp_message: int = 0, tp: int = 1,
                sp: bool = False, unit: int = 0
                ) -> tuple[float, float, float, float, float, float, float, float]:
    """(all-reduce bus bandwidth bytes/s, fixed cost of a small message s, fixed cost of a
    bucket-sized one s, all-gather scratch per output byte, fixed cost of a TP collective
    of ``tp_message`` elements over ``tp`` ranks (:func:`_tp_latency`; 0 with ``tp`` 1),
    a collective's speed under compute (:func:`_rate_under_compute`), the bus bandwidth
    of an all-reduce of ``unit`` elements (ZeRO-3's largest gather, the stage's rest: on
    gloo a few MB move at about half the rate of the bucket's tens of MB; 0 with ``unit``
    0), the fixed cost of a one-element all-reduce repeated back to back (collectives the
    ranks reach in step: ZeRO-3's per-unit gathers and reductions)).
    Bandwidth is the line through
    two back-to-back all-reduces of ``bucket`` elements (the model's DP bucket) and of a
    size 4x apart. The fixed costs are timed as a step meets them: after ``compute_s`` of
    matmuls on every rank (the run's compute between its gradient collectives), two bucket
    all-reduces (the gradients, the updated weights), then three one-element ones (loss,
    norm, flag), each pattern against the compute alone; on gloo they grow with the compute
    before them (rank skew, waking its threads): two ranks computing ~60 ms paid ~3 ms per
    1 MB all-reduce and ~1.5 ms per tiny one, 5-15x their back-to-back times."""
    world = dist.get_world_size()
    tiny = torch.zeros(1)
    back_to_back = _median_time(lambda: dist.all_reduce(tiny), 41, clock=time.perf_counter,
                                average=statistics.mean)
    sizes = (bucket, bucket * 4 if bucket <= 2**22 else bucket // 4)
    seconds = []
    for n in sizes:
        data = torch.ones(n)
        seconds.append(_median_time(lambda d=data: dist.all_reduce(d), 15 if n <= 2**20 else 5,
                                    clock=time.perf_counter, average=statistics.mean))
    bus = [2.0 * (world - 1) / world * n * 4 for n in sizes]
    bandwidth = (bus[1] - bus[0]) / max(seconds[1] - seconds[0], 1e-9)
    if bandwidth <= 0:  # noise: fall back to the larger message alone
        bandwidth = max(bus) / max(max(seconds) - back_to_back, 1e-9)
    grads, small = torch.ones(bucket), torch.zeros(3)
    square = torch.ones(192, 192)
    one = _median_time(lambda: torch.mm(square, square), 9)
    count = max(1, round(compute_s / max(one, 1e-7)))

    def compute() -> None:
        for _ in range(count):
            torch.mm(square, square)

    def buckets() -> None:
        compute()
        dist.all_reduce(grads)
        dist.all_reduce(grads)

    def with_small() -> None:
        buckets()
        for _ in range(3):
            dist.all_reduce(small)

    repeats = max(5, min(15, int(0.6 / max(compute_s, 1e-3))))
    wall = {"clock": time.perf_counter, "average": statistics.mean}
    alone = _median_time(compute, repeats, **wall)
    two = _median_time(buckets, repeats, **wall)
    five = _median_time(with_small, repeats, **wall)
    latency = max(back_to_back, (five - two) / 3)
    bulk = max(latency, (two - alone) / 2 - bus[0] / bandwidth)
    out = torch.ones(2**23)  # 32 MiB, touched: only new memory raises the peak RSS
    shard = torch.ones(out.numel() // world)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with warnings.catch_warnings():  # the deprecation of the name, not of what it does
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(out, shard)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024.0
    # After the scratch (the peak RSS is a high-water mark: gloo's buffers of these would
    # hide the all-gather's).
    tp_latency = _tp_latency(tp_message, tp, sp, bandwidth, compute_s) if tp > 1 else 0.0
    rate = _rate_under_compute(grads, seconds[0], square, one)
    unit_bw = 0.0
    if unit:
        data = torch.ones(unit)
        took = _median_time(lambda: dist.all_reduce(data), 7, clock=time.perf_counter,
                            average=statistics.mean)
        unit_bw = 2.0 * (world - 1) / world * unit * 4 / max(took - back_to_back, 1e-9)
    return (bandwidth, latency, bulk, min(2.0, max(0.0, grown / (out.numel() * 4))),
            tp_latency, rate, unit_bw, back_to_back)


def _rate_under_compute(data: torch.Tensor, alone: float, square: torch.Tensor,
                        one: float) -> float:
    """How fast an all-reduce of ``data`` (``alone`` seconds by itself) progresses while
    its rank computes, as a share of its speed alone: launched asynchronously, then
    matmuls for about ``alone`` seconds (``one`` each), then waited for; what it had left
    at the wait is what the compute kept from it."""
    count = max(1, round(alone / max(one, 1e-7)))
    rates = []
    for _ in range(7):
        dist.barrier()
        work = dist.all_reduce(data, async_op=True)
        began = time.perf_counter()
        for _ in range(count):
            torch.mm(square, square)
        computed = time.perf_counter() - began
        work.wait()
        left = time.perf_counter() - began - computed
        rates.append((alone - left) / max(computed, 1e-9))
    return min(1.0, max(0.05, statistics.median(rates)))


def _tp_latency(message: int, tp: int, sp: bool, bandwidth: float, compute_s: float) -> float:
    """Fixed seconds of a tensor-parallel collective of ``message`` elements (a layer's
    activation) over groups of ``tp`` consecutive ranks, as a layer meets them: each after
    a slice of matmuls, all-gathers alternating with reduce-scatters (``sp``) or
    all-reduces, against the matmuls alone, less the bytes at ``bandwidth`` (on gloo a
    reduce-scatter costs as much as an all-reduce)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(g, g + tp))) for g in range(0, world, tp)]
    group = groups[rank // tp]
    shard = torch.ones(max(1, message // tp))
    full = torch.ones(shard.numel() * tp)
    square = torch.ones(128, 128)
    one = _median_time(lambda: torch.mm(square, square), 9)
    count = max(1, round(min(2e-3, max(2e-4, compute_s / 64)) / max(one, 1e-7)))
    n = 16

    def matmuls() -> None:
        for _ in range(count):
            torch.mm(square, square)

    def layer() -> None:
        for i in range(n):
            matmuls()
            if not sp:
                dist.all_reduce(full, group=group)
            elif i % 2:
                dist.reduce_scatter_tensor(shard, full, group=group)
            else:
                dist.all_gather_into_tensor(full, shard, group=group)

    def alone() -> None:
        for _ in range(n):
            matmuls()

    wall = {"clock": time.perf_counter, "average": statistics.mean}
    with warnings.catch_warnings():  # the deprecation of the names, not of what they do
        warnings.simplefilter("ignore", FutureWarning)
        each = (_median_time(layer, 5, **wall) - _median_time(alone, 5, **wall)) / n
    moved = (1 if sp else 2) * (tp - 1) / tp * full.numel() * 4
    return max(0.0, each - moved / bandwidth)


def _measure(gpt: GPTConfig, rows: int, step_rows: int, tp: int = 1, sp: bool = False
             ) -> dict[str, float]:
    """One rank's measurements of this machine (runs in every rank at the same time);
    ``tp`` and ``sp``: the layout's tensor parallelism, whose collectives are timed too."""
    torch.manual_seed(dist.get_rank())
    start = _threads()
    # Elementwise bandwidth: x + y into a reused output (16 MiB operands, past the caches;
    # activations of this size come back from the allocator's free lists).
    x, y, z = torch.randn(2**22), torch.randn(2**22), torch.empty(2**22)
    add = _median_time(lambda: torch.add(x, y, out=z), 9)
    # First touch of a fresh large buffer (page faults), beyond writing a reused one.
    big = torch.empty(2**23)
    fresh = _median_time(lambda: torch.empty(2**23).fill_(1.0), 7)
    reuse = _median_time(lambda: big.fill_(1.0), 7)
    bucket = min(count_parameters(gpt), bucket_numel())  # tiny: the whole model is one
    flops = _matmul_flops(gpt, rows)
    # The compute a rank does between two steps' gradient collectives: 6 FLOPs per
    # parameter and token of its step at the measured GEMM rate (at most 50 ms).
    compute_s = min(0.05, 6.0 * count_parameters(gpt) * step_rows / flops)
    # ZeRO-3's largest gather: the stage's rest (embedding, positions, final norm, head).
    rest = (gpt.vocab_size * gpt.hidden * (1 if gpt.tied_embeddings else 2) // tp
            + (gpt.seq_len * gpt.hidden if gpt.position == "learned" else 0) + 2 * gpt.hidden)
    bandwidth, latency, bulk, scratch, tp_latency, rate, unit_bw, stepped = _comm_costs(
        bucket, compute_s, rows * gpt.hidden, tp, sp, rest)
    adam, tensor = _adam_costs()
    rates = {"peak_flops": flops, "memory_bytes_per_s": 3 * x.numel() * 4 / add,
             "alloc_bytes_per_s": big.numel() * 4 / max(fresh - reuse, 1e-6),
             "nvlink_bytes_per_s": bandwidth, "link_latency_s": latency,
             "bulk_latency_s": bulk, "stepped_latency_s": stepped,
             "tp_latency_s": tp_latency,
             "comm_rate_under_compute": rate, "gather_scratch": scratch,
             "gather_bytes_per_s": unit_bw,
             "optimizer_params_per_s": adam,
             "tensor_overhead_s": tensor}
    layer, head = _model_overheads(gpt, rows // gpt.seq_len, rates)
    end = _threads()
    return {"share": _share(start, end), **rates, "layer_overhead_s": layer,
            "head_overhead_s": head}


def _cpu_spec(gpt: GPTConfig, rows: int, ranks: int, step_rows: int, tp: int = 1,
              sp: bool = False) -> dict[str, float]:
    """This CPU as one of ``ranks`` concurrent 1-thread ranks sees it (median over ranks);
    ``rows`` tokens per micro-batch, ``step_rows`` per rank and step; ``tp``, ``sp``: the
    layout's tensor parallelism."""
    results = run_distributed(_measure, max(ranks, 2), gpt, rows, step_rows, tp, sp,
                              timeout=600.0)
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


# The training framework's own costs, per step, per micro-batch and per parameter tensor.
_FRAMEWORK = ("step_overhead_s", "micro_batch_overhead_s", "param_overhead_s")

# Compute figures (per CPU second) that the run's core share scales; the gloo figures are
# wall-clock already, measured under the load of the moment.
_RATES = ("peak_flops", "memory_bytes_per_s", "optimizer_params_per_s", "alloc_bytes_per_s")
_TIMES = ("layer_overhead_s", "head_overhead_s", "tensor_overhead_s", *_FRAMEWORK)


def _spec_of(figures: dict[str, float]) -> GPUSpec:
    """A GPUSpec of this CPU (one thread) from measured figures (GPUSpec field names;
    ``nvlink_bytes_per_s`` is gloo's bandwidth, used for every link)."""
    figures = dict(figures)
    bw = figures.pop("nvlink_bytes_per_s")
    return GPUSpec("cpu-1-thread", memory_bytes=24 * 2**30, nvlink_bytes_per_s=bw,
                   ib_bytes_per_s=bw, gpus_per_node=2, fused_attention=True,
                   gather_via_all_reduce=True, **figures)


def _spec(parts: list[dict[str, float]], run_share: float,
          framework: dict[str, float] | None = None) -> GPUSpec:
    """The GPUSpec of the mean of calibrations (before and after a run) for ranks that get
    ``run_share`` of a core while runnable: the compute figures are per CPU second, and
    other jobs on the cores stretch every second of a rank's compute by ``1 / run_share``.
    ``framework``: the framework costs (CPU seconds, :func:`_framework`), else 0."""
    mean = {k: statistics.mean(p[k] for p in parts) for k in parts[0]}
    mean.pop("share")
    mean.update(framework or {})
    spec = _spec_of(mean)
    scaled = {k: getattr(spec, k) * run_share for k in _RATES}
    scaled.update({k: getattr(spec, k) / run_share for k in _TIMES})
    return dataclasses.replace(spec, **scaled)


_LAYOUT_KEYS = ("tp", "pp", "dp", "zero_stage", "schedule", "virtual_stages", "precision",
                "sequence_parallel")


def _micro(overrides: dict[str, Any], layers_per_stage: int, micro_batches: int
           ) -> dict[str, Any]:
    """A micro model (hidden 16, 2 heads or one per TP rank, sequence 8, the tokenizer's
    1000-word vocabulary) at the run's layout (same TP / PP / DP / ZeRO, sequence
    parallelism), ``micro_batches`` of one sequence per rank and step: its compute is
    negligible, its step time is mostly fixed costs."""
    pp, dp = overrides.get("pp", 1), overrides.get("dp", 1)
    heads = max(2, overrides.get("tp", 1))
    return {"model": "tiny", "n_layers": layers_per_stage * pp, "hidden": 16, "n_heads": heads,
            "seq_len": 8, "micro_batch_size": 1, "global_batch_size": dp * micro_batches,
            "train_steps": 60, **{k: v for k, v in overrides.items() if k in _LAYOUT_KEYS}}


def _nonnegative_solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Least-squares ``x >= 0`` of ``a x = b`` (every subset of free unknowns is tried:
    there are three)."""
    import itertools

    n = len(a[0])
    best: tuple[float, list[float]] = (float("inf"), [0.0] * n)
    for k in range(n + 1):
        for free in itertools.combinations(range(n), k):
            x = [0.0] * n
            if free:
                sub = torch.tensor([[row[j] for j in free] for row in a], dtype=torch.float64)
                sol = torch.linalg.lstsq(sub, torch.tensor(b, dtype=torch.float64)[:, None])
                for j, v in zip(free, sol.solution[:, 0].tolist()):
                    x[j] = v
            if min(x) < 0:
                continue
            res = sum((sum(r[j] * x[j] for j in range(n)) - y) ** 2 for r, y in zip(a, b))
            if res < best[0] - 1e-18:
                best = (res, x)
    return best[1]


def _framework(overrides: dict[str, Any], workdir: Path) -> dict[str, float]:
    """CPU seconds of the framework per step, per micro-batch and per parameter tensor at
    this layout: three real `mt pretrain` runs of the micro model (1 layer per stage, one
    micro-batch; 5 layers per stage; 4 micro-batches), each one's measured step time minus
    what the estimator already models (its compute, messages, Adam and per-layer costs on
    the micro model's own calibration); the three residuals give the three costs
    (non-negative least squares, each run's sensitivity to a cost taken from the estimator
    itself, so the pipeline schedule decides how a per-micro-batch cost adds up)."""
    rows, rhs = [], []
    # The micro model's own calibration (``parts`` are the benchmarked model's): its layer
    # and head costs, and gloo's fixed costs after its own (tiny) compute per step.
    micro_gpt, micro_layout = _layout(_micro(overrides, 1, 1))
    micro_rows = micro_layout.micro_batch * micro_gpt.seq_len
    parts = [_cpu_spec(micro_gpt, micro_rows, micro_layout.world_size, micro_rows,
                       micro_layout.tp, micro_layout.sequence_parallel)]
    layer, head = parts[0]["layer_overhead_s"], parts[0]["head_overhead_s"]
    for layers, micro in ((1, 1), (5, 1), (1, 4)):
        over = _micro(overrides, layers, micro)
        gpt, layout = _layout(over)
        _, tps, share, _ = _run(over, workdir)
        step = layout.global_batch * gpt.seq_len / tps
        spec = _spec(parts, share)
        base = estimate(gpt, layout, spec, efficiency=1.0).iteration_time_s
        # A cost of c CPU seconds takes c / share wall seconds at this run's core share.
        rows.append([(estimate(gpt, layout, dataclasses.replace(spec, **{k: 1e-3 / share}),
                               efficiency=1.0).iteration_time_s - base) / 1e-3
                     for k in _FRAMEWORK])
        rhs.append(step - base)
        print(f"    framework run ({layers} layer(s) per stage, {micro} micro-batch(es)): step "
              f"{step * 1e3:.1f} ms measured, {base * 1e3:.1f} ms modelled without framework "
              f"costs (core share {share:.2f}; micro layer {layer * 1e3:.2f} ms, head "
              f"{head * 1e3:.2f} ms)", flush=True)
    return dict(zip(_FRAMEWORK, _nonnegative_solve(rows, rhs)))


def _layout(overrides: dict[str, Any]) -> tuple[Any, ParallelLayout]:
    """The model and the estimator's layout of a run (as `mt pretrain --dry-run` builds it)."""
    config = load_config(None, overrides)
    par = config.parallel
    plan = resolve(config, par.tp * par.pp * (par.dp or 1))
    return plan.gpt, plan.layout


def _pct(pred: float, meas: float) -> str:
    return f"{100 * (pred / meas - 1):+.0f}%"


def _load() -> str:
    return "load " + "/".join(f"{x:.1f}" for x in os.getloadavg())


def _case(name: str, lname: str, overrides: dict[str, Any], runtime: float,
          workdir: Path, framework: dict[str, dict[str, float]]) -> None:
    """Calibrate, run, calibrate again (and the framework costs of this layout, once per
    layout, kept in ``framework``); print one row and the calibration."""
    gpt, layout = _layout(overrides)
    rows = layout.micro_batch * gpt.seq_len
    # Tokens a rank computes per step, over the pipeline stages (the compute between the
    # step's collectives).
    step_rows = layout.global_batch // layout.dp * gpt.seq_len // layout.pp
    tp_sp = (layout.tp, layout.sequence_parallel)
    before = _cpu_spec(gpt, rows, layout.world_size, step_rows, *tp_sp)
    rss, tps, share, exposed = _run(overrides, workdir, trace=True)
    # Load from other jobs drifts: calibrate on both sides of the run.
    after = _cpu_spec(gpt, rows, layout.world_size, step_rows, *tp_sp)
    if lname not in framework:
        framework[lname] = _framework(overrides, workdir)
    spec = _spec([before, after], share, framework[lname])
    est = estimate(gpt, layout, spec, efficiency=1.0)
    pred_mem = est.memory_per_gpu_gb * 1e9 + runtime
    part = rss - runtime
    # A model part below 5% of the runtime's RSS is under the measurement noise.
    part_err = _pct(est.memory_per_gpu_gb * 1e9, part) if part > 0.05 * runtime else "n/a"
    # With pipelines a rank's blocked time includes its bubble (waiting in receives).
    comm_err = _pct(est.exposed_comm_s, exposed) if layout.pp == 1 else "n/a"
    print(f"{name + ' ' + lname:<22} {pred_mem / 2**20:>11.0f} {rss / 2**20:>8.0f} "
          f"{_pct(pred_mem, rss):>5} | {est.memory_per_gpu_gb * 1e9 / 2**20:>10.0f} "
          f"{part / 2**20:>6.0f} {part_err:>5} | {est.tokens_per_s:>10.1f} {tps:>8.1f} "
          f"{_pct(est.tokens_per_s, tps):>5} | {est.exposed_comm_s * 1e3:>8.1f} "
          f"{exposed * 1e3:>8.1f} {comm_err:>5}  {_load()}",
          flush=True)
    print(f"    calibration: matmul {spec.peak_flops / 1e9:.1f} GFLOP/s, elementwise "
          f"{spec.memory_bytes_per_s / 1e9:.1f} GB/s, layer {spec.layer_overhead_s * 1e3:.2f} "
          f"ms, head {spec.head_overhead_s * 1e3:.2f} ms, first touch "
          f"{spec.alloc_bytes_per_s / 1e9:.1f} GB/s, Adam "
          f"{spec.optimizer_params_per_s / 1e6:.0f} M params/s + "
          f"{spec.tensor_overhead_s * 1e6:.0f} us/tensor, gloo "
          f"{spec.nvlink_bytes_per_s / 1e9:.2f} GB/s + {spec.link_latency_s * 1e6:.0f} us "
          f"(bucket {spec.bulk_latency_s * 1e6:.0f} us, in step "
          f"{spec.stepped_latency_s * 1e6:.0f} us, TP {spec.tp_latency_s * 1e6:.0f} us; "
          f"{spec.comm_rate_under_compute:.2f} of its speed under compute; ZeRO-3 gathers "
          f"{spec.gather_bytes_per_s / 1e9:.2f} GB/s), "
          f"gather scratch {spec.gather_scratch:.2f}, framework "
          f"{spec.step_overhead_s * 1e3:.2f} ms/step + "
          f"{spec.micro_batch_overhead_s * 1e3:.2f} ms/micro-batch + "
          f"{spec.param_overhead_s * 1e6:.0f} us/tensor ({est.framework_time_s * 1e3:.1f} ms per "
          f"step beside the micro-batches) "
          f"(at core share {share:.2f}, per CPU "
          f"second: matmul {spec.peak_flops / share / 1e9:.1f} GFLOP/s, layer "
          f"{spec.layer_overhead_s * share * 1e3:.2f} ms); predicted memory: activations "
          f"{est.memory_activations_gb * 1e3:.0f} MB, temporaries "
          f"{est.memory_temporaries_gb * 1e3:.0f} MB; predicted step "
          f"{est.iteration_time_s * 1e3:.1f} ms = pipeline {est.pipeline_time_s * 1e3:.1f} "
          f"(bubble {est.bubble_fraction:.2f}, P2P {est.p2p_time_s * 1e3:.1f}) + DP "
          f"{est.dp_comm_time_s * 1e3:.1f} + optimizer {est.optimizer_time_s * 1e3:.1f} + "
          f"framework {est.framework_time_s * 1e3:.1f}; communication exposed "
          f"{est.exposed_comm_s * 1e3:.1f} (TP {est.tp_comm_time_s * 1e3:.1f}, DP "
          f"{est.dp_exposed_s * 1e3:.1f} of {est.dp_comm_time_s * 1e3:.1f}), hidden "
          f"{est.hidden_comm_s * 1e3:.1f}; measured "
          f"{1e3 * layout.global_batch * gpt.seq_len / tps:.1f} ms", flush=True)


def main() -> None:
    """Run every model x layout and print predicted vs measured memory and tokens/s."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS),
                        default=list(DEFAULT_LAYOUTS))
    args = parser.parse_args()
    print(f"{_load()} on {os.cpu_count()} cores (uptime load averages 1/5/15 min)")
    print(f"{'run':<22} {'mem pred MB':>11} {'meas MB':>8} {'err':>5} | {'model part':>10} "
          f"{'meas':>6} {'err':>5} | {'tok/s pred':>10} {'meas':>8} {'err':>5} | "
          f"{'comm pred':>9} {'meas ms':>8} {'err':>5}")
    framework: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model = MODELS[name]
            micro = {"micro_batch_size": model["global_batch_size"] // 4}
            base = {**model, **LAYOUTS["dp2"], **micro, "hidden": 8, "n_heads": 1}
            runtime, _, _, _ = _run(base, Path(tmp))
            print(f"  ({name}: runtime RSS {runtime / 2**20:.0f} MB)", flush=True)
            for lname in args.layouts:
                _case(name, lname, {**model, **LAYOUTS[lname], **micro}, runtime, Path(tmp),
                      framework)
    print(f"end: {_load()}")


if __name__ == "__main__":
    main()
