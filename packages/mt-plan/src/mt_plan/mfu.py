"""Model FLOPs utilization: achieved model FLOP/s per rank against the device's peak.

The peak is given (``--peak-tflops``, per rank, e.g. 312 for an A100 in bf16) or measured
once at start by a short matmul probe in the run's compute dtype on the rank's device:
a few square matmuls, about 0.1-0.3 s on a CPU core. The probe's number is the machine's
practical matmul rate, not a datasheet peak, and on an oversubscribed CPU (more ranks than
cores) it is only indicative.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["measure_peak_flops", "model_flops_utilization"]


def measure_peak_flops(dtype: torch.dtype, device: torch.device, size: int = 1024,
                       repeats: int = 3) -> float:
    """Best FLOP/s of ``repeats`` timed ``size`` x ``size`` matmuls (after one warm-up)."""
    if size < 1 or repeats < 1:
        raise ValueError(f"size {size} and repeats {repeats} must be >= 1")
    import torch  # here: planning without a run never loads it

    gen = torch.Generator().manual_seed(0)  # the probe must not move the training RNG
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first one warms up kernels and caches
            best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9)


def model_flops_utilization(flops_per_s_per_rank: float, peak_flops_per_rank: float) -> float:
    """Fraction (0..1 in practice) of the peak that the model FLOPs use; NaN without a
    positive peak."""
    if not peak_flops_per_rank > 0:
        return float("nan")
    return flops_per_s_per_rank / peak_flops_per_rank
