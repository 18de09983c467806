"""Text generation with a key/value cache (one process): prefill a batch of prompts, then one
token per step; greedy or sampled (temperature, top-k, top-p), stop token ids, a budget of
new tokens.

A request's sampled tokens depend on its own seed only: each request draws from its own
``torch.Generator``, so the same seed gives the same tokens whether the prompt runs alone or
batched with others (up to the round-off of a batched matrix product moving a near tie).
Log-probabilities are the model's own (before temperature and filtering).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mt_model.cache import KVCache
from mt_model.gpt import GPT

__all__ = ["Completion", "Sampling", "generate", "pick"]


@dataclass(frozen=True)
class Sampling:
    """How the next tokens of one request are chosen."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    """0: greedy (the most likely token, the first of ties); > 0: sample from softmax(logits
    / temperature)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities add up to p (1: all)."""
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    """Token ids that end the completion (not part of it)."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class Completion:
    """What one request generated."""

    tokens: list[int]
    """The new tokens (a stop token excluded)."""
    logprobs: list[float]
    """The model's log-probability of each new token."""
    finish_reason: str
    """``stop`` (a stop token came) or ``length`` (the budget ran out)."""


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token from one row of logits [vocab] (float32)."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scores, min(sampling.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) >= sampling.top_p  # keep the first
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: GPT, prompts: Sequence[Sequence[int]],
             sampling: Sampling | Sequence[Sampling],
             on_token: Callable[[int, int], None] | None = None) -> list[Completion]:
    """Complete every prompt (token ids) in one left-padded batch; ``sampling`` for all or one
    per prompt; ``on_token(row, token)`` as each new token comes (streaming). Raises
    ValueError naming the numbers when a prompt plus its budget exceed the model's
    positions."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    rules = [sampling] * len(prompts) if isinstance(sampling, Sampling) else list(sampling)
    if len(rules) != len(prompts):
        raise ValueError(f"{len(rules)} sampling rules for {len(prompts)} prompts")
    longest, budget = max(len(p) for p in prompts), max(r.max_new_tokens for r in rules)
    limit = model.config.seq_len
    if longest + budget > limit:
        raise ValueError(f"prompt of {longest} tokens + {budget} new tokens exceed the "
                         f"model's {limit} positions")
    device = next(model.parameters()).device
    pad = [longest - len(p) for p in prompts]
    cache = KVCache(len(model.blocks), pad, longest + budget)
    ids = torch.zeros(len(prompts), longest, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, pad[row]:] = torch.tensor(list(prompt), dtype=torch.int64)
    generators = []
    for rule in rules:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(rule.seed)
        generators.append(generator)
    was_training = model.training
    model.eval()
    try:
        logits = model(ids.to(device), cache=cache)[:, -1]
        out: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        reason: list[str | None] = [None] * len(prompts)
        for step in range(budget):
            last = logits.float().cpu()
            logp = F.log_softmax(last, dim=-1)
            chosen = []
            for row, rule in enumerate(rules):
                token = 0
                if reason[row] is None:
                    token = pick(last[row], rule, generators[row])
                    if token in rule.stop_ids:
                        reason[row] = "stop"
                    else:
                        out[row].append(token)
                        logprobs[row].append(float(logp[row, token]))
                        if on_token is not None:
                            on_token(row, token)
                        if len(out[row]) == rule.max_new_tokens:
                            reason[row] = "length"
                chosen.append(token)
            if all(r is not None for r in reason) or step == budget - 1:
                break
            step_ids = torch.tensor(chosen, dtype=torch.int64, device=device).unsqueeze(1)
            logits = model(step_ids, cache=cache)[:, -1]
    finally:
        model.train(was_training)
    return [Completion(out[r], logprobs[r], reason[r] or "length") for r in range(len(prompts))]
