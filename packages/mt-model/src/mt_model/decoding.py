"""Text generation with a key/value cache: prefill a batch of prompts, then one token per
step; greedy or sampled (temperature, top-k, top-p), stop token ids, a budget of new tokens.

:class:`DecodeBatch` batches continuously: requests join a running batch (their prompts are
prefilled and their caches joined) and leave it as they finish, so a server keeps decoding
while requests come and go. It runs any :class:`DecodeModel`: the whole model on this process
(:class:`WholeModel`), or this rank's part of a tensor- and pipeline-parallel one, where the
ranks holding the logits choose the tokens and :meth:`DecodeModel.share` hands them to the
others (every rank of the model calls the batch's methods in the same order).

A request's sampled tokens depend on its own seed only: each request draws from its own
``torch.Generator``, so the same seed gives the same tokens whether the prompt runs alone or
batched with others (up to the round-off of a batched matrix product moving a near tie).
Log-probabilities are the model's own (before temperature and filtering).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from mt_model.cache import KVCache
from mt_model.gpt import GPT

__all__ = ["Completion", "DecodeBatch", "DecodeModel", "DecodeRequest", "PromptScores",
           "SEED_MAX", "Sampling", "Token", "WholeModel", "generate", "interleave", "pick"]


SEED_MAX = 2**63 - 1
"""The largest seed of a request (torch's generators take 64 bits; JSON clients a signed
64-bit integer)."""


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
    """Seed of this request's own generator: 0 <= seed <= :data:`SEED_MAX`."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end the completion (not part of it)."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed <= SEED_MAX:
            problems.append(f"seed must be an integer between 0 and {SEED_MAX} (2**63 - 1), "
                            f"got {self.seed}")
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


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn from ``probs`` (any scale): the first whose cumulative probability
    exceeds a uniform draw (one number from ``generator``; a tenth of torch.multinomial's
    time over a vocabulary of 50k)."""
    cumulative = probs.double().cumsum(0)
    x = torch.rand((), generator=generator, dtype=torch.float64) * cumulative[-1]
    return min(int(torch.searchsorted(cumulative, x, right=True)), probs.numel() - 1)


_REDRAWS = 64
"""Draws from all tokens :func:`pick` tries before it sorts for the nucleus (a nucleus of
p is hit with probability p or more per draw: above 0.1, 64 draws all miss once in 10^3)."""


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token from one row of logits [vocab] (float32, on the CPU)."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits / sampling.temperature
    if not bool(torch.isfinite(scores).all()):  # a temperature so small it overflows: greedy,
        return int(torch.argmax(logits))        # the limit of sampling as it goes to 0
    if sampling.top_k:
        kth = torch.topk(scores, min(sampling.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1:
        # The nucleus: every token that the tokens likelier than it hold under p of the
        # probability. A draw from all tokens, redrawn until it lies in the nucleus, is a draw
        # from the nucleus (renormalised), without sorting the vocabulary: the nucleus holds
        # p or more, so a draw is kept with probability p or more. A small p could take
        # 1 / p draws: after a few, the nucleus is found by sorting instead (the same
        # distribution, in bounded time).
        for _ in range(_REDRAWS):
            token = _draw(probs, generator)
            if float(probs[probs > probs[token]].sum()) < sampling.top_p:
                return token
        ordered = torch.sort(probs, descending=True).values
        before = ordered.double().cumsum(0) - ordered.double()  # mass of the likelier ones
        least = ordered[int((before < sampling.top_p).sum()) - 1]  # the nucleus' least prob.
        return _draw(probs.masked_fill(probs < least, 0.0), generator)
    return _draw(probs, generator)


@dataclass(frozen=True)
class DecodeRequest:
    """One prompt (token ids) to complete, and how."""

    prompt: tuple[int, ...]
    sampling: Sampling = Sampling()
    echo: bool = False
    """Also score the prompt's own tokens (their log-probabilities, from the prefill)."""
    top_logprobs: int = 0
    """Report the k most likely tokens at every scored position (0: none)."""
    logprobs: bool = True
    """Report each new token's log-probability (else NaN: a softmax over the vocabulary per
    token saved)."""


@dataclass(frozen=True)
class Token:
    """What one step gave one request."""

    key: Hashable
    token: int | None
    """The new token; None when a stop token ended the request (it is not part of it)."""
    logprob: float
    """The model's log-probability of the token (of the stop token when ``token`` is None)."""
    top: tuple[tuple[int, float], ...]
    """The ``top_logprobs`` most likely tokens and their log-probabilities."""
    finish: str | None
    """``stop`` or ``length`` when the request ended at this step, else None."""


@dataclass(frozen=True)
class PromptScores:
    """The log-probability of each prompt token after the first (and the top tokens at each
    of those positions), for a request with ``echo``."""

    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


class DecodeModel(Protocol):
    """How :class:`DecodeBatch` runs a model on this rank."""

    layers: int
    """Transformer layers of the whole model (the cache's entries)."""
    max_positions: int
    picks: bool
    """This rank holds the logits and chooses the tokens."""
    device: torch.device
    stage: int
    """This rank's pipeline stage (0 of 1 for a whole model)."""
    stages: int

    def logits(self, ids: torch.Tensor, cache: KVCache, every: bool) -> torch.Tensor | None:
        """Run ``ids`` [b, s] (each row's next tokens) through the model, extending
        ``cache``; float32 logits over the real vocabulary, of the last position [b, V] or of
        ``every`` position [b, s, V], where :attr:`picks`, else None."""

    def share(self, payload: Any) -> Any:
        """``payload`` of the picking ranks, returned on every rank of the model."""


class WholeModel:
    """A whole mt-model ``GPT`` on this process as a :class:`DecodeModel`."""

    picks, stage, stages = True, 0, 1

    def __init__(self, model: GPT) -> None:
        self.model, self.layers = model, len(model.blocks)
        self.max_positions = model.config.seq_len
        self.device = next(model.parameters()).device

    def logits(self, ids: torch.Tensor, cache: KVCache, every: bool) -> torch.Tensor:
        out = self.model(ids, cache=cache, last=not every)
        return (out if every else out[:, -1]).float()

    def share(self, payload: Any) -> Any:
        return payload


@dataclass
class _Row:
    key: Hashable
    request: DecodeRequest
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)

    @property
    def left(self) -> int:
        return self.request.sampling.max_new_tokens - len(self.tokens)


def _top(logp: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    if k <= 0:
        return ()
    values, ids = torch.topk(logp, min(k, logp.numel()))
    return tuple(zip(ids.tolist(), values.tolist(), strict=True))


class DecodeBatch:
    """Requests decoded together, one token each per :meth:`step`; requests join with
    :meth:`add` and leave when they finish or are cancelled (see the module docstring)."""

    def __init__(self, model: DecodeModel) -> None:
        self.model = model
        self.rows: list[_Row] = []
        self.cache: KVCache | None = None
        self._next: torch.Tensor | None = None  # [rows, V] logits of each row's next token

    def __len__(self) -> int:
        return len(self.rows)

    def check(self, request: DecodeRequest) -> None:
        """ValueError naming the numbers when ``request`` cannot run on this model."""
        if not request.prompt:
            raise ValueError("every prompt needs at least one token")
        need = len(request.prompt) + request.sampling.max_new_tokens
        if need > self.model.max_positions:
            raise ValueError(f"prompt of {len(request.prompt)} tokens + "
                             f"{request.sampling.max_new_tokens} new tokens exceed the "
                             f"model's {self.model.max_positions} positions")

    @torch.no_grad()
    def add(self, requests: Sequence[DecodeRequest], keys: Sequence[Hashable]
            ) -> list[PromptScores | None]:
        """Prefill ``requests`` (named by ``keys``) and join them to the batch; returns the
        prompt scores of those with ``echo`` (None for the others)."""
        if len(keys) != len(requests) or not requests:
            raise ValueError(f"{len(keys)} keys for {len(requests)} requests")
        for request in requests:
            self.check(request)
        model = self.model
        longest = max(len(r.prompt) for r in requests)
        pad = [longest - len(r.prompt) for r in requests]
        cache = KVCache(model.layers, pad, longest + max(r.sampling.max_new_tokens
                                                         for r in requests))
        ids = torch.zeros(len(requests), longest, dtype=torch.int64)
        for row, request in enumerate(requests):
            ids[row, pad[row]:] = torch.tensor(request.prompt, dtype=torch.int64)
        every = any(r.echo for r in requests)
        logits = model.logits(ids.to(model.device), cache, every)
        scores: list[PromptScores | None] = [None] * len(requests)
        if model.picks:
            assert logits is not None
            if every:
                logp = F.log_softmax(logits[:, :-1].cpu(), dim=-1)
                for row, request in enumerate(requests):
                    if request.echo:
                        cols = range(pad[row], longest - 1)
                        targets = request.prompt[1:]
                        scores[row] = PromptScores(
                            tuple(float(logp[row, c, t]) for c, t in zip(cols, targets,
                                                                          strict=True)),
                            tuple(_top(logp[row, c], request.top_logprobs) for c in cols))
                logits = logits[:, -1]
            logits = logits.cpu()
        scores = model.share(scores) if every else scores
        rows = []
        for key, request in zip(keys, requests, strict=True):
            generator = torch.Generator(device="cpu")
            generator.manual_seed(request.sampling.seed)
            rows.append(_Row(key, request, generator))
        if self.cache is None:
            self.cache, self._next = cache, logits
        else:
            length = max(self.cache.length, cache.length)
            left = max(r.left for r in self.rows + rows)
            self.cache = self.cache.join(cache, length + left)
            if model.picks:
                assert self._next is not None and logits is not None
                self._next = torch.cat([self._next, logits])
        self.rows += rows
        return scores

    def cancel(self, keys: Sequence[Hashable]) -> None:
        """Drop the requests named by ``keys`` (a client that went away)."""
        gone = set(keys)
        self._keep([i for i, row in enumerate(self.rows) if row.key not in gone])

    def _keep(self, alive: list[int]) -> None:
        if len(alive) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in alive]
        if not alive:
            self.cache, self._next = None, None
            return
        assert self.cache is not None
        self.cache.keep(alive)
        if self._next is not None:
            self._next = self._next[alive]

    def step(self) -> list[Token]:
        """One token for every request; finished requests leave the batch."""
        events = self.choose()
        self.advance()
        return events

    @torch.no_grad()
    def choose(self) -> list[Token]:
        """Choose every request's next token (from the logits the last :meth:`advance` or
        :meth:`add` left); finished requests leave the batch."""
        if not self.rows:
            return []
        picked = None
        if self.model.picks:
            logits = self._next
            assert logits is not None
            # log-probability = logit - norm, where asked
            norm = torch.logsumexp(logits, dim=-1) if any(
                s.request.logprobs or s.request.top_logprobs for s in self.rows) else None
            greedy = logits.argmax(dim=-1).tolist()  # one call for every greedy row
            picked = []
            for row, state in enumerate(self.rows):
                rule = state.request.sampling
                token = greedy[row] if rule.temperature == 0 else \
                    pick(logits[row], rule, state.generator)
                top, logprob = (), float("nan")
                if norm is not None and state.request.top_logprobs:
                    top = _top(logits[row] - norm[row], state.request.top_logprobs)
                if norm is not None and state.request.logprobs:
                    logprob = float(logits[row, token] - norm[row])
                picked.append((token, logprob, top))
        picked = self.model.share(picked)
        events, alive = [], []
        for row, (state, (token, logprob, top)) in enumerate(zip(self.rows, picked,
                                                                  strict=True)):
            finish = None
            if token in state.request.sampling.stop_ids:
                events.append(Token(state.key, None, logprob, top, "stop"))
                continue
            state.tokens.append(token)
            if state.left == 0:
                finish = "length"
            else:
                alive.append(row)
            events.append(Token(state.key, token, logprob, top, finish))
        self._keep(alive)
        self._next = None
        return events

    @torch.no_grad()
    def advance(self) -> None:
        """Run the chosen tokens through the model (this rank's part of it)."""
        if self.rows:
            assert self.cache is not None
            ids = torch.tensor([[s.tokens[-1]] for s in self.rows], dtype=torch.int64)
            logits = self.model.logits(ids.to(self.model.device), self.cache, False)
            self._next = logits.cpu() if logits is not None else None


def interleave(batches: Sequence[DecodeBatch], stage: int, stages: int,
               on_tokens: Callable[[list[Token]], Sequence[Hashable]]) -> None:
    """Decode ``batches`` to the end. ``on_tokens(events)`` sees each batch's new tokens
    and returns the keys to cancel (every rank must return the same).

    One batch steps through the pipeline's stages as a whole. Several (``p``, at least
    ``stages``) keep every stage busy: at tick ``t`` stage ``s`` runs its part of batch
    ``(t - s) mod p``'s step, and at the tick's end every rank chooses the tokens of the
    batch whose step just left the last stage. That pays when a stage's step is bound by
    compute; a step bound by reading the weights (small batches) costs about as much for
    a part of the batch as for all of it, so splitting it does not.
    """
    p = len(batches)
    if 1 < p < stages:
        raise ValueError(f"{p} batches cannot keep {stages} stages busy")
    for batch in batches:  # the prefill's logits: the first tokens
        batch.cancel(on_tokens(batch.choose()))
    if p == 1 or stages == 1:
        while any(batches):
            for batch in batches:
                if batch:
                    batch.advance()
                    batch.cancel(on_tokens(batch.choose()))
        return
    tick = 0
    while any(batches):
        mine = tick - stage
        if mine >= 0 and batches[mine % p]:
            batches[mine % p].advance()
        done = tick - (stages - 1)
        if done >= 0 and batches[done % p]:
            batch = batches[done % p]
            batch.cancel(on_tokens(batch.choose()))
        tick += 1


def generate(model: GPT | DecodeModel, prompts: Sequence[Sequence[int]],
             sampling: Sampling | Sequence[Sampling],
             on_token: Callable[[int, int], None] | None = None,
             logprobs: bool = True) -> list[Completion]:
    """Complete every prompt (token ids) in one batch; ``sampling`` for all or one per
    prompt; ``on_token(row, token)`` as each new token comes (streaming); ``logprobs=False``
    leaves the completions' log-probabilities empty (and uncomputed). Raises ValueError
    naming the numbers when a prompt plus its budget exceed the model's positions."""
    rules = [sampling] * len(prompts) if isinstance(sampling, Sampling) else list(sampling)
    if len(rules) != len(prompts):
        raise ValueError(f"{len(rules)} sampling rules for {len(prompts)} prompts")
    if not prompts:
        return []
    whole = model if isinstance(model, GPT) else None
    was_training = whole is not None and whole.training
    if whole is not None:
        whole.eval()
    try:
        decoder = WholeModel(whole) if whole is not None else model
        batch = DecodeBatch(decoder)  # type: ignore[arg-type]
        batch.add([DecodeRequest(tuple(p), rule, logprobs=logprobs)
                   for p, rule in zip(prompts, rules, strict=True)], list(range(len(prompts))))
        out: list[list[int]] = [[] for _ in prompts]
        scores: list[list[float]] = [[] for _ in prompts]
        reason = ["length"] * len(prompts)
        while batch:
            for event in batch.step():
                row = int(event.key)  # type: ignore[call-overload]
                if event.token is not None:
                    out[row].append(event.token)
                    if logprobs:
                        scores[row].append(event.logprob)
                    if on_token is not None:
                        on_token(row, event.token)
                if event.finish is not None:
                    reason[row] = event.finish
    finally:
        if whole is not None:
            whole.train(was_training)
    return [Completion(out[r], scores[r], reason[r]) for r in range(len(prompts))]
