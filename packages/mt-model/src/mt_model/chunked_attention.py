"""Causal attention of a few runs of a sequence's queries over the whole sequence's keys,
without a mask: the attention a context-parallel rank computes.

A run of queries at positions ``[a, b)`` sees the keys before it in full and its own keys
causally. Each part is one fused attention call (no mask: the first unmasked, the second
``is_causal`` on a square block), and the two are merged by their log-sum-exps, as blockwise
(ring, flash) attention does: ``out = (o1 e^l1 + o2 e^l2) / (e^l1 + e^l2)``. Backward calls the
kernel's own backward on each part with the *merged* output and log-sum-exp, which gives each
part's exact share of the gradient. The merge runs in float64: its weights ``e^(l - L)`` in
float32 are off by an ulp of ``l`` (measured at CP 4 over 10 steps of the contract matrix:
parameters 1.15e-5 from one process, 8.4e-6 with the float64 merge). A float mask of the same
attention ([s / cp, s] float32, which torch's CPU kernel builds from a boolean one and keeps
for backward, per layer: 512 MiB at 16k tokens on 2 ranks) is never made, and the masked-out
half of the scores is never computed.

On CPU the kernel is torch's fused one (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward); elsewhere, and for attention dropout (whose masks only the unfused kernel draws),
:func:`chunked_causal_attention` computes the same attention with a boolean mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["chunked_causal_attention", "fused_path"]

Runs = tuple[tuple[int, int], ...]


def fused_path(device: torch.device, dropout: float) -> bool:
    """Whether :func:`chunked_causal_attention` merges fused calls (else: one masked call)."""
    return device.type == "cpu" and dropout == 0.0


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dimension contiguous: the fused CPU kernel reads the head dimension
    so and gives wrong numbers otherwise (torch's front-end ensures it before calling it; a
    projection computed without grad can come out transposed)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key / value heads [b, m, s, d] repeated for ``heads`` query heads (grouped-query)."""
    m = t.shape[1]
    return t if m == heads else t.repeat_interleave(heads // m, dim=1)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: each key / value head's query heads summed."""
    b, heads, s, d = t.shape
    return t if heads == kv_heads else t.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


class _ChunkedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                runs: Runs) -> torch.Tensor:
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
        heads = q.shape[1]
        kx, vx = _expand(k, heads), _expand(v, heads)
        outs, lses, offset = [], [], 0
        for start, end in runs:
            qc = q[:, :, offset:offset + end - start]
            out, lse = kernel(qc, kx[:, :, start:end], vx[:, :, start:end], 0.0, True)
            if start > 0:  # the keys before the run, in full
                before, lse_before = kernel(qc, kx[:, :, :start], vx[:, :, :start], 0.0, False)
                lse, lse_before = lse.double(), lse_before.double()
                merged = torch.logaddexp(lse, lse_before)
                out = (out.double() * torch.exp(lse - merged).unsqueeze(-1)
                       + before.double() * torch.exp(lse_before - merged).unsqueeze(-1))
                lse = merged.float()
            outs.append(out.to(q.dtype))
            lses.append(lse)
            offset += end - start
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.runs = runs
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k, v, out, lse = ctx.saved_tensors
        heads = q.shape[1]
        kx, vx = _expand(k, heads), _expand(v, heads)
        grad = grad.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(kx.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(vx.shape, dtype=torch.float32, device=v.device)
        offset = 0
        for start, end in ctx.runs:
            rows = slice(offset, offset + end - start)
            g, qc, oc, lc = grad[:, :, rows], q[:, :, rows], out[:, :, rows], lse[:, :, rows]
            # Each part with the merged output and log-sum-exp: its exact share.
            parts = [(slice(start, end), True)] + ([(slice(0, start), False)] if start else [])
            for keys, causal in parts:
                gq, gk, gv = kernel(g, qc, kx[:, :, keys], vx[:, :, keys], oc, lc, 0.0, causal)
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
            offset += end - start
        kv_heads = k.shape[1]
        return (dq.to(q.dtype), _fold(dk, kv_heads).to(k.dtype),
                _fold(dv, kv_heads).to(v.dtype), None)


def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             runs: Sequence[tuple[int, int]], dropout: float = 0.0
                             ) -> torch.Tensor:
    """Causal attention of queries ``q`` [b, n, L, d] at the positions of ``runs`` (their
    [start, end) ranges, in the order of ``q``'s rows, lengths summing to L) over the whole
    sequence's keys and values ``k``, ``v`` [b, m, S, d] in position order (m dividing n:
    grouped-query heads). ``dropout``: attention dropout (the unfused, masked kernel)."""
    runs = tuple((int(a), int(b)) for a, b in runs)
    if sum(b - a for a, b in runs) != q.shape[2] or any(
            not 0 <= a < b <= k.shape[2] for a, b in runs):
        raise ValueError(f"runs {runs} do not cover the {q.shape[2]} queries within "
                         f"{k.shape[2]} keys")
    if fused_path(q.device, dropout):
        return _ChunkedCausal.apply(q, k, v, runs)
    rows = torch.cat([torch.arange(a, b, device=q.device) for a, b in runs])
    keys = torch.arange(k.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keys[None, :] <= rows[:, None],
                                          dropout_p=dropout, enable_gqa=k.shape[1] != q.shape[1])
