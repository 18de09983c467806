"""From task documents to scored token sequences, the way lm-evaluation-harness builds them.

Prompts: an optional description, ``k`` examples (question, target delimiter, answer,
few-shot delimiter), then the question. Examples are drawn by one ``random.Random(seed)``
per task, document after document (lm-eval's default sampler, so the same seed gives the
same examples). Multiple choice asks one request per choice (target delimiter + choice);
cloze one (context, target); rolling log-likelihood splits a document into windows of the
model's length, each predicting new tokens with as much context as fits.

Token pairs: trailing whitespace of the context moves to the continuation; the continuation
is what encoding context + continuation adds after the context's tokens; an empty context
becomes the prefix token (end-of-text). A request is then the last ``max_length + 1`` tokens
of context + continuation, of which the last ``len(continuation)`` are scored.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mt_eval.errors import TaskError
from mt_eval.tasks import Task
from mt_eval.template import render_choices, render_description, render_target, render_text

__all__ = ["Request", "build_requests", "encode_pair", "fewshot_sample", "rolling_windows"]

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class Request:
    """One scored sequence: ``tokens`` (at most ``max_length + 1``), the last ``scored`` of
    which are predicted; ``doc_id`` and ``index`` (choice or window) place the result."""

    doc_id: int
    index: int
    tokens: tuple[int, ...]
    scored: int


class FewshotSampler:
    """lm-eval's default sampler: ``Random(seed).sample`` of the pool, n + 1 drawn and the
    evaluated document removed when it may be among them."""

    def __init__(self, pool: Sequence[dict[str, Any]], seed: int | None) -> None:
        self.pool, self.rnd = list(pool), random.Random(seed)

    def sample(self, n: int, exclude: dict[str, Any] | None) -> list[dict[str, Any]]:
        if n == 0:
            return []
        if exclude is None:
            return self.rnd.sample(self.pool, n)
        chosen = [d for d in self.rnd.sample(self.pool, n + 1) if d != exclude][:n]
        if len(chosen) < n:  # copies of the document in the pool were drawn and removed
            chosen = self.rnd.sample([d for d in self.pool if d != exclude], n)
        return chosen


def fewshot_sample(task: Task, shots: int, seed: int | None) -> list[list[dict[str, Any]]]:
    """The examples of every document of ``task`` (in document order)."""
    pool = len(task.fewshot_docs) - (1 if task.exclude_self else 0)
    if shots > pool:
        raise TaskError(f"{task.source or task.name}: {shots} examples asked, but the pool "
                        f"holds {pool} documents")
    sampler = FewshotSampler(task.fewshot_docs, seed)
    try:
        return [sampler.sample(shots, doc if task.exclude_self else None) for doc in task.docs]
    except ValueError:  # random.sample's: was a traceback
        raise TaskError(f"{task.source or task.name}: {shots} examples asked, but the pool "
                        "holds fewer documents other than the one evaluated (the others are "
                        "copies of it)") from None


def _where(task: Task, doc_id: int) -> str:
    return f"{task.source or task.name}: document {doc_id}"


def _answer(task: Task, doc: dict[str, Any], where: str) -> str:
    target = render_target(task.doc_to_target, doc, task.doc_to_choice is not None, where)
    if isinstance(target, list):
        target = target[0]
    if isinstance(target, int):
        return _choices(task, doc, where)[_gold_index(target, _choices(task, doc, where),
                                                      where)]
    return str(target)


def _choices(task: Task, doc: dict[str, Any], where: str) -> list[str]:
    return render_choices(task.doc_to_choice, doc, where)


def _gold_index(target: Any, choices: list[str], where: str) -> int:
    if isinstance(target, list):
        target = target[0]
    if isinstance(target, str):
        if target not in choices:
            raise TaskError(f"{where}: target {target!r} is not one of the choices")
        return choices.index(target)
    if isinstance(target, bool) or not isinstance(target, int) or not (
            0 <= target < len(choices)):  # JSON true is no index (Python's 1)
        raise TaskError(f"{where}: target {target!r} is not an index into {len(choices)} "
                        "choices")
    return target


def gold(task: Task, doc_id: int) -> int:
    """Index of the right choice of a multiple-choice document."""
    doc, where = task.docs[doc_id], _where(task, doc_id)
    return _gold_index(render_target(task.doc_to_target, doc, True, where),
                       _choices(task, doc, where), where)


def _question(task: Task, doc: dict[str, Any], where: str) -> str:
    text = render_text(task.doc_to_text, doc, task.doc_to_choice is not None, where)
    if not isinstance(text, str):
        raise TaskError(f"{where}: doc_to_text gave {text!r}; tasks whose text selects among "
                        "several contexts are not supported")
    return text


def context(task: Task, doc_id: int, examples: list[dict[str, Any]]) -> str:
    """The prompt of document ``doc_id`` with its few-shot ``examples``."""
    parts = [render_description(task.description, task.docs[doc_id], _where(task, doc_id))]
    for example in examples:
        where = f"{task.source or task.name}: few-shot example"
        answer, question = _answer(task, example, where), _question(task, example, where)
        # As lm-eval: an example without an answer adds its question alone.
        parts.append(question + task.target_delimiter + answer + task.fewshot_delimiter
                     if answer != "" else question)
    parts.append(_question(task, task.docs[doc_id], _where(task, doc_id)))
    return "".join(parts)


def continuations(task: Task, doc_id: int) -> list[str]:
    """The scored continuation(s) of a document: one per choice, or the target."""
    doc, where = task.docs[doc_id], _where(task, doc_id)
    if task.output_type == "multiple_choice":
        return [task.target_delimiter + c for c in _choices(task, doc, where)]
    target = render_target(task.doc_to_target, doc, False, where)
    if not isinstance(target, str):
        raise TaskError(f"{where}: the target must be text, got {target!r}")
    return [target]


def encode_pair(encode: Encode, prefix: int, ctx: str, cont: str) -> tuple[list[int], list[int]]:
    """Context and continuation tokens as lm-eval's HF backend makes them."""
    if ctx == "":
        tokens = encode(cont)
        if not tokens:
            raise TaskError(f"continuation {cont!r} encodes to no tokens")
        return ([prefix], tokens) if tokens[0] != prefix else (tokens[:1], tokens[1:])
    spaces = len(ctx) - len(ctx.rstrip())
    if spaces:
        ctx, cont = ctx[:-spaces], ctx[-spaces:] + cont
    whole, head = encode(ctx + cont), encode(ctx)
    return head, whole[len(head):]


def rolling_windows(tokens: list[int], prefix: int, max_length: int
                    ) -> list[tuple[list[int], list[int]]]:
    """(context, predicted) windows covering every token once; each window predicts its
    tokens with up to ``max_length`` tokens of input (the first one after ``prefix``)."""
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows = [([prefix] + tokens[:first - 1], tokens[:first])]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_length)
        end = done + n
        windows.append((tokens[end - max_length - 1:end - 1], tokens[end - n:end]))
        done = end
    # Disjoint: the context holds what comes before the predicted tokens only.
    return [(ctx[:len(ctx) - (len(pred) - 1)], pred) for ctx, pred in windows]


def _request(doc_id: int, index: int, ctx: list[int], cont: list[int], max_length: int,
             where: str) -> Request:
    if not cont:
        raise TaskError(f"{where}: the continuation encodes to no tokens")
    if len(cont) > max_length:
        raise TaskError(f"{where}: the continuation has {len(cont)} tokens, more than the "
                        f"model's {max_length} positions")
    return Request(doc_id, index, tuple((ctx + cont)[-(max_length + 1):]), len(cont))


def build_requests(task: Task, encode: Encode, prefix: int, max_length: int, shots: int,
                   seed: int | None, limit: int | None = None) -> list[Request]:
    """Every request of ``task`` (its first ``limit`` documents), ``shots`` examples each."""
    n = len(task.docs) if limit is None else min(limit, len(task.docs))
    requests: list[Request] = []
    if task.output_type == "loglikelihood_rolling":
        for doc_id in range(n):
            where = _where(task, doc_id)
            windows = rolling_windows(encode(continuations(task, doc_id)[0]), prefix,
                                      max_length)
            if not windows:  # nothing to score: its metrics would leave it out
                raise TaskError(f"{where}: the text encodes to no tokens")
            for i, (ctx, pred) in enumerate(windows):
                requests.append(_request(doc_id, i, ctx, pred, max_length, where))
        return requests
    examples = fewshot_sample(task, shots, seed)[:n] if shots else [[]] * n
    for doc_id in range(n):
        where = _where(task, doc_id)
        ctx = context(task, doc_id, examples[doc_id])
        for i, cont in enumerate(continuations(task, doc_id)):
            ctx_ids, cont_ids = encode_pair(encode, prefix, ctx, cont)
            requests.append(_request(doc_id, i, ctx_ids, cont_ids, max_length, where))
    return requests
