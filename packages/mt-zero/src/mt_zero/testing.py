"""A tiny language model, data and plain-torch reference training loops for tests.

Shared by this package's tests and cross-package tests; not used by the library itself.
The model has what matters for ZeRO: an embedding tied to the output projection (used
outside any block), LayerNorms and biases (1-D, no weight decay), blocks in a ModuleList
(stage-3 units).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mt_zero.param_groups import decay_param_groups

__all__ = ["TinyLM", "make_batches", "reference_train"]

Batch = tuple[torch.Tensor, torch.Tensor]


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """Embedding -> residual MLP blocks -> LayerNorm -> tied output projection -> loss."""

    def __init__(self, vocab: int = 32, hidden: int = 16, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_Block(hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
                elif "ln" in name and name.endswith("weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross entropy (computed in fp32 whatever the parameter dtype)."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.embed.weight).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 1) -> list[Batch]:
    """``steps`` random (tokens, targets) batches of shape [batch, seq]."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=gen),
             torch.randint(0, vocab, (batch, seq), generator=gen)) for _ in range(steps)]


def reference_train(
    model: nn.Module,
    batches: Sequence[Batch],
    precision: str = "fp32",
    lr: float = 1e-2,
    weight_decay: float = 0.1,
    clip_grad: float = 0.0,
    micro_batches: int = 1,
    main_grads: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process AdamW training; returns losses and final fp32 (master) parameters.

    ``bf16`` keeps fp32 master copies and runs forward/backward with bf16 parameters, the
    textbook mixed-precision recipe, written independently of the ZeRO code. With
    ``micro_batches`` > 1 each batch is split into that many equal parts whose gradients
    accumulate (in the compute dtype; in fp32 with ``main_grads``): the same step summed in
    another order, which gives the noise floor of a precision.
    """
    threads = torch.get_num_threads()
    # Tiny tensors: extra threads only add overhead (10x here on 2 busy cores).
    torch.set_num_threads(1)
    try:
        return _train(model, batches, precision, lr, weight_decay, clip_grad, micro_batches,
                      main_grads)
    finally:
        torch.set_num_threads(threads)


def _train(
    model: nn.Module,
    batches: Sequence[Batch],
    precision: str,
    lr: float,
    weight_decay: float,
    clip_grad: float,
    micro_batches: int,
    main_grads: bool,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    master = copy.deepcopy(model).float()
    compute = copy.deepcopy(model).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    opt = torch.optim.AdamW(decay_param_groups(master.named_parameters(), weight_decay), lr=lr)
    pairs = list(zip(master.parameters(), compute.parameters()))
    losses = []
    for idx, targets in batches:
        loss = torch.zeros(())
        for x, y in zip(idx.chunk(micro_batches), targets.chunk(micro_batches)):
            part = compute(x, y) / micro_batches
            part.backward()
            loss += part.detach()
            if main_grads:  # each micro-batch's gradient summed in fp32
                for m, c in pairs:
                    m.grad = c.grad.float() if m.grad is None else m.grad + c.grad.float()
                    c.grad = None
        for m, c in pairs:
            if c.grad is not None:
                m.grad = c.grad.float()
                c.grad = None
        if clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip_grad)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, c in pairs:
                c.copy_(m)
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}
