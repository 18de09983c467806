"""OpenAI's completions API as `mt serve` speaks it: a request body checked field by field
into a :class:`Completion` to run (or an :class:`ApiError`: the HTTP status and a message
naming the field), and the response bodies (whole, or as server-sent-event chunks).

Fields: ``model``, ``prompt`` (a string, a list of strings, a list of token ids or a list of
such lists), ``max_tokens`` (default 16), ``temperature`` (default 1), ``top_p``, ``top_k``
(an extension), ``stop`` (a string or up to 4), ``seed``, ``logprobs`` (0-5: the chosen token's
log-probability and that many alternatives), ``echo`` (the prompt in the text, and its tokens'
log-probabilities with ``logprobs``), ``stream`` (with ``stream_options.include_usage``: a last
chunk with the usage), ``n`` (completions per prompt), ``user``. Penalties, ``best_of`` > 1,
``suffix`` and ``logit_bias`` are refused by name rather than ignored, and so is any field
this server does not know (a misspelt ``max_token`` would otherwise silently get the default).
Every number is range-checked (NaN and infinities are refused), every string must be valid
Unicode (JSON allows lone surrogates, which no tokenizer or response can carry).
"""

from __future__ import annotations

import codecs
import difflib
import hashlib
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mt_data.text import not_utf8
from mt_model import SEED_MAX, PromptScores, Sampling, Token

__all__ = ["ApiError", "Choice", "Completion", "FIELDS", "Limits", "chunk_body",
           "completion_body", "error_body", "parse_completion", "usage_body"]


class ApiError(Exception):
    """A request the server refuses: HTTP ``status``, a message, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code = code


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
    """Rows (prompts x n) of one request at most."""
    max_tokens: int | None = None
    """New tokens per prompt at most (None: what the positions allow)."""

    @property
    def token_cap(self) -> int:
        """The most new tokens any request may ask (a one-token prompt's room)."""
        room = self.max_positions - 1
        return room if self.max_tokens is None else min(room, self.max_tokens)


@dataclass(frozen=True)
class Completion:
    """A checked request: its prompts as token ids (and as text, for echo); one sampling
    rule per row (row ``r`` completes prompt ``r // n``)."""

    model: str
    prompts: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]
    sampling: tuple[Sampling, ...]
    stop: tuple[str, ...]
    logprobs: int | None
    echo: bool
    stream: bool
    n: int = 1
    include_usage: bool = False

    @property
    def rows(self) -> int:
        return len(self.sampling)


FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
          "logprobs", "echo", "stream", "stream_options", "n", "user", "presence_penalty",
          "frequency_penalty", "best_of", "suffix", "logit_bias")
"""Every field a request may hold (the last five only at their neutral values)."""

_MAX_DEPTH = 8  # the deepest a valid body nests: {"prompt": [[ids]]} is 3


def _unicode(body: Any) -> None:
    """Refuse a body nested deeper than any valid one, or holding a string that is not valid
    Unicode (a lone surrogate), naming where (iteratively: no depth overflows the stack)."""
    todo: list[tuple[Any, str, int]] = [(body, "", 0)]
    while todo:
        value, where, depth = todo.pop()
        if depth > _MAX_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {_MAX_DEPTH} levels "
                           f"(at '{where}')", where.split("[")[0].split(".")[0] or None)
        if isinstance(value, str):
            _valid_text(value, where or "the body")
        elif isinstance(value, dict):
            for key, item in value.items():
                _valid_text(key, f"a field name in '{where}'" if where else "a field name")
                todo.append((item, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(value, list):
            todo += [(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]


def _valid_text(text: str, where: str) -> None:
    if why := not_utf8(text):
        name = where.split("[")[0].split(".")[0]
        raise ApiError(400, f"'{where}' is not valid Unicode: {why}",
                       name if name in FIELDS else None)


def _number(body: dict, name: str, default: Any, kind: type, low: float,
            high: float) -> Any:
    """``body[name]`` (``default`` when absent or null): a finite number (an integer, not
    3.0, for ``kind`` int, as the schema says) in [low, high]."""
    value = body.get(name)
    if value is None:
        return default
    whole = kind is int
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
        raise ApiError(400, f"'{name}' must be {'an integer' if whole else 'a number'}, got "
                       f"{_show(value)}", name)
    finite = isinstance(value, int) or math.isfinite(value)  # a huge int is no float
    if not (finite and low <= value <= high):
        raise ApiError(400, f"'{name}' must be between {low:g} and {high:g}, got "
                       f"{_show(value)}" if not whole else
                       f"'{name}' must be between {int(low)} and {int(high)}, got "
                       f"{_show(value)}", name)
    return kind(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
            encoded = encode(item) if item else []
            if not encoded:
                raise ApiError(400, "a prompt encodes to no tokens", "prompt")
            tokens.append(tuple(encoded))
            texts.append(item)
        else:
            bad = [t for t in item if not 0 <= t < limits.vocab_size]
            if bad:
                raise ApiError(400, f"token id {_show(bad[0])} is outside the vocabulary "
                               f"(0..{limits.vocab_size - 1})", "prompt")
            if len(item) >= limits.max_positions:
                raise ApiError(400, f"a prompt of {len(item)} tokens leaves no room in the "
                               f"model's {limits.max_positions} positions", "prompt")
            tokens.append(tuple(item))
            texts.append(decode(list(item)))
    return tokens, texts


def _refuse_unknown(body: dict) -> None:
    unknown = [name for name in body if name not in FIELDS]
    if unknown:
        guess = difflib.get_close_matches(unknown[0], FIELDS, n=1)
        hint = f" (did you mean '{guess[0]}'?)" if guess else ""
        names = ", ".join(f"'{_show(name)[1:-1]}'" for name in unknown[:5])
        raise ApiError(400, f"unknown field{'s' if len(unknown) > 1 else ''} {names}{hint}; "
                       f"mt serve takes {', '.join(FIELDS[:14])}", unknown[0])


def _refuse_unsupported(body: dict, n: int) -> None:
    neutral = {"presence_penalty": (0,), "frequency_penalty": (0,), "best_of": (1, n),
               "suffix": ("",), "logit_bias": ({},)}
    for name, allowed in neutral.items():
        value = body.get(name)
        if not any(_same(value, a) for a in (None, *allowed)):
            raise ApiError(400, f"'{name}' is not supported by mt serve (only its neutral "
                           f"value {allowed[0]!r} or null), got {_show(value)}", name)


def _same(value: Any, neutral: Any) -> bool:
    if isinstance(value, bool) or isinstance(neutral, bool):
        return False
    numbers = isinstance(value, (int, float)) and isinstance(neutral, (int, float))
    return (numbers or type(value) is type(neutral)) and value == neutral


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {_show(value)}", name)
    return value


def _text_field(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string, got {_show(value)}", name)
    return value


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > 4 or not all(
            isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them",
                       "stop")
    return stops


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, "'stream_options' must be an object with only 'include_usage'",
                       "stream_options")
    usage = _flag(options, "include_usage")
    if usage and not stream:  # asked for something a whole response cannot give
        raise ApiError(400, "'stream_options.include_usage' is only for a request with "
                       "'stream': true (a whole response always has its usage)",
                       "stream_options")
    return usage


def sample_seed(seed: int, sample: int) -> int:
    """The seed of completion ``sample`` of a prompt of a request with ``seed``: the seed
    itself for the first, a hash of both for the others (so n > 1 draws n different ones,
    each the same at every call)."""
    if sample == 0:
        return seed
    digest = hashlib.sha256(f"{seed}\0{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & SEED_MAX


def parse_completion(body: Any, model: str, encode: Callable[[str], list[int]],
                     decode: Callable[[list[int]], str], limits: Limits,
                     stop_ids: Sequence[int] = ()) -> Completion:
    """The :class:`Completion` a request body asks for, or an :class:`ApiError` naming the
    field at fault (``model`` is the name this server answers to)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _unicode(body)
    _refuse_unknown(body)
    asked = _text_field(body, "model")
    if asked is not None and asked != model:
        raise ApiError(404, f"the model '{_show(asked)[1:-1]}' does not exist; this server "
                       f"serves '{model}'", "model", code="model_not_found")
    _text_field(body, "user")
    n = _number(body, "n", 1, int, 1, limits.max_prompts)
    _refuse_unsupported(body, n)
    prompts, texts = _prompts(body.get("prompt"), encode, decode, limits)
    if len(prompts) * n > limits.max_prompts:
        raise ApiError(400, f"{len(prompts)} prompts x 'n' {n} = {len(prompts) * n} "
                       f"completions, more than the {limits.max_prompts} a request may ask",
                       "n")
    longest = max(len(p) for p in prompts)
    room = limits.max_positions - longest
    if room < 1:
        raise ApiError(400, f"a prompt of {longest} tokens leaves no room in the model's "
                       f"{limits.max_positions} positions", "prompt")
    max_tokens = _number(body, "max_tokens", min(16, room, limits.token_cap), int, 1,
                         limits.token_cap)
    if max_tokens > room:
        raise ApiError(400, f"'max_tokens' {max_tokens} + a prompt of {longest} tokens "
                       f"exceed the model's {limits.max_positions} positions", "max_tokens")
    temperature = _number(body, "temperature", 1.0, float, 0, 2)
    top_p = _number(body, "top_p", 1.0, float, 0, 1)
    if top_p == 0:
        raise ApiError(400, "'top_p' must be above 0, got 0", "top_p")
    top_k = _number(body, "top_k", 0, int, 0, limits.vocab_size)
    seed = _number(body, "seed", None, int, 0, SEED_MAX)
    logprobs = _number(body, "logprobs", None, int, 0, 5)
    stops = _stops(body)
    echo, stream = _flag(body, "echo"), _flag(body, "stream")
    include_usage = _include_usage(body, stream)
    rules = []
    for _ in prompts:
        for sample in range(n):  # without a seed each row draws its own
            rule_seed = sample_seed(seed, sample) if seed is not None else \
                secrets.randbits(63)
            rules.append(Sampling(max_tokens, temperature, top_k, top_p, rule_seed,
                                  tuple(stop_ids)))
    return Completion(model, tuple(prompts), tuple(texts), tuple(rules), tuple(stops),
                      logprobs, echo, stream, n, include_usage)


@dataclass
class Choice:
    """One row's answer as it is built: its text, tokens and their log-probabilities."""

    index: int
    text: str = ""
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    offset: int = 0
    """Where the first of ``tokens`` starts in the whole text (a streamed chunk's: the
    characters of the tokens sent before it)."""
    widths: list[int] | None = None
    """The characters of the text each of ``tokens`` completes (:class:`TokenEntries`)."""

    def logprobs_body(self) -> dict[str, Any] | None:
        if self.tokens is None:
            return None
        offsets, at = [], self.offset
        for width in self.widths or ():
            offsets.append(at)
            at += width
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": offsets}


def token_label(raw: bytes) -> str:
    """A token's ``logprobs`` text: its bytes as text, or, where they are not UTF-8 alone
    (part of a character), ``bytes:\\xNN...`` as OpenAI writes such tokens."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


class TokenEntries:
    """One row's token entries for ``logprobs``: each token's text (:func:`token_label`)
    and how many characters of the row's text it completes. A byte-level token may end
    inside a character; the character counts for the token that completes it, so that the
    ``text_offset`` of every token indexes the text, and the widths add up to its length."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def label(self, token: int) -> str:
        return token_label(self._bytes(token))

    def entries(self, tokens: Sequence[int]) -> tuple[list[str], list[int]]:
        """The texts and widths of the row's next ``tokens``."""
        raw = [self._bytes(token) for token in tokens]
        return ([token_label(piece) for piece in raw],
                [len(self._decoder.decode(piece)) for piece in raw])

    def top(self, top: Sequence[tuple[int, float]]) -> dict[str, float]:
        """OpenAI's ``top_logprobs`` entry: token text -> log-probability (the likelier
        kept where two ids have the same text)."""
        out: dict[str, float] = {}
        for token, logprob in top:
            out.setdefault(self.label(token), logprob)
        return out


def token_logprobs(choice: Choice, pieces: Sequence[str], widths: Sequence[int],
                   logprobs: Sequence[float | None],
                   tops: Sequence[dict[str, float] | None]) -> None:
    """Append tokens (their text and widths), log-probabilities and alternatives to
    ``choice``."""
    if choice.tokens is None:
        choice.tokens, choice.widths = [], []
        choice.token_logprobs, choice.top_logprobs = [], []
    assert choice.token_logprobs is not None and choice.top_logprobs is not None
    assert choice.widths is not None
    choice.tokens += pieces
    choice.widths += widths
    choice.token_logprobs += logprobs
    choice.top_logprobs += tops


def move_logprobs(source: Choice, targets: Sequence[Choice], keep: int | None = None) -> None:
    """Move ``source``'s token entries (the first ``keep`` of them; None: all) to the end of
    each of ``targets``, leaving ``source`` without any."""
    if source.tokens is None:
        return
    assert source.token_logprobs is not None and source.top_logprobs is not None
    assert source.widths is not None
    end = len(source.tokens) if keep is None else max(0, keep)
    for target in targets:
        token_logprobs(target, source.tokens[:end], source.widths[:end],
                       source.token_logprobs[:end], source.top_logprobs[:end])
    source.tokens = source.widths = source.token_logprobs = source.top_logprobs = None


def scores_logprobs(choices: Sequence[Choice], prompt: Sequence[int],
                    scores: PromptScores | None, entries: TokenEntries) -> None:
    """The echoed prompt's tokens, appended to each of ``choices``: the first has no
    log-probability (nothing before it)."""
    pieces, widths = entries.entries(prompt)
    logprobs: list[float | None] = [None] * len(prompt)
    tops: list[dict[str, float] | None] = [None] * len(prompt)
    if scores is not None:
        logprobs = [None, *scores.logprobs]
        tops = [None, *(entries.top(t) for t in scores.top)]
    for choice in choices:
        token_logprobs(choice, pieces, widths, logprobs, tops)


def new_logprobs(choice: Choice, event: Token, entries: TokenEntries) -> None:
    """A generated token's entry."""
    assert event.token is not None
    pieces, widths = entries.entries([event.token])
    token_logprobs(choice, pieces, widths, [event.logprob], [entries.top(event.top)])


def usage_body(choices: Sequence[Choice]) -> dict[str, int]:
    """Tokens of the prompts (each counted once, as OpenAI does with n > 1: a prompt's other
    completions carry 0) and of the completions."""
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_body(ident: str, model: str, created: int, choices: Sequence[Choice]
                    ) -> dict[str, Any]:
    """The whole response of a request that did not stream."""
    return {"id": ident, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text, "logprobs": c.logprobs_body(),
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage_body(choices)}


def chunk_body(ident: str, model: str, created: int, choice: Choice | None,
               usage: dict[str, int] | None = None, include_usage: bool = False
               ) -> dict[str, Any]:
    """One server-sent event of a streamed response: ``choice``'s new text (and tokens), or
    (``choice`` None) the last chunk's usage; with ``include_usage`` every chunk has a
    ``usage`` field (null but in the last), as OpenAI's stream_options asks."""
    body: dict[str, Any] = {"id": ident, "object": "text_completion", "created": created,
                            "model": model, "choices": [] if choice is None else [
                                {"index": choice.index, "text": choice.text,
                                 "logprobs": choice.logprobs_body(),
                                 "finish_reason": choice.finish_reason}]}
    if include_usage:
        body["usage"] = usage
    return body


def now() -> int:
    """Seconds since the epoch (the ``created`` field)."""
    return int(time.time())
