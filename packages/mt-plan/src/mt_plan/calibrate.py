"""Measure this machine at a model's shapes: the rates ``mt plan --calibrate`` stores.

A data sheet gives a GPU's peak; a run reaches less, by amounts that depend on the shapes
(a GEMM of 2048 columns is not one of 50,000), on the direction (the weight gradient's
transposed layout), on the attention kernel and on the memory system. :func:`measure` times,
on this process's device and in the run's precision, the kernels one transformer layer and
the head run per micro-batch on one tensor-parallel rank:

- the block's matmuls and the head (``F.linear`` forward, then its data and weight
  gradients), weighted by how often each runs per iteration (every layer, the head once);
- causal scaled-dot-product attention, forward and backward, in the FLOPs the estimator
  counts for it (:func:`mt_plan.estimate.attention_flops`);
- elementwise bandwidth (an out-of-place add over a large buffer: two reads, one write);
- the optimizer step (fused AdamW over fp32 master weights, as ``mt pretrain`` runs it).

:func:`calibrated` puts the figures into a :class:`~mt_plan.gpus.GPUSpec` (the data sheet's
capacity and links stay), :func:`write_calibration` stores it as YAML that ``--gpu FILE``
reads back. Nothing here is fitted to a training run: each figure is one kernel's rate.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from mt_model import GPTConfig
from mt_plan.estimate import attention_flops
from mt_plan.gpus import GPUSpec
from mt_zero.precision import compute_dtype

__all__ = ["block_linear_shapes", "calibrated", "measure", "write_calibration"]


def block_linear_shapes(gpt: GPTConfig, tp: int) -> list[tuple[int, int, int]]:
    """(in features, out features, uses per iteration) of the matmuls one tensor-parallel
    rank runs: the block's four linears (column-parallel outputs and row-parallel inputs
    split over ``tp``; SwiGLU's fused gate + up projection counts twice the width) once per
    layer, and the output head (vocabulary split over ``tp``) once."""
    h, f, kv = gpt.hidden, gpt.ffn_hidden, gpt.n_kv_heads * gpt.head_dim
    fc = 2 * f if gpt.mlp == "swiglu" else f
    n = gpt.n_layers
    return [(h, (h + 2 * kv) // tp, n), (h // tp, h, n), (h, fc // tp, n), (f // tp, h, n),
            (h, -(-gpt.vocab_size // tp), 1)]


def _timer(device: Any) -> Callable[[Callable[[], object], int], float]:
    import torch

    def median_seconds(fn: Callable[[], object], repeats: int) -> float:
        fn()  # warm-up (kernel selection, first touch of the outputs)
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return median_seconds


def measure(gpt: GPTConfig, micro_batch: int, tp: int = 1, precision: str = "bf16",
            device: str | None = None, repeats: int = 5) -> dict[str, float]:
    """Rates of this device at ``gpt``'s shapes for one micro-batch on one of ``tp`` ranks.

    Returns ``gemm_fwd_tflops``, ``gemm_bwd_tflops``, ``attention_fwd_tflops``,
    ``attention_bwd_tflops``, ``memory_bandwidth_gb_per_s`` and
    ``optimizer_gparams_per_s`` (the YAML keys of :func:`mt_plan.gpus.load_gpu`).
    """
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = compute_dtype(precision)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype, generator=gen)

    seconds = _timer(dev)
    out = _gemm_rates(gpt, micro_batch, tp, rand, seconds, repeats)
    out.update(_attention_rates(gpt, micro_batch, tp, rand, seconds, repeats))
    # Elementwise: out = a + b moves three buffers of the run's width.
    numel = (1 << 28 if dev.type == "cuda" else 1 << 24) // 4
    a, b = rand(numel), rand(numel)
    c = torch.empty_like(a)
    add_s = seconds(lambda: torch.add(a, b, out=c), repeats)
    out["memory_bandwidth_gb_per_s"] = 3.0 * numel * a.element_size() / add_s / 1e9
    out["optimizer_gparams_per_s"] = _adamw_rate(gpt, tp, dev, seconds, repeats) / 1e9
    return out


def _gemm_rates(gpt: GPTConfig, micro_batch: int, tp: int, rand: Callable[..., Any],
                seconds: Callable[[Callable[[], object], int], float],
                repeats: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    rows = micro_batch * gpt.seq_len
    flops = fwd_s = bwd_s = 0.0
    with torch.no_grad():
        for n_in, n_out, uses in block_linear_shapes(gpt, tp):
            x, w, dy = rand(rows, n_in), rand(n_out, n_in), rand(rows, n_out)
            flops += 2.0 * rows * n_in * n_out * uses
            fwd_s += seconds(lambda x=x, w=w: F.linear(x, w), repeats) * uses
            bwd_s += seconds(lambda x=x, w=w, dy=dy: (dy @ w, dy.t() @ x), repeats) * uses
    return {"gemm_fwd_tflops": flops / fwd_s / 1e12, "gemm_bwd_tflops": 2 * flops / bwd_s / 1e12}


def _attention_rates(gpt: GPTConfig, micro_batch: int, tp: int, rand: Callable[..., Any],
                     seconds: Callable[[Callable[[], object], int], float],
                     repeats: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    heads = max(1, gpt.n_heads // tp)
    q, k, v = (rand(micro_batch, heads, gpt.seq_len, gpt.head_dim).requires_grad_()
               for _ in range(3))
    dout = rand(micro_batch, heads, gpt.seq_len, gpt.head_dim)

    def attention() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    fwd_s = seconds(lambda: attention().detach(), repeats)
    both_s = seconds(lambda: torch.autograd.grad(attention(), (q, k, v), dout), repeats)
    a_fwd, a_bwd = (x / tp for x in attention_flops(gpt, micro_batch, fused=True))
    return {"attention_fwd_tflops": a_fwd / fwd_s / 1e12,
            "attention_bwd_tflops": a_bwd / max(both_s - fwd_s, 1e-9) / 1e12}


def _adamw_rate(gpt: GPTConfig, tp: int, dev: Any,
                seconds: Callable[[Callable[[], object], int], float], repeats: int) -> float:
    """Parameters per second of fused AdamW on fp32 masters in two layers' tensors."""
    import torch

    gen = torch.Generator(device=dev).manual_seed(1)
    sizes = [gpt.hidden * n_out for _, n_out, _ in block_linear_shapes(gpt, tp)[:4]] * 2
    params = [torch.zeros(n, device=dev, requires_grad=True) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, device=dev, generator=gen)
    adamw = torch.optim.AdamW(params, lr=1e-4, fused=True)
    return sum(sizes) / seconds(adamw.step, repeats)


def calibrated(base: GPUSpec, rates: dict[str, float], name: str | None = None) -> GPUSpec:
    """``base`` (capacity, links, peak) with the measured ``rates`` of :func:`measure`."""
    return replace(
        base, name=name or f"{base.name} (calibrated)",
        gemm_fwd_flops=rates["gemm_fwd_tflops"] * 1e12,
        gemm_bwd_flops=rates["gemm_bwd_tflops"] * 1e12,
        attention_fwd_flops=rates["attention_fwd_tflops"] * 1e12,
        attention_bwd_flops=rates["attention_bwd_tflops"] * 1e12,
        memory_bytes_per_s=rates["memory_bandwidth_gb_per_s"] * 1e9,
        optimizer_params_per_s=rates["optimizer_gparams_per_s"] * 1e9, fused_attention=True)


def write_calibration(path: Path, spec: GPUSpec, rates: dict[str, float],
                      about: dict[str, Any]) -> None:
    """Store ``spec`` with its measured ``rates`` as YAML that :func:`load_gpu` reads
    (written to a temporary file, then renamed: never half a file); ``about`` (device,
    model, shapes) is kept under ``calibration`` for the reader."""
    import yaml

    data: dict[str, Any] = {
        "name": spec.name, "peak_tflops": spec.peak_flops / 1e12,
        "memory_gb": spec.memory_bytes / 1e9, "nvlink_gb_per_s": spec.nvlink_bytes_per_s / 1e9,
        "ib_gb_per_s": spec.ib_bytes_per_s / 1e9, "gpus_per_node": spec.gpus_per_node,
        **{k: float(f"{v:.6g}") for k, v in rates.items()}, "fused_attention": True,
        "calibration": {**about, "date": datetime.date.today().isoformat()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written temporary file
        raise
