"""The ZeRO paper's per-rank memory model for mixed-precision Adam (Rajbhandari et al. 2020).

With Ψ parameters, N data-parallel ranks and K bytes of optimizer state per parameter
(K = 12 for Adam: fp32 master weights, momentum and variance), each rank holds

=======  ==========================  =====================================
stage    bytes per rank              (params + grads + optimizer state)
=======  ==========================  =====================================
0        (2 + 2 + K) Ψ               everything replicated
1        (2 + 2) Ψ + K Ψ / N         optimizer state sharded
2        2 Ψ + (2 + K) Ψ / N         + gradients sharded
3        (2 + 2 + K) Ψ / N           + parameters sharded
=======  ==========================  =====================================

With fp32 main gradients (mt-zero's default for 16-bit parameters) a gradient takes 4 bytes
instead of 2: ``grad_bytes=4``.
"""

from __future__ import annotations

__all__ = ["paper_bytes"]


def paper_bytes(psi: int, n: int, stage: int, k: int = 12,
                grad_bytes: int = 2) -> dict[str, float]:
    """Expected bytes per rank, split into ``params``, ``grads``, ``optimizer`` and ``total``
    (``grad_bytes`` per gradient element: 2 in the paper, 4 for fp32 main gradients)."""
    if psi < 0 or n < 1 or stage not in (0, 1, 2, 3):
        raise ValueError(f"need psi {psi} >= 0, n {n} >= 1 and stage {stage} in 0..3")
    params = 2.0 * psi / (n if stage >= 3 else 1)
    grads = float(grad_bytes) * psi / (n if stage >= 2 else 1)
    optimizer = float(k) * psi / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer,
            "total": params + grads + optimizer}
