"""Model FLOPs utilization: achieved model FLOP/s per rank against the device's peak.

The peak is given (``--peak-tflops``, per rank, e.g. 312 for an A100 in bf16) or measured
once at start by a short matmul probe in the run's compute dtype on the rank's device:
square matmuls of growing size, about 0.1-0.3 s on a CPU core whatever the dtype. The
probe's number is the machine's practical matmul rate, not a datasheet peak, and on an
oversubscribed CPU (more ranks than cores) it is only indicative.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["measure_peak_flops", "model_flops_utilization"]


def measure_peak_flops(dtype: torch.dtype, device: torch.device, size: int = 1024,
                       repeats: int = 3, budget_s: float | None = 0.05) -> float:
    """Best FLOP/s of ``repeats`` timed square matmuls (after one warm-up) at the largest
    size up to ``size`` where one matmul takes at most ``budget_s``: the probe starts at 128
    and doubles while the next size would stay within it. A dtype without a fast kernel (fp16
    on most CPUs: about 1 GFLOP/s, where 1024 x 1024 took 8 s to probe) stops small; a fast
    one reaches ``size``. ``budget_s=None``: exactly ``size``."""
    if size < 1 or repeats < 1:
        raise ValueError(f"size {size} and repeats {repeats} must be >= 1")
    n = size if budget_s is None else min(128, size)
    while True:
        rate = _matmul_rate(dtype, device, n, repeats)
        if budget_s is None or n >= size or 2.0 * (2 * n) ** 3 / rate > budget_s:
            return rate
        n = min(2 * n, size)


def _matmul_rate(dtype: torch.dtype, device: torch.device, n: int, repeats: int) -> float:
    import torch  # here: planning without a run never loads it

    gen = torch.Generator().manual_seed(0)  # the probe must not move the training RNG
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
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
    return 2.0 * n**3 / max(best, 1e-9)


def model_flops_utilization(flops_per_s_per_rank: float, peak_flops_per_rank: float) -> float:
    """Fraction (0..1 in practice) of the peak that the model FLOPs use; NaN without a
    positive peak."""
    if not peak_flops_per_rank > 0:
        return float("nan")
    return flops_per_s_per_rank / peak_flops_per_rank
