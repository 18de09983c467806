"""Forward and backward of every communication function, on 2 and 4 gloo ranks (float64)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from mt_dist.testing import run_distributed
from mt_tensor_parallel import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tp,
)

SHAPE = (2, 8, 12)  # [b, s, h]; s and h divisible by 2 and 4


def _tensor(seed: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _x(rank: int) -> torch.Tensor:  # a different input per rank
    return _tensor(100 + rank)


def _g(rank: int, shape: tuple[int, ...]) -> torch.Tensor:  # a different grad per rank
    return _tensor(200 + rank, shape)


MAPPINGS: dict[str, Callable[[torch.Tensor, dist.ProcessGroup | None], torch.Tensor]] = {
    "copy_to_tp": copy_to_tp,
    "reduce_from_tp": reduce_from_tp,
    "scatter_to_tp": scatter_to_tp,
    "gather_from_tp": gather_from_tp,
    "scatter_to_sequence": scatter_to_sequence,
    "gather_from_sequence": gather_from_sequence,
    "gather_from_sequence_split": lambda x, g: gather_from_sequence(x, g, reduce_grads=False),
    "reduce_scatter_to_sequence": reduce_scatter_to_sequence,
}
REPLICATED_INPUT = {"scatter_to_tp", "scatter_to_sequence"}


def _run_all() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    rank, group = dist.get_rank(), dist.group.WORLD
    results = {}
    for name, fn in MAPPINGS.items():
        x = (_tensor(100) if name in REPLICATED_INPUT else _x(rank)).requires_grad_()
        out = fn(x, group)
        out.backward(_g(rank, tuple(out.shape)))
        results[name] = (out.detach(), x.grad)
    return results


def _expected(name: str, rank: int, n: int, out_shape: tuple[int, ...]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    xs, gs = [_x(r) for r in range(n)], [_g(r, out_shape) for r in range(n)]
    full = _tensor(100)

    def part(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(n, dim=dim)[rank]

    expected = {
        "copy_to_tp": lambda: (xs[rank], sum(gs)),
        "reduce_from_tp": lambda: (sum(xs), gs[rank]),
        "scatter_to_tp": lambda: (part(full, -1), torch.cat(gs, -1)),
        "gather_from_tp": lambda: (torch.cat(xs, -1), part(gs[rank], -1)),
        "scatter_to_sequence": lambda: (part(full, 1), torch.cat(gs, 1)),
        "gather_from_sequence": lambda: (torch.cat(xs, 1), part(sum(gs), 1)),
        "gather_from_sequence_split": lambda: (torch.cat(xs, 1), part(gs[rank], 1)),
        "reduce_scatter_to_sequence": lambda: (part(sum(xs), 1), torch.cat(gs, 1)),
    }
    return expected[name]()


@pytest.mark.parametrize("world", [2, 4])
def test_tp_mappings_forward_backward(world: int) -> None:
    results = run_distributed(_run_all, world, timeout=120)
    for rank, per_rank in enumerate(results):
        assert set(per_rank) == set(MAPPINGS)
        for name, (out, grad) in per_rank.items():
            want_out, want_grad = _expected(name, rank, world, tuple(out.shape))
            torch.testing.assert_close(out, want_out, msg=f"{name} forward, rank {rank}")
            torch.testing.assert_close(grad, want_grad, msg=f"{name} backward, rank {rank}")


def test_tp_mappings_are_identity_without_group() -> None:
    x = _x(0).requires_grad_()
    for fn in MAPPINGS.values():
        out = fn(x, None)
        torch.testing.assert_close(out, x)
        (grad,) = torch.autograd.grad(out, x, _g(0, SHAPE))
        torch.testing.assert_close(grad, _g(0, SHAPE))
