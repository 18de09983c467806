"""OpenAI's completions API as `mt serve` speaks it: a request body checked field by field
into a :class:`Completion` to run (or an :class:`ApiError`: the HTTP status and a message
naming the field), and the response bodies (whole, or as server-sent-event chunks).

Fields: ``model``, ``prompt`` (a string, a list of strings, a list of token ids or a list of
such lists), ``max_tokens`` (default 16), ``temperature`` (default 1), ``top_p``, ``top_k``
(an extension), ``stop`` (a string or up to 4), ``seed``, ``logprobs`` (0-5: the chosen token's
log-probability and that many alternatives), ``echo`` (the prompt in the text, and its tokens'
log-probabilities with ``logprobs``), ``stream``, ``n`` (1 only), ``user``. Penalties,
``best_of`` > 1, ``suffix`` and ``logit_bias`` are refused by name rather than ignored.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mt_model import PromptScores, Sampling, Token

__all__ = ["ApiError", "Choice", "Completion", "Limits", "chunk_body", "completion_body",
           "error_body", "parse_completion"]


class ApiError(Exception):
    """A request the server refuses: HTTP ``status``, a message, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Limits:
    """What one request may ask."""

    max_positions: int
    vocab_size: int
    max_prompts: int = 64
    max_tokens: int | None = None
    """New tokens per prompt at most (None: what the positions allow)."""


@dataclass(frozen=True)
class Completion:
    """A checked request: its prompts as token ids (and as text, for echo)."""

    model: str
    prompts: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]
    sampling: tuple[Sampling, ...]
    stop: tuple[str, ...]
    logprobs: int | None
    echo: bool
    stream: bool


_REFUSED = {"presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "suffix": None,
            "logit_bias": None}
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
          "logprobs", "echo", "stream", "n", "user", "stream_options", *_REFUSED}


def _number(body: dict, name: str, default: Any, kind: type, low: float | None = None,
            high: float | None = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ApiError(400, f"'{name}' must be {'a number' if kind is float else 'an integer'}"
                       f", got {value!r}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ApiError(400, f"'{name}' must be {bounds}, got {value!r}", name)
    return kind(value)


def _prompts(value: Any, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
             limits: Limits) -> tuple[list[tuple[int, ...]], list[str]]:
    def ids(item: Any) -> bool:
        return isinstance(item, list) and bool(item) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item)

    if isinstance(value, str):
        items: list[Any] = [value]
    elif ids(value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) or ids(v) for v in value):
        items = value
    else:
        raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids "
                       "or a list of lists of token ids (none empty)", "prompt")
    if len(items) > limits.max_prompts:
        raise ApiError(400, f"'prompt' holds {len(items)} prompts, more than the "
                       f"{limits.max_prompts} a request may hold", "prompt")
    tokens, texts = [], []
    for item in items:
        if isinstance(item, str):
            encoded = encode(item)
            if not encoded:
                raise ApiError(400, "a prompt encodes to no tokens", "prompt")
            tokens.append(tuple(encoded))
            texts.append(item)
        else:
            bad = [t for t in item if not 0 <= t < limits.vocab_size]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary "
                               f"(0..{limits.vocab_size - 1})", "prompt")
            tokens.append(tuple(item))
            texts.append(decode(list(item)))
    return tokens, texts


def parse_completion(body: Any, model: str, encode: Callable[[str], list[int]],
                     decode: Callable[[list[int]], str], limits: Limits,
                     stop_ids: Sequence[int] = ()) -> Completion:
    """The :class:`Completion` a request body asks for, or an :class:`ApiError` naming the
    field at fault (``model`` is the name this server answers to)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, neutral in _REFUSED.items():
        if body.get(name, neutral) not in (neutral, None):
            raise ApiError(400, f"'{name}' is not supported by mt serve", name)
    asked = body.get("model")
    if asked is not None and asked != model:
        raise ApiError(404, f"the model '{asked}' does not exist; this server serves "
                       f"'{model}'", "model", "model_not_found")
    if _number(body, "n", 1, int, 1, 1) != 1:
        raise ApiError(400, "'n' must be 1", "n")
    prompts, texts = _prompts(body.get("prompt"), encode, decode, limits)
    longest = max(len(p) for p in prompts)
    room = limits.max_positions - longest
    if room < 1:
        raise ApiError(400, f"a prompt of {longest} tokens leaves no room in the model's "
                       f"{limits.max_positions} positions", "prompt")
    cap = room if limits.max_tokens is None else min(room, limits.max_tokens)
    max_tokens = _number(body, "max_tokens", min(16, cap), int, 1)
    if max_tokens > cap:
        raise ApiError(400, f"'max_tokens' {max_tokens} + a prompt of {longest} tokens "
                       f"exceed the model's {limits.max_positions} positions" if cap == room
                       else f"'max_tokens' must be at most {cap}, got {max_tokens}",
                       "max_tokens")
    temperature = _number(body, "temperature", 1.0, float, 0, 2)
    top_p = _number(body, "top_p", 1.0, float, 0, 1)
    if top_p == 0:
        raise ApiError(400, "'top_p' must be above 0", "top_p")
    top_k = _number(body, "top_k", 0, int, 0)
    seed = _number(body, "seed", None, int)
    logprobs = _number(body, "logprobs", None, int, 0, 5)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > 4 or not all(
            isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them",
                       "stop")
    flags = {}
    for name in ("echo", "stream"):
        flags[name] = body.get(name, False)
        if not isinstance(flags[name], bool):
            raise ApiError(400, f"'{name}' must be true or false, got {flags[name]!r}", name)
    rules = []
    for _ in prompts:  # without a seed each prompt draws its own
        rule_seed = seed if seed is not None else secrets.randbits(63)
        rules.append(Sampling(max_tokens, temperature, top_k, top_p, rule_seed,
                              tuple(stop_ids)))
    return Completion(model, tuple(prompts), tuple(texts), tuple(rules), tuple(stops),
                      logprobs, flags["echo"], flags["stream"])


@dataclass
class Choice:
    """One prompt's answer as it is built: its text, tokens and their log-probabilities."""

    index: int
    text: str = ""
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0

    def logprobs_body(self) -> dict[str, Any] | None:
        if self.tokens is None:
            return None
        offsets, at = [], 0
        for token in self.tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": offsets}


def token_logprobs(choice: Choice, pieces: Sequence[str], logprobs: Sequence[float | None],
                   tops: Sequence[dict[str, float] | None]) -> None:
    """Append tokens (their text), log-probabilities and alternatives to ``choice``."""
    if choice.tokens is None:
        choice.tokens, choice.token_logprobs, choice.top_logprobs = [], [], []
    assert choice.token_logprobs is not None and choice.top_logprobs is not None
    choice.tokens += pieces
    choice.token_logprobs += logprobs
    choice.top_logprobs += tops


def top_dict(top: Sequence[tuple[int, float]], decode: Callable[[list[int]], str]
             ) -> dict[str, float]:
    """OpenAI's ``top_logprobs`` entry: token text -> log-probability (the likelier kept
    where two ids decode to the same text)."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(decode([token]), logprob)
    return out


def scores_logprobs(choice: Choice, prompt: Sequence[int], scores: PromptScores | None,
                    decode: Callable[[list[int]], str]) -> None:
    """The echoed prompt's tokens: the first has no log-probability (nothing before it)."""
    pieces = [decode([t]) for t in prompt]
    if scores is None:
        token_logprobs(choice, pieces, [None] * len(prompt), [None] * len(prompt))
        return
    token_logprobs(choice, pieces, [None, *scores.logprobs],
                   [None, *(top_dict(t, decode) for t in scores.top)])


def new_logprobs(choice: Choice, event: Token, decode: Callable[[list[int]], str]) -> None:
    """A generated token's entry."""
    assert event.token is not None
    token_logprobs(choice, [decode([event.token])], [event.logprob],
                   [top_dict(event.top, decode)])


def completion_body(ident: str, model: str, created: int, choices: Sequence[Choice]
                    ) -> dict[str, Any]:
    """The whole response of a request that did not stream."""
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(c.completion_tokens for c in choices)
    return {"id": ident, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text, "logprobs": c.logprobs_body(),
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}


def chunk_body(ident: str, model: str, created: int, choice: Choice) -> dict[str, Any]:
    """One server-sent event of a streamed response: ``choice``'s new text (and tokens)."""
    return {"id": ident, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": choice.index, "text": choice.text,
                         "logprobs": choice.logprobs_body(),
                         "finish_reason": choice.finish_reason}]}


def now() -> int:
    """Seconds since the epoch (the ``created`` field)."""
    return int(time.time())
