"""Evaluate tasks with any scorer: build requests, batch them by length, score, aggregate.

The scorer is the model side (:class:`Scorer`): it receives batches of
:class:`~mt_eval.requests.Request` and returns, per request, the summed log-likelihood of its
scored tokens and whether every one of them was the greedy choice. mt pretrain's stage
scorer (any TP x PP x DP layout) and the test suite's reference scorers implement it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mt_eval.metrics import aggregate, choice_scores, words
from mt_eval.requests import Request, build_requests, continuations, gold
from mt_eval.tasks import Task
from mt_eval.template import render_choices

__all__ = ["Scorer", "TaskResult", "batches_by_length", "evaluate"]

Score = tuple[float, bool]


class Scorer(Protocol):
    """The model side of an evaluation."""

    max_length: int
    """Positions the model sees at once (requests are cut to ``max_length + 1`` tokens)."""

    def __call__(self, batches: Sequence[Sequence[Request]],
                 advance: Callable[[int], None]) -> list[list[Score]]:
        """(log-likelihood, greedy) of every request of every batch; calls ``advance(n)``
        as batches holding n requests finish."""


@dataclass
class TaskResult:
    """What one task scored: metrics, their standard errors and per-document samples."""

    name: str
    output_type: str
    shots: int
    documents: int
    metrics: dict[str, float]
    stderr: dict[str, float | None]
    samples: list[dict[str, Any]] = field(default_factory=list)
    available: int = 0
    """Documents the task holds (``documents`` of them were evaluated: ``--limit``)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The task as configured (its YAML's keys, or what a built-in or JSONL task is)."""


def batches_by_length(requests: Sequence[Request], batch_size: int) -> list[list[Request]]:
    """Requests longest first (equal lengths by tokens, as lm-eval orders them), in batches
    of ``batch_size`` distinct inputs: requests that differ only in their last token (the
    one-token choices of a question) are adjacent in this order and count once, as a scorer
    runs their shared input once. Each batch pads little; the first shows the peak memory."""
    ordered = sorted(requests, key=lambda r: (-len(r.tokens), r.tokens))
    batches: list[list[Request]] = []
    inputs: set[tuple[int, ...]] = set()
    for request in ordered:
        key = request.tokens[:-1]
        if not batches or (key not in inputs and len(inputs) == batch_size):
            batches.append([])
            inputs = set()
        batches[-1].append(request)
        inputs.add(key)
    return batches


def _task_result(task: Task, shots: int, requests: list[Request],
                 scores: dict[tuple[int, int], Score]) -> TaskResult:
    per_doc: dict[int, list[tuple[int, Score]]] = {}
    for request in requests:
        per_doc.setdefault(request.doc_id, []).append(
            (request.index, scores[(request.doc_id, request.index)]))
    items, samples = [], []
    for doc_id in sorted(per_doc):
        results = [score for _, score in sorted(per_doc[doc_id])]
        lls, greedy = [ll for ll, _ in results], [g for _, g in results]
        sample: dict[str, Any] = {"doc_id": doc_id, "doc": task.docs[doc_id],
                                  "loglikelihoods": lls, "is_greedy": greedy}
        if task.output_type == "multiple_choice":
            choices = render_choices(task.doc_to_choice, task.docs[doc_id],
                                     f"{task.source}: document {doc_id}")
            sample["target"] = gold(task, doc_id)
            items.append(choice_scores(lls, choices, sample["target"]))
        elif task.output_type == "loglikelihood":
            sample["target"] = continuations(task, doc_id)[0]
            items.append({"ll": lls[0], "greedy": greedy[0]})
        else:
            text = continuations(task, doc_id)[0]
            sample["loglikelihoods"], sample["is_greedy"] = [sum(lls)], [all(greedy)]
            items.append({"ll": sum(lls), "words": words(text),
                          "bytes": len(text.encode("utf-8"))})
        samples.append(sample)
    values, errors = aggregate(task.output_type, items, task.metrics)
    config = dict(task.config) or {"task": task.name, "output_type": task.output_type,
                                   "source": task.source, "metric_list": [
                                       {"metric": m} for m in task.metrics]}
    return TaskResult(task.name, task.output_type, shots, len(items), values, errors, samples,
                      available=len(task.docs), config={**config, "num_fewshot": shots})


def evaluate(tasks: Sequence[Task], encode: Callable[[str], list[int]], prefix: int,
             scorer: Scorer, shots: int | None = None, seed: int | None = 1234,
             limit: int | None = None, batch_size: int = 16,
             progress: Callable[[int, int], None] | None = None) -> list[TaskResult]:
    """Score ``tasks``: ``shots`` examples each (default: the task's ``num_fewshot``, else
    0), drawn with ``seed``; the first ``limit`` documents of each; ``progress(done, total)``
    after each batch. ``encode`` is the tokenizer, ``prefix`` its end-of-text id."""
    plan = []
    for task in tasks:
        k = shots if shots is not None else (task.num_fewshot or 0)
        if task.output_type == "loglikelihood_rolling":
            k = 0
        plan.append((task, k, build_requests(task, encode, prefix, scorer.max_length, k, seed,
                                             limit)))
    everything = [(t, r) for t, (_task, _k, requests) in enumerate(plan) for r in requests]
    keyed = {id(r): t for t, r in everything}
    batches = batches_by_length([r for _, r in everything], batch_size)
    total, done = len(everything), 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    results = scorer(batches, advance)
    scores: list[dict[tuple[int, int], Score]] = [{} for _ in plan]
    for batch, scored in zip(batches, results, strict=True):
        for request, score in zip(batch, scored, strict=True):
            scores[keyed[id(request)]][(request.doc_id, request.index)] = score
    return [_task_result(task, k, requests, scores[t])
            for t, (task, k, requests) in enumerate(plan)]
